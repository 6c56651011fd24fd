//! Corpus replay on the stable toolchain: every seed, regression input and minimized corpus
//! entry of the fuzz targets (fuzz/{seeds,regressions,minimized}/<target>/) goes through the same
//! entry points the fuzzers call (`outboxd::fuzzing`). None may panic; the seeds, captured from real servers,
//! must still decode to the events they hold. docs/fuzzing.md says how the fuzzers run.

use outboxd::fuzzing::{self, Outcome};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

fn files(target: &str, kind: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(kind)
        .join(target);
    if kind != "seeds" && !dir.exists() {
        // Nothing found (or minimized) yet for this target: git keeps no empty directory.
        return Vec::new();
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.is_file())
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).expect("read corpus file"))
        })
        .collect()
}

/// Runs `f` on every seed and regression file of `target`; panics name every file that
/// panicked. Returns the seeds' results by file name.
fn replay<T>(target: &str, f: impl Fn(&[u8]) -> T) -> Vec<(String, T)> {
    let mut panicked = Vec::new();
    let mut seeds = Vec::new();
    for kind in ["seeds", "regressions", "minimized"] {
        for (name, data) in files(target, kind) {
            match catch_unwind(AssertUnwindSafe(|| f(&data))) {
                Ok(r) if kind == "seeds" => seeds.push((name, r)),
                Ok(_) => {}
                Err(_) => panicked.push(format!("fuzz/{kind}/{target}/{name}")),
            }
        }
    }
    assert!(panicked.is_empty(), "panicked on: {panicked:?}");
    assert!(!seeds.is_empty(), "no seeds for {target}");
    seeds
}

fn outcome_of(
    f: fn(&[u8], &mut Outcome) -> outboxd::Result<()>,
) -> impl Fn(&[u8]) -> (outboxd::Result<()>, Outcome) {
    move |data| {
        let mut o = Outcome::default();
        let r = f(data, &mut o);
        (r, o)
    }
}

#[test]
fn pgoutput_corpus() {
    let seeds = replay("pgoutput", outcome_of(fuzzing::pgoutput));
    for (name, (r, _)) in &seeds {
        assert!(r.is_ok(), "seed {name} no longer decodes: {r:?}");
    }
    // fuzz/capture-seeds.sh commits four outbox rows (one is rolled back and absent).
    let all = &seeds
        .iter()
        .find(|(n, _)| n == "seed-all")
        .expect("seed-all")
        .1;
    assert_eq!(all.1.events, 4, "seed-all: {:?}", all.1);
}

#[test]
fn binlog_corpus() {
    let seeds = replay("binlog", outcome_of(fuzzing::binlog));
    for (name, (r, o)) in &seeds {
        match name.as_str() {
            // Four committed outbox rows, one rolled back (fuzz/capture-seeds.sh).
            "seed-mariadb" => {
                assert!(r.is_ok(), "{name}: {r:?}");
                assert_eq!(o.events, 4, "{name}: {o:?}");
            }
            // Cut off inside its first event: an error, never a panic.
            "seed-mysql_common-binlog_truncated_event.000001" => {
                assert!(r.is_err(), "{name}: {o:?}")
            }
            // MySQL bytes without our outbox table: every event reads, none is ours.
            _ => {
                assert!(r.is_ok(), "{name}: {r:?}");
                assert!(o.messages > 0 && o.events == 0, "{name}: {o:?}");
            }
        }
    }
}

#[test]
fn gtid_corpus() {
    for (name, r) in replay("gtid", fuzzing::gtid) {
        assert!(r.is_ok(), "{name}: {r:?}");
    }
}

#[test]
fn envelope_corpus() {
    let seeds = replay("envelope", fuzzing::envelope);
    for (name, r) in &seeds {
        match name.as_str() {
            // docs/encryption.md's known-answer vector.
            "seed-known-answer" => {
                assert_eq!(r.as_deref().ok(), Some(&b"\"1234567890\""[..]), "{r:?}")
            }
            _ => assert!(r.is_err(), "{name} opened: {r:?}"),
        }
    }
}
