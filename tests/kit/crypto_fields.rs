//! Field-level encryption without a database: property tests of round trips over arbitrary JSON,
//! every way a value can fail (each its own error), rotation, and the keyring file's rules.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use outboxd::crypto::{
    decrypt_payload, decrypt_value, encrypt_payload, encrypt_value, CryptoError, Keyring, Schema,
};
use proptest::prelude::*;
use serde_json::{json, Value};
use uuid::Uuid;

fn arb_string() -> impl Strategy<Value = String> {
    // Any Unicode, but never a clear string of the ciphertext shape (refused by design).
    any::<String>().prop_filter("ciphertext-shaped", |s| {
        !outboxd::crypto::looks_encrypted(s)
    })
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        arb_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(arb_string(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A payload object and a schema marking a random subset of its top-level keys and of the
/// members of its nested objects and array elements.
fn arb_payload_and_schema() -> impl Strategy<Value = (Value, Schema)> {
    (
        prop::collection::btree_map("[a-z_/~]{1,8}", arb_json(), 1..8),
        any::<u64>(),
    )
        .prop_map(|(m, seed)| {
            let payload = Value::Object(m.into_iter().collect());
            let mut pointers = Vec::new();
            let mut bit = 0u32;
            let mut pick = || {
                bit += 1;
                seed.rotate_right(bit) & 1 == 1
            };
            let esc = |s: &str| s.replace('~', "~0").replace('/', "~1");
            for (k, v) in payload.as_object().unwrap() {
                if pick() {
                    pointers.push(format!("/{}", esc(k)));
                    continue;
                }
                match v {
                    Value::Object(inner) => {
                        for ik in inner.keys() {
                            if pick() {
                                pointers.push(format!("/{}/{}", esc(k), esc(ik)));
                            }
                        }
                    }
                    Value::Array(_) if pick() => pointers.push(format!("/{}/*", esc(k))),
                    _ => {}
                }
            }
            (payload, Schema::from_pointers(&pointers))
        })
}

fn keyring() -> Keyring {
    Keyring::generate(8).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_value_round_trips_with_its_type(v in arb_json(), ptr in "(/[a-z0-9~]{0,6}){1,3}") {
        let k = keyring();
        let ev = Uuid::now_v7();
        let s = encrypt_value(&k, ev, &ptr, &v).unwrap();
        let prefix = format!("enc:v1:{}:", k.current_id());
        prop_assert!(s.starts_with(&prefix));
        prop_assert_eq!(decrypt_value(&k, ev, &ptr, &s).unwrap(), v);
    }

    #[test]
    fn payloads_round_trip_and_marked_fields_are_sealed((p, schema) in arb_payload_and_schema()) {
        let k = keyring();
        let ev = Uuid::now_v7();
        let e = encrypt_payload(&k, &schema, ev, &p).unwrap();
        for ptr in schema.sensitive_pointers() {
            // Every present marked value is now a ciphertext string.
            if let Some((parent, last)) = ptr.rsplit_once('/') {
                if last == "*" {
                    if let Some(Value::Array(items)) = e.pointer(parent) {
                        for it in items {
                            prop_assert!(it.as_str().is_some_and(outboxd::crypto::looks_encrypted));
                        }
                    }
                } else if let Some(v) = e.pointer(&ptr) {
                    prop_assert!(v.as_str().is_some_and(outboxd::crypto::looks_encrypted), "{ptr}: {v}");
                }
            }
        }
        prop_assert_eq!(decrypt_payload(&k, ev, &e).unwrap(), p);
    }

    #[test]
    fn any_single_byte_change_is_an_error_never_a_value(v in arb_json(), pos in any::<prop::sample::Index>(), flip in 1u8..=255) {
        let k = keyring();
        let ev = Uuid::now_v7();
        let s = encrypt_value(&k, ev, "/f", &v).unwrap();
        let (head, b64) = s.rsplit_once(':').unwrap();
        let mut bytes = URL_SAFE_NO_PAD.decode(b64).unwrap();
        let i = pos.index(bytes.len());
        bytes[i] ^= flip;
        let bad = format!("{head}:{}", URL_SAFE_NO_PAD.encode(&bytes));
        prop_assert!(decrypt_value(&k, ev, "/f", &bad).is_err());
    }

    #[test]
    fn any_cut_is_truncated_or_malformed(v in arb_json(), cut in 1usize..40) {
        let k = keyring();
        let ev = Uuid::now_v7();
        let s = encrypt_value(&k, ev, "/f", &v).unwrap();
        let prefix_len = "enc:v1:".len() + k.current_id().len() + 1;
        let keep = s.len().saturating_sub(cut).max(prefix_len);
        let e = decrypt_value(&k, ev, "/f", &s[..keep]).unwrap_err();
        prop_assert!(matches!(e, CryptoError::Truncated { .. } | CryptoError::Malformed { .. }), "{e}");
    }
}

fn sealed(k: &Keyring, ev: Uuid) -> Value {
    let schema = Schema::from_value(&json!({
        "invoice_id": {"x-gdpr-sensitive": false},
        "customer_name": {"x-gdpr-sensitive": true},
        "tax_id": {"x-gdpr-sensitive": true},
        "total": {"x-gdpr-sensitive": false},
    }))
    .unwrap();
    encrypt_payload(
        k,
        &schema,
        ev,
        &json!({"invoice_id": 42, "customer_name": "Ayşe Yılmaz", "tax_id": "1234567890", "total": "12.50"}),
    )
    .unwrap()
}

#[test]
fn tampered_value_is_tampered() {
    let k = keyring();
    let ev = Uuid::now_v7();
    let mut p = sealed(&k, ev);
    let s = p["tax_id"].as_str().unwrap().to_string();
    let (head, b64) = s.rsplit_once(':').unwrap();
    let mut bytes = URL_SAFE_NO_PAD.decode(b64).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1; // the tag
    p["tax_id"] = json!(format!("{head}:{}", URL_SAFE_NO_PAD.encode(&bytes)));
    let e = decrypt_payload(&k, ev, &p).unwrap_err();
    assert!(
        matches!(e, CryptoError::Tampered { ref pointer, .. } if pointer == "/tax_id"),
        "{e}"
    );
    // The ciphertext body too.
    let mut p = sealed(&k, ev);
    let s = p["customer_name"].as_str().unwrap().to_string();
    let (head, b64) = s.rsplit_once(':').unwrap();
    let mut bytes = URL_SAFE_NO_PAD.decode(b64).unwrap();
    bytes[30] ^= 0x40;
    p["customer_name"] = json!(format!("{head}:{}", URL_SAFE_NO_PAD.encode(&bytes)));
    assert!(matches!(
        decrypt_payload(&k, ev, &p),
        Err(CryptoError::Tampered { .. })
    ));
}

#[test]
fn swapped_fields_are_moved_fields() {
    let k = keyring();
    let ev = Uuid::now_v7();
    let mut p = sealed(&k, ev);
    let a = p["tax_id"].clone();
    p["tax_id"] = p["customer_name"].clone();
    p["customer_name"] = a;
    let e = decrypt_payload(&k, ev, &p).unwrap_err();
    assert!(matches!(e, CryptoError::MovedField { .. }), "{e}");
    assert!(e.to_string().contains("another field"), "{e}");
}

#[test]
fn values_swapped_between_events_are_wrong_event() {
    let k = keyring();
    let (ev1, ev2) = (Uuid::now_v7(), Uuid::now_v7());
    let p1 = sealed(&k, ev1);
    let mut p2 = sealed(&k, ev2);
    p2["tax_id"] = p1["tax_id"].clone();
    let e = decrypt_payload(&k, ev2, &p2).unwrap_err();
    assert!(matches!(e, CryptoError::WrongEvent { .. }), "{e}");
    // And the whole payload read as another event's.
    assert!(matches!(
        decrypt_payload(&k, ev2, &p1),
        Err(CryptoError::WrongEvent { .. })
    ));
}

#[test]
fn truncated_value_is_truncated() {
    let k = keyring();
    let ev = Uuid::now_v7();
    let mut p = sealed(&k, ev);
    let s = p["tax_id"].as_str().unwrap().to_string();
    let (head, b64) = s.rsplit_once(':').unwrap();
    let bytes = URL_SAFE_NO_PAD.decode(b64).unwrap();
    p["tax_id"] = json!(format!(
        "{head}:{}",
        URL_SAFE_NO_PAD.encode(&bytes[..bytes.len() - 5])
    ));
    let e = decrypt_payload(&k, ev, &p).unwrap_err();
    assert!(
        matches!(e, CryptoError::Truncated { expected, got, .. } if expected == got + 5),
        "{e}"
    );
}

#[test]
fn unknown_key_id_missing_key_malformed_and_versions() {
    let k = keyring();
    let other = keyring();
    let ev = Uuid::now_v7();
    let p = sealed(&other, ev);
    let e = decrypt_payload(&k, ev, &p).unwrap_err();
    assert!(matches!(e, CryptoError::UnknownKeyId { .. }), "{e}");
    assert!(e.to_string().contains(other.current_id()), "{e}");

    // A retired key: known id, material gone.
    let mut k2 = keyring();
    let p = sealed(&k2, ev);
    let old = k2.current_id().to_string();
    k2.rotate();
    k2.retire(&old).unwrap();
    let e = decrypt_payload(&k2, ev, &p).unwrap_err();
    assert!(matches!(e, CryptoError::KeyMissing { .. }), "{e}");

    let bad = |s: &str| decrypt_payload(&k, ev, &json!({ "x": s })).unwrap_err();
    assert!(matches!(
        bad("enc:v2:k1:AAAA"),
        CryptoError::UnsupportedVersion { .. }
    ));
    assert!(matches!(bad("enc:v1:k1"), CryptoError::Malformed { .. }));
    assert!(matches!(
        bad("enc:v1:k1:not base64!"),
        CryptoError::Malformed { .. }
    ));
    assert!(matches!(
        bad("enc:v1:k:y:AAAA"),
        CryptoError::Malformed { .. }
    ));
    // Each message names the field, never a value.
    assert!(bad("enc:v1:k1").to_string().starts_with("/x:"));
}

#[test]
fn rotation_keeps_old_payloads_readable() {
    let mut k = keyring();
    let ev_old = Uuid::now_v7();
    let old = sealed(&k, ev_old);
    let old_id = k.current_id().to_string();
    let new_id = k.rotate();
    let ev_new = Uuid::now_v7();
    let new = sealed(&k, ev_new);
    assert!(new["tax_id"].as_str().unwrap().contains(&new_id));
    assert!(old["tax_id"].as_str().unwrap().contains(&old_id));
    // Through the file format too, as a consumer would load it.
    let k = Keyring::from_json(&k.to_json()).unwrap();
    assert_eq!(
        decrypt_payload(&k, ev_old, &old).unwrap()["tax_id"],
        "1234567890"
    );
    assert_eq!(
        decrypt_payload(&k, ev_new, &new).unwrap()["tax_id"],
        "1234567890"
    );
}

#[test]
fn ciphertext_is_randomised_and_leaks_no_plaintext() {
    let k = keyring();
    let ev = Uuid::now_v7();
    let a = sealed(&k, ev);
    let b = sealed(&k, ev);
    assert_ne!(a["tax_id"], b["tax_id"], "a fresh nonce every time");
    let text = a.to_string();
    assert!(!text.contains("1234567890") && !text.contains("Ayşe"));
    assert_eq!(a["invoice_id"], 42);
    assert_eq!(a["total"], "12.50");
}

#[cfg(unix)]
#[test]
fn a_group_or_world_readable_keyring_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.json");
    keyring().save_new(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "created private");
    assert!(Keyring::load(&path).is_ok());
    for bad in [0o644, 0o640, 0o604, 0o660] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(bad)).unwrap();
        let e = Keyring::load(&path).unwrap_err();
        assert!(matches!(e, CryptoError::KeyringPermissions { .. }), "{e}");
        assert!(
            e.to_string()
                .contains(&format!("fix: chmod 600 {}", path.display())),
            "{e}"
        );
        assert!(e.is_config());
    }
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    // Never overwritten.
    assert!(matches!(
        keyring().save_new(&path),
        Err(CryptoError::KeyringIo { .. })
    ));
    // Replaced atomically, still 0600.
    let mut k = Keyring::load(&path).unwrap();
    k.rotate();
    k.save_replace(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(Keyring::load(&path).unwrap().current_id(), k.current_id());
}
