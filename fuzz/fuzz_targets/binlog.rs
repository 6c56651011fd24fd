#![no_main]
//! Fuzz target: see outboxd::fuzzing::binlog, outboxd::fuzzing::row_image and docs/fuzzing.md.
use libfuzzer_sys::fuzz_target;
use std::sync::Once;

static HOOK: Once = Once::new();

fuzz_target!(|data: &[u8]| {
    // libFuzzer's panic hook aborts on every panic, even one the decoder catches: keep it for
    // the panics nothing catches, and let the guarded binary JSON parsing turn its own into
    // errors, as it does in the relay.
    HOOK.call_once(|| {
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !outboxd::fuzzing::in_guarded_rows() {
                abort(info)
            }
        }));
    });
    // Errors are the expected answer to bad bytes; only a panic (or a sanitizer report) is a
    // finding. The same bytes as a binlog file through the decoder (outbox rows read column by
    // column), and as a table and its row images straight into the column reader.
    let _ = outboxd::fuzzing::binlog(data, &mut outboxd::fuzzing::Outcome::default());
    let _ = outboxd::fuzzing::row_image(data);
});
