//! Cross-language vectors for the `enc:v1` format: the Laravel example's PHP class
//! (`examples/laravel/app/FieldCrypto.php`, PHP's sodium) against `outboxd decrypt` and the Rust
//! kit, both ways, on one key ring file written by `outboxd keys generate`. A value tampered
//! with, moved to another field or copied to another event fails on both sides; the blind
//! indexes agree; PHP reproduces the known-answer vector of docs/encryption.md.

use super::crypto_cli::{outboxd, run, Out};
use outboxd::crypto::{decrypt_payload, encrypt_payload, CryptoError, Keyring, Schema};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use uuid::Uuid;

const SCHEMA: &str = r#"{"invoice_id": {"x-gdpr-sensitive": false},
  "customer_name": {"x-gdpr-sensitive": true},
  "tax_id": {"x-gdpr-sensitive": true, "x-blind-index": {"normalize": ["digits"]}},
  "address": {"properties": {"street": {"x-gdpr-sensitive": true}, "country": {}}},
  "total_cents": {"x-gdpr-sensitive": false}}"#;
const EVENT: &str = "0192f3a4-5b6c-7d8e-9f00-112233445566";
const OTHER_EVENT: &str = "0192f3a4-5b6c-7d8e-9f00-112233445567";

fn payload() -> Value {
    json!({"invoice_id": 42, "customer_name": "Ayşe Yılmaz", "tax_id": "DE 123-456/7",
           "address": {"street": {"line": "Große Straße 1", "no": [1, 2.5, null, true]}, "country": "DE"},
           "total_cents": 1499})
}

pub fn artisan() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/laravel/artisan")
}

/// `php <args>` with `stdin`; fails with the install command when PHP or the Debian packages
/// the example needs are missing.
pub fn php(args: &[&str], stdin: &str, env: &[(&str, &str)]) -> Out {
    let out = run(
        Command::new("php"),
        args,
        stdin,
        env,
        "cannot run php: install it with `sudo scripts/services/php.sh` (apt-get install -y php8.2-cli php8.2-mysql php-amqplib php-illuminate-database php-illuminate-events)",
    );
    // bootstrap.php names the script when a Debian package is missing.
    assert!(
        !out.stderr.contains("scripts/services/php.sh"),
        "{}",
        out.stderr
    );
    out
}

struct Ring {
    _dir: tempfile::TempDir,
    keys: String,
    schema: String,
}

impl Ring {
    fn new() -> Ring {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys.json").to_str().unwrap().to_string();
        let schema = dir.path().join("schema.json").to_str().unwrap().to_string();
        std::fs::write(&schema, SCHEMA).unwrap();
        let g = outboxd(&["keys", "generate", "--keys", &keys], "", &[]);
        assert_eq!(g.code, 0, "{}", g.stderr);
        Ring {
            _dir: dir,
            keys,
            schema,
        }
    }

    fn env(&self) -> [(&str, &str); 2] {
        [("OUTBOX_KEYS", &self.keys), ("OUTBOX_SCHEMA", &self.schema)]
    }

    fn php_crypto(&self, sub: &str, event: &str, stdin: &str) -> Out {
        let a = artisan();
        php(
            &[a.to_str().unwrap(), "crypto", sub, "--event-id", event],
            stdin,
            &self.env(),
        )
    }

    fn php_seal(&self) -> Value {
        let out = self.php_crypto("seal", EVENT, &payload().to_string());
        assert_eq!(out.code, 0, "{}", out.stderr);
        serde_json::from_str(&out.stdout).unwrap()
    }

    fn rust_seal(&self) -> Value {
        let keyring = Keyring::load(Path::new(&self.keys)).unwrap();
        let schema = Schema::load(Path::new(&self.schema)).unwrap();
        encrypt_payload(&keyring, &schema, EVENT.parse().unwrap(), &payload()).unwrap()
    }

    fn rust_open(&self, event: &str, v: &Value) -> Result<Value, CryptoError> {
        let keyring = Keyring::load(Path::new(&self.keys)).unwrap();
        decrypt_payload(&keyring, event.parse::<Uuid>().unwrap(), v)
    }

    fn cli_open(&self, event: &str, v: &Value) -> Out {
        outboxd(
            &["decrypt", "--keys", &self.keys, "--event-id", event],
            &v.to_string(),
            &[],
        )
    }
}

/// The three sealed fields are ciphertext; no clear personal value is left in the text.
fn assert_sealed(v: &Value) {
    for p in ["/customer_name", "/tax_id", "/address/street"] {
        let s = v.pointer(p).and_then(Value::as_str).unwrap_or_default();
        assert!(s.starts_with("enc:v1:k"), "{p} not sealed: {v}");
    }
    let text = v.to_string();
    for clear in ["Ayşe", "123-456", "Große"] {
        assert!(!text.contains(clear), "{clear} in clear: {text}");
    }
    assert_eq!(v["address"]["country"], "DE");
    assert_eq!(v["invoice_id"], 42);
}

#[test]
fn php_reproduces_the_documented_known_answer_vector() {
    let a = artisan();
    let out = php(&[a.to_str().unwrap(), "crypto", "vector"], "", &[]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let doc = include_str!("../../docs/encryption.md");
    let documented = |label: &str| -> String {
        doc.lines()
            .find_map(|l| l.strip_prefix(label).map(|r| r.trim().to_string()))
            .unwrap_or_else(|| panic!("docs/encryption.md has no `{label}` line"))
    };
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines, [documented("field key"), documented("value")]);
}

#[test]
fn php_seals_and_outboxd_decrypt_and_the_rust_kit_open() {
    let ring = Ring::new();
    let sealed = ring.php_seal();
    assert_sealed(&sealed);
    let cli = ring.cli_open(EVENT, &sealed);
    assert_eq!(cli.code, 0, "{}", cli.stderr);
    assert_eq!(
        serde_json::from_str::<Value>(&cli.stdout).unwrap(),
        payload()
    );
    assert_eq!(ring.rust_open(EVENT, &sealed).unwrap(), payload());
}

#[test]
fn rust_seals_and_php_opens() {
    let ring = Ring::new();
    let sealed = ring.rust_seal();
    assert_sealed(&sealed);
    let out = ring.php_crypto("open", EVENT, &sealed.to_string());
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(
        serde_json::from_str::<Value>(&out.stdout).unwrap(),
        payload()
    );
}

/// What was done to a value, the value, the event id it is opened for, the PHP error kind and
/// the Rust error it must give.
type Case<'a> = (
    &'a str,
    &'a Value,
    &'a str,
    &'a str,
    fn(&CryptoError) -> bool,
);

#[test]
fn tampered_moved_or_copied_values_fail_on_both_sides() {
    let ring = Ring::new();
    for (sealer, sealed) in [("php", ring.php_seal()), ("rust", ring.rust_seal())] {
        // One base64 character of the tax id's tag changed (a middle one: every bit of it counts).
        let mut tampered = sealed.clone();
        let s = tampered["tax_id"].as_str().unwrap().to_string();
        let at = s.len() - 8;
        let flipped = if &s[at..=at] == "A" { "B" } else { "A" };
        tampered["tax_id"] = json!(format!("{}{flipped}{}", &s[..at], &s[at + 1..]));
        // The two sealed strings swapped between fields.
        let mut moved = sealed.clone();
        moved["tax_id"] = sealed["customer_name"].clone();
        moved["customer_name"] = sealed["tax_id"].clone();
        let cases: [Case; 3] = [
            ("tampered", &tampered, EVENT, "Tampered", |e| {
                matches!(e, CryptoError::Tampered { .. })
            }),
            ("moved", &moved, EVENT, "MovedField", |e| {
                matches!(e, CryptoError::MovedField { .. })
            }),
            (
                "copied to another event",
                &sealed,
                OTHER_EVENT,
                "WrongEvent",
                |e| matches!(e, CryptoError::WrongEvent { .. }),
            ),
        ];
        for (what, v, event, kind, is_kind) in cases {
            let rust = ring.rust_open(event, v).expect_err(what);
            assert!(
                is_kind(&rust),
                "{sealer} sealed, {what}: Rust kit gave {rust:?}"
            );
            let cli = ring.cli_open(event, v);
            assert_eq!(
                cli.code, 1,
                "{sealer} sealed, {what}: outboxd decrypt: {}",
                cli.stderr
            );
            assert!(
                cli.stderr.contains(&rust.to_string()),
                "{sealer} sealed, {what}: outboxd decrypt said {}, the kit {rust}",
                cli.stderr
            );
            let p = ring.php_crypto("open", event, &v.to_string());
            assert_eq!(
                p.code, 1,
                "{sealer} sealed, {what}: PHP opened it: {}",
                p.stdout
            );
            assert!(
                p.stderr.contains(&format!("{kind}: ")),
                "{sealer} sealed, {what}: PHP said {}",
                p.stderr
            );
            assert!(!p.stdout.contains("Ayşe") && !p.stdout.contains("123-456"));
        }
    }
}

#[test]
fn php_and_outboxd_compute_the_same_blind_index() {
    let ring = Ring::new();
    let a = artisan();
    for (value, normalize) in [
        ("DE 123-456/7\n", None),
        ("  Ayşe@Example.COM ", Some("trim,lowercase")),
        ("gb82 west 1234", Some("alnum")),
    ] {
        let mut cli_args = vec![
            "keys",
            "blind-index",
            "--keys",
            &ring.keys,
            "--schema",
            &ring.schema,
            "--field",
            "tax_id",
        ];
        let mut php_args = vec![
            a.to_str().unwrap(),
            "crypto",
            "blind-index",
            "--field",
            "tax_id",
        ];
        if let Some(n) = normalize {
            cli_args.extend(["--normalize", n]);
            php_args.extend(["--normalize", n]);
        }
        let cli = outboxd(&cli_args, value, &[]);
        assert_eq!(cli.code, 0, "{}", cli.stderr);
        let p = php(&php_args, value, &ring.env());
        assert_eq!(p.code, 0, "{}", p.stderr);
        assert_eq!(
            p.stdout, cli.stdout,
            "value {value:?}, normalize {normalize:?}"
        );
        assert_eq!(
            cli.stdout.split(' ').nth(1).map(str::trim).map(str::len),
            Some(16)
        );
    }
}

#[test]
fn php_refuses_a_keyring_others_can_read_with_the_fix() {
    use std::os::unix::fs::PermissionsExt;
    let ring = Ring::new();
    std::fs::set_permissions(&ring.keys, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = ring.php_crypto("seal", EVENT, &payload().to_string());
    assert_ne!(out.code, 0);
    assert!(
        out.stderr
            .contains(&format!("fix: chmod 600 {}", ring.keys)),
        "{}",
        out.stderr
    );
}
