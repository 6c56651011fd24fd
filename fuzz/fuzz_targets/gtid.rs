#![no_main]
//! Fuzz target: see outboxd::fuzzing::gtid and docs/fuzzing.md.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Errors are the expected answer to bad bytes; only a panic (or a sanitizer report) is a finding.
    let _ = outboxd::fuzzing::gtid(data);
});
