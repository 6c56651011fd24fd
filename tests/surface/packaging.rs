//! Packaging basics stay true: the license files Cargo.toml names exist, the changelog has an
//! Unreleased section, `outboxd --version` names the commit it was built from, `ring` is the
//! only TLS crypto provider in the lock files (and the unmaintained `rustls-pemfile` in
//! neither), and nothing the repository ships (README, docs,
//! sources, scripts, migrations) points at a file outside it.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(p: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
}

#[test]
fn licenses_and_changelog() {
    let manifest = read("Cargo.toml");
    assert!(manifest.contains(r#"license = "MIT OR Apache-2.0""#));
    assert!(read("LICENSE-MIT").starts_with("MIT License"));
    assert!(
        read("LICENSE-APACHE").contains("Apache License\n                           Version 2.0")
    );
    let changelog = read("CHANGELOG.md");
    assert!(
        changelog.contains("## [Unreleased]"),
        "CHANGELOG.md has an Unreleased section"
    );
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        changelog.contains(&format!("## [{version}]")),
        "CHANGELOG.md has a section for {version}"
    );
}

#[test]
fn version_names_the_commit() {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(ROOT)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8(o.stdout).unwrap().trim().to_string());
    let expected = match head {
        Some(h) => h,
        // A source archive without .git: the build says so instead of failing.
        None => "unknown".to_string(),
    };
    assert_eq!(
        text.trim(),
        format!("outboxd {} (commit {expected})", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn ring_is_the_only_crypto_provider() {
    for lock in ["Cargo.lock", "fuzz/Cargo.lock"] {
        let text = read(lock);
        let packages: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("name = \""))
            .map(|l| l.trim_end_matches('"'))
            .collect();
        assert!(packages.contains(&"ring"), "{lock} has ring");
        // The one exception: librdkafka (the Kafka sink) has no rustls, and links the system
        // OpenSSL for its TLS and SCRAM (docs/kafka.md, docs/dependencies.md). Nothing else may.
        let dependents: Vec<String> = text
            .split("[[package]]")
            .filter(|block| block.contains("\n \"openssl-sys\""))
            .filter_map(|block| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix("name = \""))
                    .map(|n| n.trim_end_matches('"').to_string())
            })
            .collect();
        assert!(
            dependents.iter().all(|d| d == "rdkafka-sys"),
            "{lock}: openssl-sys is pulled in by {dependents:?}; only rdkafka-sys (the Kafka sink's librdkafka) may"
        );
        for p in ["aws-lc-rs", "aws-lc-sys", "aws-lc-fips-sys", "openssl"] {
            assert!(
                !packages.contains(&p),
                "{lock} pulls in {p}: find the dependency with `cargo tree -i {p}` and turn off its default features"
            );
        }
        // Unmaintained; PEM files are parsed with rustls-pki-types. async-nats 0.51 (the NATS
        // sink) does not use it either. The one exception is the RabbitMQ stream client, whose
        // 0.4 line (the last that speaks to RabbitMQ 3.10) links it for TLS files the sink never
        // hands it (docs/dependencies.md): no other package may pull it in.
        let dependents: Vec<&str> = text
            .split("[[package]]")
            .filter(|block| {
                block.lines().any(|l| {
                    let l = l.trim().trim_matches(|c| c == '"' || c == ',');
                    l == "rustls-pemfile" || l.starts_with("rustls-pemfile ")
                })
            })
            .filter_map(|block| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix("name = \""))
                    .map(|l| l.trim_end_matches('"'))
            })
            .collect();
        assert!(
            dependents.iter().all(|d| *d == "rabbitmq-stream-client"),
            "{lock} lists rustls-pemfile: find who pulls it in with `cargo tree -i rustls-pemfile` \
             (for fuzz/Cargo.lock: `--manifest-path fuzz/Cargo.toml`); a stale fuzz/Cargo.lock is \
             refreshed by copying Cargo.lock over it and running `cargo tree --manifest-path fuzz/Cargo.toml`"
        );
    }
}

#[test]
fn nothing_refers_to_files_outside_the_repository() {
    // Names of documents that exist only where the project was written, not in a clone.
    const FORBIDDEN: &[&str] = &[
        "CONTRACT.md",
        "CONTRACT §",
        "LAB.md",
        "design card",
        "/work/shared",
        "the seed's",
        "shared folder",
    ];
    let mut offenders = Vec::new();
    let mut stack: Vec<std::path::PathBuf> = [
        "README.md",
        "CHANGELOG.md",
        "docs",
        "src",
        "scripts",
        "migrations",
        "benches",
        "examples",
        "Dockerfile",
        "docker-compose.yml",
        "fuzz/fuzz_targets",
    ]
    .iter()
    .map(|p| Path::new(ROOT).join(p))
    .collect();
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&p) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            for f in FORBIDDEN {
                if line.contains(f) {
                    offenders.push(format!(
                        "{}:{}: {f}",
                        p.strip_prefix(ROOT).unwrap().display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "these lines point at documents outside the repository; make them stand alone: {offenders:#?}"
    );
}

/// The repository's root holds what a Rust project ships there and nothing else: a stray
/// file (a relay's log, a scratch script) fails here until it is removed or given its place.
#[test]
fn the_root_holds_only_what_belongs_there() {
    const ROOT_ENTRIES: &[&str] = &[
        ".ci",
        ".dockerignore",
        ".gitignore",
        "CHANGELOG.md",
        "Cargo.lock",
        "Cargo.toml",
        "Dockerfile",
        "LICENSE-APACHE",
        "LICENSE-MIT",
        "README.md",
        "benches",
        "build.rs",
        "docker",
        "docker-compose.yml",
        "docs",
        "examples",
        "fuzz",
        "migrations",
        // The Laravel package (outboxd/laravel), installed from this repository.
        "php",
        "scripts",
        "src",
        "tests",
    ];
    let out = Command::new("git")
        .args(["-C", ROOT, "ls-files"])
        .output()
        .expect("git runs");
    assert!(out.status.success(), "git ls-files failed in {ROOT}");
    let mut entries: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|p| p.split('/').next().unwrap().to_string())
        .collect();
    entries.sort();
    entries.dedup();
    let stray: Vec<&String> = entries
        .iter()
        .filter(|e| !ROOT_ENTRIES.contains(&e.as_str()))
        .collect();
    assert!(
        stray.is_empty(),
        "files at the repository root that do not belong there: {stray:?} (remove them, or move them where they belong)"
    );
}
