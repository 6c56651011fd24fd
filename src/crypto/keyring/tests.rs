//! The key ring's unit tests: generate, rotate and retire through the JSON file format, a
//! changed key failing its canary, parse errors that never quote a value, key ids.

use super::*;

#[test]
fn generate_rotate_retire_round_trip_through_json() {
    let mut k = Keyring::generate(8).unwrap();
    let first = k.current_id().to_string();
    let second = k.rotate();
    assert_ne!(first, second);
    assert_eq!(k.current_id(), second);
    let back = Keyring::from_json(&k.to_json()).unwrap();
    assert_eq!(back.list(), k.list());
    assert!(
        k.retire(&second).is_err(),
        "the current key cannot be retired"
    );
    k.retire(&first).unwrap();
    let back = Keyring::from_json(&k.to_json()).unwrap();
    assert!(matches!(
        back.material(&first, "/x"),
        Err(CryptoError::KeyMissing { .. })
    ));
    assert!(matches!(
        back.material("k00000000", "/x"),
        Err(CryptoError::UnknownKeyId { .. })
    ));
    assert!(!format!("{back:?}").contains(&*encode_key(&random_key())));
}

#[test]
fn a_changed_key_fails_its_canary() {
    let k = Keyring::generate(8).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&k.to_json()).unwrap();
    v["keys"][0]["key"] = serde_json::Value::String(URL_SAFE_NO_PAD.encode([1u8; 32]));
    assert!(matches!(
        Keyring::from_json(&v.to_string()),
        Err(CryptoError::Canary { .. })
    ));
    let mut v: serde_json::Value = serde_json::from_str(&k.to_json()).unwrap();
    v["blind_index"]["keys"][0]["key"] =
        serde_json::Value::String(URL_SAFE_NO_PAD.encode([1u8; 32]));
    assert!(matches!(
        Keyring::from_json(&v.to_string()),
        Err(CryptoError::Canary { .. })
    ));
}

#[test]
fn parse_errors_never_quote_values() {
    let secret = "c2VjcmV0LWtleS1tYXRlcmlhbC10aGF0LW11c3Qtbm90LWxlYWs";
    for text in [
        format!(r#"{{"outboxd_keyring": "{secret}"}}"#),
        format!(r#"{{"outboxd_keyring": 1, "current": ["{secret}"]}}"#),
        format!(
            r#"{{"outboxd_keyring": 1, "current": "k1", "keys": [{{"id": "k1", "created_at": "x", "key": 5, "canary": "{secret}"}}]}}"#
        ),
    ] {
        let e = Keyring::from_json(&text).unwrap_err().to_string();
        assert!(!e.contains(secret), "{e}");
        assert!(e.contains("line 1"), "{e}");
    }
    let e = Keyring::from_json(r#"{"outboxd_keyring": 1, "curent": "k1"}"#).unwrap_err();
    assert!(e.to_string().contains("unknown field `curent`"), "{e}");
}

#[test]
fn key_ids() {
    assert!(validate_key_id("k1f3a9c0d").is_ok());
    assert!(validate_key_id("a_b-C9").is_ok());
    assert!(validate_key_id("").is_err());
    assert!(validate_key_id("a:b").is_err());
    assert!(validate_key_id(&"a".repeat(33)).is_err());
    // `d-` is reserved for per-aggregate data keys.
    let k = Keyring::generate(8).unwrap();
    let text = k.to_json().replace(k.current_id(), "d-0011223344556677");
    let e = Keyring::from_json(&text).unwrap_err();
    assert!(e.to_string().contains("per-aggregate data keys"), "{e}");
}

#[test]
fn a_second_writer_waits_for_the_lock_and_a_changed_file_is_not_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.json");
    Keyring::generate(8).unwrap().save_new(&path).unwrap();

    let mut first = KeyringFile::lock(&path, |_| panic!("nobody holds the lock yet")).unwrap();
    let mut k = first.read().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.clone();
    let second = std::thread::spawn(move || {
        let mut f = KeyringFile::lock(&p, |lock| tx.send(lock.to_path_buf()).unwrap()).unwrap();
        let k = f.read().unwrap();
        (f, k)
    });
    // The second writer reports that it waits, and does not get the lock while we hold it.
    let lock = rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
    assert_eq!(lock, path.with_file_name("keys.json.lock"));
    assert!(!second.is_finished());
    let added = k.rotate();
    first.replace(&k).unwrap();
    drop(first);
    let (mut f2, k2) = second.join().unwrap();
    assert_eq!(
        k2.current_id(),
        added,
        "the second writer read the first's write"
    );

    // A change made without the lock between read and write: refused, file left as it is.
    let mut other = k2.clone();
    let theirs = other.rotate();
    std::fs::write(&path, other.to_json().as_bytes()).unwrap();
    let err = f2.replace(&k2).unwrap_err();
    assert!(matches!(err, CryptoError::KeyringChanged { .. }), "{err}");
    assert!(err.to_string().contains("run the command again"), "{err}");
    assert_eq!(Keyring::load(&path).unwrap().current_id(), theirs);
    // Read again, the write goes through.
    let k3 = f2.read().unwrap();
    f2.replace(&k3).unwrap();
}
