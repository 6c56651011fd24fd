//! The documentation stays true: every flag a command's `--help` lists is documented in
//! `docs/`, and `--help` never shows a secret taken from the environment.

use std::process::Command;

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .arg("--help")
        .env("OUTBOXD_SOURCE", "postgres://u:hunter2-secret@h/db")
        .output()
        .expect("run outboxd");
    assert!(out.status.success(), "{args:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

fn flags(text: &str) -> Vec<String> {
    let mut v: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2 && w.as_bytes()[2].is_ascii_lowercase())
        .map(str::to_string)
        .collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn every_flag_is_documented() {
    let docs: String = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/docs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "md"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    let commands: &[&[&str]] = &[
        &["run"],
        &["setup"],
        &["check"],
        &["status"],
        &["teardown"],
        &["offset", "set"],
        &["offset", "show"],
        &["health"],
    ];
    let mut missing = Vec::new();
    for cmd in commands {
        let text = help(cmd);
        assert!(
            !text.contains("hunter2-secret"),
            "{cmd:?} --help shows a secret"
        );
        for f in flags(&text) {
            if f == "--help" || f == "--version" {
                continue;
            }
            if !docs.contains(&format!("`{f}`")) && !docs.contains(&format!("`{f} ")) {
                missing.push(format!("{} {f}", cmd.join(" ")));
            }
        }
    }
    assert!(missing.is_empty(), "flags missing from docs/: {missing:?}");
}
