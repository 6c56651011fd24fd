//! The encryption commands as a user runs them: JSON on stdin, JSON on stdout, a failure exits
//! non-zero with the reason on stderr, and no key material in any output.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

pub fn outboxd(args: &[&str], stdin: &str, env: &[(&str, &str)]) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
    cmd.env_remove("OUTBOXD_KEYRING").env_remove("OUTBOXD_KEYS");
    run(cmd, args, stdin, env, "cannot run outboxd")
}

/// Runs `cmd` with `args`, `stdin` written to it and `env` added; `spawn_failed` explains a
/// program that cannot be started.
pub fn run(
    mut cmd: Command,
    args: &[&str],
    stdin: &str,
    env: &[(&str, &str)],
    spawn_failed: &str,
) -> Out {
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{spawn_failed}: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn material_of(keyring: &Path) -> Vec<String> {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(keyring).unwrap()).unwrap();
    let mut out: Vec<String> = v["keys"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|k| k["key"].as_str().map(String::from))
        .collect();
    out.extend(
        v["blind_index"]["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["key"].as_str().unwrap().to_string()),
    );
    out
}

const SCHEMA: &str = r#"{"invoice_id": {"x-gdpr-sensitive": false},
  "customer_name": {"x-gdpr-sensitive": true},
  "tax_id": {"x-gdpr-sensitive": true},
  "total": {"x-gdpr-sensitive": false}}"#;
const PAYLOAD: &str =
    r#"{"invoice_id":42,"customer_name":"Ayşe Yılmaz","tax_id":"1234567890","total":12.5}"#;
const EVENT: &str = "0192f3a4-5b6c-7d8e-9f00-112233445566";

#[test]
fn encrypt_then_decrypt_on_stdin_and_stdout() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let schema = dir.path().join("schema.json");
    std::fs::write(&schema, SCHEMA).unwrap();
    let k = keys.to_str().unwrap();
    let s = schema.to_str().unwrap();

    let g = outboxd(&["keys", "generate", "--keys", k], "", &[]);
    assert_eq!(g.code, 0, "{}", g.stderr);
    assert!(g.stderr.contains("back this file up"), "{}", g.stderr);
    let again = outboxd(&["keys", "generate", "--keys", k], "", &[]);
    assert_eq!(again.code, 2, "never overwrites: {}", again.stderr);

    let e = outboxd(
        &["encrypt", "--keys", k, "--schema", s, "--event-id", EVENT],
        PAYLOAD,
        &[],
    );
    assert_eq!(e.code, 0, "{}", e.stderr);
    assert!(!e.stdout.contains("Ayşe") && !e.stdout.contains("1234567890"));
    let enc: serde_json::Value = serde_json::from_str(&e.stdout).unwrap();
    assert_eq!(enc["invoice_id"], 42);
    // Field order is kept.
    assert!(e
        .stdout
        .starts_with("{\"invoice_id\":42,\"customer_name\":\"enc:v1:"));

    let d = outboxd(
        &["decrypt", "--keys", k, "--event-id", EVENT],
        &e.stdout,
        &[],
    );
    assert_eq!(d.code, 0, "{}", d.stderr);
    assert_eq!(d.stdout.trim(), PAYLOAD);

    // The keyring from the environment instead of a file.
    let json = std::fs::read_to_string(&keys).unwrap();
    let d = outboxd(
        &["decrypt", "--event-id", EVENT],
        &e.stdout,
        &[("OUTBOXD_KEYRING", &json)],
    );
    assert_eq!(d.code, 0, "{}", d.stderr);
    assert_eq!(d.stdout.trim(), PAYLOAD);

    // Rotation: the old payload still decrypts, new ones use the new key.
    let r = outboxd(&["keys", "rotate", "--keys", k], "", &[]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let d = outboxd(
        &["decrypt", "--keys", k, "--event-id", EVENT],
        &e.stdout,
        &[],
    );
    assert_eq!(d.stdout.trim(), PAYLOAD, "{}", d.stderr);

    // Nothing printed anywhere carries key material.
    let l = outboxd(&["keys", "list", "--keys", k], "", &[]);
    assert_eq!(l.code, 0, "{}", l.stderr);
    assert_eq!(l.stdout.lines().count(), 4, "{}", l.stdout);
    let help = outboxd(&["encrypt", "--help"], "", &[("OUTBOXD_KEYRING", &json)]);
    let keys_help = outboxd(
        &["keys", "list", "--help"],
        "",
        &[("OUTBOXD_KEYRING", &json)],
    );
    for m in material_of(&keys) {
        for out in [&g, &e, &d, &r, &l, &help, &keys_help] {
            assert!(!out.stdout.contains(&m) && !out.stderr.contains(&m));
        }
    }
}

#[test]
fn failures_exit_non_zero_with_the_reason_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let schema = dir.path().join("schema.json");
    std::fs::write(&schema, SCHEMA).unwrap();
    let k = keys.to_str().unwrap();
    let s = schema.to_str().unwrap();
    assert_eq!(outboxd(&["keys", "generate", "--keys", k], "", &[]).code, 0);
    let e = outboxd(
        &["encrypt", "--keys", k, "--schema", s, "--event-id", EVENT],
        PAYLOAD,
        &[],
    );

    let other = "0192f3a4-5b6c-7d8e-9f00-000000000000";
    let d = outboxd(
        &["decrypt", "--keys", k, "--event-id", other],
        &e.stdout,
        &[],
    );
    assert_eq!(d.code, 1);
    assert!(d.stdout.is_empty());
    assert!(
        d.stderr.contains("encrypted for another event"),
        "{}",
        d.stderr
    );

    let d = outboxd(
        &["decrypt", "--keys", k, "--event-id", "not-a-uuid"],
        &e.stdout,
        &[],
    );
    assert_eq!(d.code, 2, "{}", d.stderr);

    let d = outboxd(&["decrypt", "--keys", k, "--event-id", EVENT], "{oops", &[]);
    assert_eq!(d.code, 1);
    assert!(d.stderr.contains("not JSON"), "{}", d.stderr);

    let d = outboxd(&["decrypt", "--event-id", EVENT], &e.stdout, &[]);
    assert_eq!(d.code, 2);
    assert!(d.stderr.contains("no keyring given"), "{}", d.stderr);

    // Another keyring: unknown key id, named.
    let keys2 = dir.path().join("other.json");
    assert_eq!(
        outboxd(
            &["keys", "generate", "--keys", keys2.to_str().unwrap()],
            "",
            &[]
        )
        .code,
        0
    );
    let d = outboxd(
        &[
            "decrypt",
            "--keys",
            keys2.to_str().unwrap(),
            "--event-id",
            EVENT,
        ],
        &e.stdout,
        &[],
    );
    assert_eq!(d.code, 1);
    assert!(
        d.stderr.contains("which this keyring does not hold"),
        "{}",
        d.stderr
    );

    // A 0644 keyring is refused with the exact fix.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o644)).unwrap();
        for args in [
            vec!["keys", "list", "--keys", k],
            vec!["decrypt", "--keys", k, "--event-id", EVENT],
            vec!["keys", "rotate", "--keys", k],
        ] {
            let d = outboxd(&args, &e.stdout, &[]);
            assert_eq!(d.code, 2, "{args:?}: {}", d.stderr);
            assert!(
                d.stderr.contains(&format!("fix: chmod 600 {k}")),
                "{}",
                d.stderr
            );
        }
    }
}

#[test]
fn blind_index_reads_stdin_and_normalises() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    let k = keys.to_str().unwrap();
    assert_eq!(
        outboxd(
            &["keys", "generate", "--keys", k, "--blind-index-length", "6"],
            "",
            &[]
        )
        .code,
        0
    );
    let bi = |field: &str, value: &str, extra: &[&str]| {
        let mut args = vec!["keys", "blind-index", "--keys", k, "--field", field];
        args.extend_from_slice(extra);
        let o = outboxd(&args, value, &[]);
        assert_eq!(o.code, 0, "{}", o.stderr);
        o.stdout
    };
    let a = bi(
        "email",
        "  Ayse@Example.COM\n",
        &["--normalize", "trim,lowercase"],
    );
    let b = bi(
        "email",
        "ayse@example.com",
        &["--normalize", "trim,lowercase"],
    );
    assert_eq!(a, b);
    let (id, hex) = a.trim().split_once(' ').unwrap();
    assert!(id.starts_with('b'));
    assert_eq!(hex.len(), 12, "6 bytes as configured");
    // Another field, another index; the default is trim only (case matters).
    assert_ne!(
        bi(
            "login",
            "ayse@example.com",
            &["--normalize", "trim,lowercase"]
        ),
        a
    );
    assert_ne!(bi("email", "Ayse@example.com", &[]), a);
    assert_eq!(
        bi(
            "/email",
            "ayse@example.com",
            &["--normalize", "trim,lowercase"]
        ),
        a
    );
    assert_eq!(
        bi("email", "ayse@example.com", &["--length", "16"])
            .trim()
            .len(),
        id.len() + 1 + 32
    );
    // The schema can declare the normalisation.
    let schema = dir.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"email": {"x-gdpr-sensitive": true, "x-blind-index": {"normalize": ["trim", "lowercase"]}}}"#,
    )
    .unwrap();
    assert_eq!(
        bi(
            "email",
            " AYSE@example.com ",
            &["--schema", schema.to_str().unwrap()]
        ),
        a
    );
    // Rotating the blind-index key: --all prints both, the new one first.
    assert_eq!(
        outboxd(&["keys", "rotate", "--keys", k, "--blind-index"], "", &[]).code,
        0
    );
    let all = bi(
        "email",
        "ayse@example.com",
        &["--normalize", "trim,lowercase", "--all"],
    );
    let lines: Vec<&str> = all.lines().collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1], a.trim());
    // Rotating encryption keys never changes a blind index.
    assert_eq!(outboxd(&["keys", "rotate", "--keys", k], "", &[]).code, 0);
    assert_eq!(
        bi(
            "email",
            "ayse@example.com",
            &["--normalize", "trim,lowercase", "--all"]
        ),
        all
    );
}

/// docs/encryption.md's known-answer vector, rebuilt by an independent implementation
/// (`scripts/crypto-vector.py`: pure-Python HKDF and HChaCha20, the `cryptography` package's
/// ChaCha20-Poly1305) from the written spec alone, must be exactly the one the page prints.
#[test]
fn the_independent_python_implementation_gives_the_documented_vector() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = std::process::Command::new("python3")
        .arg(format!("{root}/scripts/crypto-vector.py"))
        .output()
        .unwrap_or_else(|e| {
            panic!("python3 cannot run ({e}): install it with `apt-get install -y python3` (scripts/services.sh, as root, does)")
        });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'cryptography'"),
        "scripts/crypto-vector.py needs the `cryptography` package: run scripts/services.sh (as root), or `apt-get install -y python3-cryptography` (or `pip install cryptography`)"
    );
    assert!(
        out.status.success(),
        "scripts/crypto-vector.py failed: {stderr}"
    );
    let printed = String::from_utf8(out.stdout).unwrap();
    let doc = std::fs::read_to_string(format!("{root}/docs/encryption.md")).unwrap();
    let line = |text: &str, prefix: &str| -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in {text}"))
            .trim()
            .to_string()
    };
    let doc_value = line(&doc, "value      ");
    let doc_key = line(&doc, "field key  ");
    assert!(doc_value.starts_with("enc:v1:"), "{doc_value}");
    assert!(
        printed.contains(&doc_value),
        "python gives\n{printed}\nthe doc says {doc_value}"
    );
    assert!(
        printed.contains(&doc_key),
        "field key: {printed} vs {doc_key}"
    );
}
