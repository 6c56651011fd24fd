//! Build script: records the git commit the binary is built from, for `outboxd --version`.
//!
//! The commit comes from `OUTBOXD_COMMIT` when set (a Docker build has no `.git`), else from
//! `git rev-parse HEAD`, else it is `unknown`: a
//! build from a source archive must still succeed, so no failure here is fatal.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=OUTBOXD_COMMIT");
    let commit = match std::env::var("OUTBOXD_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => from_git().unwrap_or_else(|| "unknown".to_string()),
    };
    println!("cargo:rustc-env=OUTBOXD_COMMIT={commit}");
}

fn from_git() -> Option<String> {
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    // Rebuild when HEAD moves: HEAD itself (a checkout), the branch it names (a commit) and
    // packed-refs. Only files that exist: cargo reruns every time for a missing one.
    let mut watch = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch.push(r);
    }
    for w in watch {
        if let Some(p) = git(&["rev-parse", "--git-path", &w]) {
            if PathBuf::from(&p).exists() {
                println!("cargo:rerun-if-changed={p}");
            }
        }
    }
    Some(commit)
}
