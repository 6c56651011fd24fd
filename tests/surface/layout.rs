//! The library's top-level modules import each other in one direction only. Each module's
//! `crate::` paths are read as text (outside comment lines; `#[cfg(test)]` modules included,
//! since a test module that imports back ties the two together just as well), and every pair of
//! top-level modules that import each other is a failure unless listed in [`KNOWN`] with why.
//! `cargo test --test surface layout -- --nocapture` prints the pairs and who makes them.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// Pairs that import each other today, each with its reason. `error` holds the crate's error
/// enum, which wraps the typed errors of the modules that return it (`#[from]`).
const KNOWN: &[(&str, &str, &str)] = &[
    ("crypto", "error", "Error::Crypto wraps CryptoError"),
    (
        "db",
        "error",
        "Error describes the database clients' errors",
    ),
    ("error", "sink", "Error::Sink wraps SinkError"),
];

/// The library's re-exports at the crate root, by the module that defines them.
const ROOT_NAMES: &[(&str, &str)] = &[
    ("Error", "error"),
    ("ErrorKind", "error"),
    ("ExitStatus", "error"),
    ("Result", "error"),
    ("ServerCode", "error"),
    ("should_retry", "error"),
    ("Checkpoint", "event"),
    ("OutboxEvent", "event"),
    ("SourcePosition", "event"),
    ("ColumnMap", "outbox"),
    ("NewEvent", "outbox"),
    ("Outbox", "outbox"),
    ("OutboxBackend", "outbox"),
    ("Sink", "sink"),
    ("Delivery", "sink"),
    ("SinkError", "sink"),
    ("MemorySink", "sink"),
    ("MemoryHandle", "sink"),
    ("Lease", "state"),
    ("StateStore", "state"),
    ("Stored", "state"),
    ("MemoryStore", "state"),
    ("MemoryStoreHandle", "state"),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The names a file's `crate::` paths start with (`crate::a::b` gives `a`, `crate::{a, b}`
/// gives both); a top-level file's `super::x` means the crate root too.
fn crate_names(text: &str, top_level_file: bool) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut prefixes = vec!["crate::"];
    if top_level_file {
        prefixes.push("super::");
    }
    for prefix in prefixes {
        for (at, _) in text.match_indices(prefix) {
            // Not part of a longer path (`outboxd_crate::`).
            let before = text[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let rest = &text[at + prefix.len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                for part in group.split(',') {
                    names.insert(ident(part.trim()));
                }
            } else {
                names.insert(ident(rest));
            }
        }
    }
    names
}

/// Top-level module → module it imports → the files that do.
fn imports() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let src = Path::new(ROOT).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let tops: BTreeSet<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_string();
            match name.strip_suffix(".rs") {
                Some("lib" | "main") => None,
                Some(stem) => Some(stem.to_string()),
                None if p.is_dir() => Some(name),
                None => None,
            }
        })
        .collect();
    let mut edges: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for file in files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .to_string();
        if rel == "lib.rs" || rel == "main.rs" {
            continue;
        }
        let top = rel.split('/').next().unwrap().trim_end_matches(".rs");
        let text: String = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for name in crate_names(&text, !rel.contains('/')) {
            let target = if tops.contains(&name) {
                Some(name.as_str())
            } else {
                ROOT_NAMES.iter().find(|(n, _)| *n == name).map(|(_, m)| *m)
            };
            if let Some(t) = target.filter(|t| *t != top) {
                edges
                    .entry(top.to_string())
                    .or_default()
                    .entry(t.to_string())
                    .or_default()
                    .insert(rel.clone());
            }
        }
    }
    edges
}

#[test]
fn layout_top_level_modules_import_each_other_in_one_direction() {
    let edges = imports();
    let mut pairs = Vec::new();
    for (a, to) in &edges {
        for (b, files) in to {
            if a < b {
                if let Some(back) = edges.get(b).and_then(|m| m.get(a)) {
                    pairs.push((a.clone(), b.clone(), files.clone(), back.clone()));
                }
            }
        }
    }
    println!(
        "{} pairs of top-level modules import each other:",
        pairs.len()
    );
    for (a, b, ab, ba) in &pairs {
        println!("  {a} <-> {b}: {a} -> {b} in {ab:?}; {b} -> {a} in {ba:?}");
    }
    let unknown: Vec<_> = pairs
        .iter()
        .filter(|(a, b, ..)| !KNOWN.iter().any(|(x, y, _)| x == a && y == b))
        .collect();
    assert!(
        unknown.is_empty(),
        "top-level modules that import each other (move what both need to the lower one, or pass it as a parameter): {unknown:#?}"
    );
    // A pair that no longer imports each other leaves the list, so that it cannot come back
    // unnoticed under an old excuse.
    let stale: Vec<_> = KNOWN
        .iter()
        .filter(|(x, y, _)| !pairs.iter().any(|(a, b, ..)| a == x && b == y))
        .collect();
    assert!(
        stale.is_empty(),
        "listed as importing each other but no longer do (remove them from KNOWN): {stale:?}"
    );
}
