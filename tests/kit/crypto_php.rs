//! Cross-language vectors for the `enc:v1` format: the Laravel package's PHP class
//! (`php/laravel/src/Encryption/FieldCrypto.php`, PHP's sodium, driven through the example
//! application's `outbox:encrypt`, `outbox:decrypt` and `outbox:keys blind-index`) against
//! `outboxd decrypt` and the Rust kit, both ways, on one key ring file written by `outboxd keys
//! generate`. A value tampered with, moved to another field or copied to another event fails on
//! both sides; the blind indexes agree. The vectors of `tests/fixtures/enc-v1` (which the
//! package's PHPUnit tests open in PHP, with docs/encryption.md's known answer) still open here.

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
    let app = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/laravel");
    assert!(
        app.join("vendor/autoload.php").is_file(),
        "examples/laravel has no vendor/: run `scripts/php-install.sh` (composer install, offline)"
    );
    app.join("artisan")
}

/// `php <args>` with `stdin`; fails with the install command when PHP or the Debian packages
/// the example needs are missing.
pub fn php(args: &[&str], stdin: &str, env: &[(&str, &str)]) -> Out {
    let out = run(
        Command::new("php"),
        args,
        stdin,
        env,
        "cannot run php: install it with `scripts/services/php.sh` (apt-get install -y php8.2-cli php8.2-mysql php-amqplib php-laravel-framework phpunit composer), then `scripts/php-install.sh`",
    );
    assert!(!out.stderr.contains("PHP Fatal error"), "{}", out.stderr);
    out
}

struct Ring {
    dir: tempfile::TempDir,
    keys: String,
    schema: String,
}

/// The topic the schema is written for: `<schemas>/invoice.issued.json`.
const TOPIC: &str = "invoice.issued";

impl Ring {
    fn new() -> Ring {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys.json").to_str().unwrap().to_string();
        let schema = dir
            .path()
            .join(format!("{TOPIC}.json"))
            .to_str()
            .unwrap()
            .to_string();
        std::fs::write(&schema, SCHEMA).unwrap();
        let g = outboxd(&["keys", "generate", "--keys", &keys], "", &[]);
        assert_eq!(g.code, 0, "{}", g.stderr);
        Ring { dir, keys, schema }
    }

    /// The example application's configuration: this key ring, this directory of schemas.
    fn env(&self) -> [(&str, &str); 2] {
        [
            ("OUTBOX_KEYRING", &self.keys),
            ("OUTBOX_SCHEMAS", self.dir.path().to_str().unwrap()),
        ]
    }

    /// `php artisan outbox:encrypt invoice.issued` (seal) or `outbox:decrypt` (open).
    fn php_crypto(&self, sub: &str, event: &str, stdin: &str) -> Out {
        let a = artisan();
        let event = format!("--event-id={event}");
        let mut args = vec![a.to_str().unwrap()];
        match sub {
            "seal" => args.extend(["outbox:encrypt", TOPIC, &event]),
            _ => args.extend(["outbox:decrypt", &event]),
        }
        php(&args, stdin, &self.env())
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

/// `tests/fixtures/enc-v1` (which the PHPUnit tests open in PHP) still holds for the Rust kit:
/// its sealed payload opens to its clear one, its blind indexes are outboxd's, and the payload
/// sealed anew opens to the same.
#[test]
fn the_shared_vectors_hold_for_the_rust_kit() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/enc-v1");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    let v: Value = serde_json::from_str(&read("vectors.json")).unwrap();
    let keyring = Keyring::from_json(&read("keyring.json")).unwrap();
    let event: Uuid = v["event_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        decrypt_payload(&keyring, event, &v["sealed"]).unwrap(),
        v["payload"]
    );
    let schema = Schema::load(&dir.join("schema.json")).unwrap();
    let resealed = encrypt_payload(&keyring, &schema, event, &v["payload"]).unwrap();
    assert_ne!(resealed, v["sealed"], "a fresh nonce per value");
    assert_eq!(
        decrypt_payload(&keyring, event, &resealed).unwrap(),
        v["payload"]
    );

    // outboxd keys blind-index wants a key ring file only its owner reads.
    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("keys.json");
    std::fs::write(&keys, read("keyring.json")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&keys, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cases = v["blind_indexes"].as_array().unwrap();
    assert_eq!(cases.len(), 3);
    for case in cases {
        let field = case["field"].as_str().unwrap();
        let schema_file = dir.join("schema.json");
        let mut args = vec!["keys", "blind-index", "--keys", keys.to_str().unwrap()];
        args.extend(["--field", field]);
        let steps = case["normalize"].as_array().map(|s| {
            s.iter()
                .map(|x| x.as_str().unwrap())
                .collect::<Vec<_>>()
                .join(",")
        });
        match &steps {
            Some(steps) => args.extend(["--normalize", steps]),
            // tax_id's steps come from the schema, as when the vectors were written.
            None => args.extend(["--schema", schema_file.to_str().unwrap()]),
        }
        let out = outboxd(&args, case["value"].as_str().unwrap(), &[]);
        assert_eq!(out.code, 0, "{}", out.stderr);
        assert_eq!(
            out.stdout.trim(),
            case["index"].as_str().unwrap(),
            "{field}"
        );
    }
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
        let topic = format!("--topic={TOPIC}");
        let mut php_args = vec![
            a.to_str().unwrap(),
            "outbox:keys",
            "blind-index",
            "--field=tax_id",
            &topic,
        ];
        let php_normalize = normalize.map(|n| format!("--normalize={n}"));
        if let Some(n) = normalize {
            cli_args.extend(["--normalize", n]);
        }
        if let Some(n) = &php_normalize {
            php_args.push(n);
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
