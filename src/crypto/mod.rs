//! Field-level encryption of personal data (docs/encryption.md). Producers encrypt the fields a schema
//! marks `x-gdpr-sensitive` before the outbox INSERT, so their plaintext never reaches the table,
//! the WAL/binlog or the broker; consumers decrypt with the same keyring. The relay never sees a
//! key: it moves the payload as it is.
//!
//! Each encrypted field is one string `enc:v1:<key id>:<base64>` ([`envelope`]), sealed with
//! XChaCha20-Poly1305 under a key derived for that field and bound to the event id and the
//! field's JSON Pointer, so a value copied to another event or moved to another field does not
//! decrypt. Decryption reads the key id from the value and never tries keys in turn.

pub mod blind;
pub mod envelope;
pub mod error;
pub mod keyring;
#[cfg(feature = "postgres")]
pub mod reencrypt;
pub mod schema;
pub mod shred;

pub use blind::{BlindIndex, Normalize};
pub use error::CryptoError;
pub use keyring::{KeyInfo, Keyring};
pub use schema::Schema;

use schema::Node;
use serde_json::Value;
use std::sync::Arc;
use uuid::Uuid;
use zeroize::Zeroizing;

/// Whether a string is taken for ciphertext: `enc:v<digits>:`. Readers decrypt exactly these;
/// a clear value of this shape is refused at encryption time so no reader ever misreads one.
pub fn looks_encrypted(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("enc:v") else {
        return false;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && rest.as_bytes().get(digits) == Some(&b':')
}

fn push_segment(pointer: &mut String, seg: &str) {
    pointer.push('/');
    if seg.contains(['~', '/']) {
        pointer.push_str(&seg.replace('~', "~0").replace('/', "~1"));
    } else {
        pointer.push_str(seg);
    }
}

/// Encrypts a value under the keyring's current key for (`event_id`, `pointer`): the JSON
/// serialisation is sealed, so numbers, booleans, null, objects and arrays come back with their
/// type.
pub fn encrypt_value(
    keyring: &Keyring,
    event_id: Uuid,
    pointer: &str,
    value: &Value,
) -> Result<String, CryptoError> {
    refuse_nil(event_id, pointer)?;
    Ok(SealingKey::current(keyring).seal(event_id, pointer, value))
}

/// The nil event id is the keyring's (canaries, wrapped keys): never a payload's.
fn refuse_nil(event_id: Uuid, pointer: &str) -> Result<(), CryptoError> {
    if event_id.is_nil() {
        return Err(CryptoError::NilEventId {
            pointer: if pointer.is_empty() { "/" } else { pointer }.to_string(),
        });
    }
    Ok(())
}

/// Decrypts one `enc:v1:` string found at `pointer` of event `event_id`.
pub fn decrypt_value(
    keyring: &Keyring,
    event_id: Uuid,
    pointer: &str,
    s: &str,
) -> Result<Value, CryptoError> {
    let parsed = envelope::parse(s, pointer)?;
    let Resolved::Key(material) = keyring.resolve(parsed.key_id, pointer)? else {
        unreachable!("a keyring never erases")
    };
    let plain = envelope::open(material, &parsed, event_id, pointer)?;
    serde_json::from_slice(&plain).map_err(|_| {
        // Authenticated but not JSON: only a writer bug can do this.
        CryptoError::malformed(pointer, "the decrypted value is not JSON")
    })
}

/// The key new values are sealed with: the keyring's current key, or an aggregate's data key.
#[derive(Clone, Copy)]
pub struct SealingKey<'a> {
    pub id: &'a str,
    pub material: &'a [u8; 32],
}

impl<'a> SealingKey<'a> {
    pub fn current(keyring: &'a Keyring) -> Self {
        let (id, material) = keyring.current();
        SealingKey { id, material }
    }

    fn seal(&self, event_id: Uuid, pointer: &str, value: &Value) -> String {
        let plain = Zeroizing::new(serde_json::to_vec(value).expect("a JSON value serialises"));
        envelope::seal(self.material, self.id, event_id, pointer, &plain)
    }
}

fn encrypt_walk(
    key: SealingKey<'_>,
    event_id: Uuid,
    node: Option<&Node>,
    value: &mut Value,
    pointer: &mut String,
) -> Result<(), CryptoError> {
    if node.is_some_and(|n| n.sensitive) {
        if let Value::String(s) = value {
            if looks_encrypted(s) {
                return Err(CryptoError::AlreadyEncrypted {
                    pointer: pointer.clone(),
                });
            }
        }
        let sealed = key.seal(event_id, pointer, value);
        // Overwrite the clear string's buffer before dropping it.
        if let Value::String(s) = value {
            zeroize::Zeroize::zeroize(s);
        }
        *value = Value::String(sealed);
        return Ok(());
    }
    match value {
        Value::String(s) if looks_encrypted(s) => Err(CryptoError::AmbiguousClearValue {
            pointer: pointer.clone(),
        }),
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                let child = node.and_then(|n| n.props.get(k));
                let len = pointer.len();
                push_segment(pointer, k);
                encrypt_walk(key, event_id, child, v, pointer)?;
                pointer.truncate(len);
            }
            Ok(())
        }
        Value::Array(items) => {
            let child = node.and_then(|n| n.items.as_deref());
            for (i, v) in items.iter_mut().enumerate() {
                let len = pointer.len();
                pointer.push('/');
                pointer.push_str(&i.to_string());
                encrypt_walk(key, event_id, child, v, pointer)?;
                pointer.truncate(len);
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Where the material of a key id comes from when decrypting.
pub enum Resolved<'a> {
    Key(&'a [u8; 32]),
    /// The key was deliberately destroyed (crypto-shredding): the value is gone for good.
    Erased,
}

/// Finds the material for a key id. The keyring is one; [`shred::DataKeys`] adds the
/// per-aggregate data keys of a keystore.
pub trait KeyResolver {
    fn resolve(&self, key_id: &str, pointer: &str) -> Result<Resolved<'_>, CryptoError>;
}

impl KeyResolver for Keyring {
    fn resolve(&self, key_id: &str, pointer: &str) -> Result<Resolved<'_>, CryptoError> {
        if shred::is_data_key_id(key_id) {
            return Err(CryptoError::NeedKeystore {
                pointer: pointer.to_string(),
                key_id: key_id.to_string(),
            });
        }
        self.material(key_id, pointer).map(Resolved::Key)
    }
}

/// A decrypted payload: erased fields (their data key forgotten) are `null` in `payload` and
/// listed by pointer in `erased`, so a consumer can tell erased from a real null.
#[derive(Debug, Clone, PartialEq)]
pub struct Decrypted {
    pub payload: Value,
    pub erased: Vec<String>,
}

fn decrypt_walk(
    keys: &dyn KeyResolver,
    event_id: Uuid,
    value: &mut Value,
    pointer: &mut String,
    stats: &mut WalkStats,
) -> Result<(), CryptoError> {
    match value {
        Value::String(s) if looks_encrypted(s) => {
            let parsed = envelope::parse(s, pointer)?;
            match keys.resolve(parsed.key_id, pointer)? {
                Resolved::Key(material) => {
                    let plain = envelope::open(material, &parsed, event_id, pointer)?;
                    // Values decrypted here are not walked again: an `enc:` string inside a
                    // sensitive object was clear text when it was sealed.
                    *value = serde_json::from_slice(&plain).map_err(|_| {
                        CryptoError::malformed(pointer, "the decrypted value is not JSON")
                    })?;
                }
                Resolved::Erased => {
                    *value = Value::Null;
                    stats.erased.push(pointer.clone());
                }
            }
            Ok(())
        }
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                let len = pointer.len();
                push_segment(pointer, k);
                decrypt_walk(keys, event_id, v, pointer, stats)?;
                pointer.truncate(len);
            }
            Ok(())
        }
        Value::Array(items) => {
            for (i, v) in items.iter_mut().enumerate() {
                let len = pointer.len();
                pointer.push('/');
                pointer.push_str(&i.to_string());
                decrypt_walk(keys, event_id, v, pointer, stats)?;
                pointer.truncate(len);
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

#[derive(Debug, Default)]
struct WalkStats {
    erased: Vec<String>,
}

/// Encrypts the fields `schema` marks, under the keyring's current key, for event `event_id`.
/// Fails (rather than guessing) when a sensitive field already holds ciphertext or a clear
/// field holds a string that readers would take for ciphertext.
pub fn encrypt_payload(
    keyring: &Keyring,
    schema: &Schema,
    event_id: Uuid,
    payload: &Value,
) -> Result<Value, CryptoError> {
    encrypt_payload_with(SealingKey::current(keyring), schema, event_id, payload)
}

/// [`encrypt_payload`] under a given key (an aggregate's data key).
pub fn encrypt_payload_with(
    key: SealingKey<'_>,
    schema: &Schema,
    event_id: Uuid,
    payload: &Value,
) -> Result<Value, CryptoError> {
    refuse_nil(event_id, "")?;
    let mut out = payload.clone();
    let mut pointer = String::new();
    encrypt_walk(key, event_id, Some(&schema.root), &mut out, &mut pointer)?;
    Ok(out)
}

/// Decrypts every `enc:v1:` value of an event's payload (the consumer's helper). Needs no
/// schema: each value says which key sealed it, and its position is its JSON Pointer.
pub fn decrypt_payload(
    keyring: &Keyring,
    event_id: Uuid,
    payload: &Value,
) -> Result<Value, CryptoError> {
    let d = decrypt_payload_with(keyring, event_id, payload)?;
    debug_assert!(d.erased.is_empty(), "a keyring alone never erases");
    Ok(d.payload)
}

/// [`decrypt_payload`] with any key source; erased fields are reported, not failed.
pub fn decrypt_payload_with(
    keys: &dyn KeyResolver,
    event_id: Uuid,
    payload: &Value,
) -> Result<Decrypted, CryptoError> {
    let mut out = payload.clone();
    let mut stats = WalkStats::default();
    decrypt_walk(keys, event_id, &mut out, &mut String::new(), &mut stats)?;
    Ok(Decrypted {
        payload: out,
        erased: stats.erased,
    })
}

/// Brings one stored payload up to date: values under an older key are opened and sealed again
/// under the current key at the same pointer, and fields the schema marks that are still clear
/// (rows written before encryption was switched on) are encrypted. A value is never turned back
/// into clear text, even if the schema no longer marks its field. `None` when nothing changes.
pub fn reencrypt_payload(
    keyring: &Keyring,
    schema: &Schema,
    event_id: Uuid,
    payload: &Value,
) -> Result<Option<Value>, CryptoError> {
    reencrypt_payload_with(
        keyring,
        SealingKey::current(keyring),
        schema,
        event_id,
        payload,
    )
}

/// [`reencrypt_payload`] sealing under `target`: with a keystore, the event's aggregate's data
/// key, so that every value of the aggregate — clear fields of old rows and values under any
/// keyring key, the current one included — ends up under the one key `keys forget` destroys.
/// Values already under a data key stay as they are (their wrapping is what rotates:
/// `Keystore::rewrap`).
pub fn reencrypt_payload_with(
    keyring: &Keyring,
    target: SealingKey<'_>,
    schema: &Schema,
    event_id: Uuid,
    payload: &Value,
) -> Result<Option<Value>, CryptoError> {
    fn walk(
        keyring: &Keyring,
        target: SealingKey<'_>,
        event_id: Uuid,
        node: Option<&Node>,
        value: &mut Value,
        pointer: &mut String,
        changed: &mut bool,
    ) -> Result<(), CryptoError> {
        match value {
            Value::String(s) if looks_encrypted(s) => {
                let parsed = envelope::parse(s, pointer)?;
                if parsed.key_id != target.id && !shred::is_data_key_id(parsed.key_id) {
                    let clear = decrypt_value(keyring, event_id, pointer, s)?;
                    *value = Value::String(target.seal(event_id, pointer, &clear));
                    *changed = true;
                }
                Ok(())
            }
            _ if node.is_some_and(|n| n.sensitive) => {
                let sealed = target.seal(event_id, pointer, value);
                if let Value::String(s) = value {
                    zeroize::Zeroize::zeroize(s);
                }
                *value = Value::String(sealed);
                *changed = true;
                Ok(())
            }
            Value::Object(map) => {
                for (k, v) in map.iter_mut() {
                    let child = node.and_then(|n| n.props.get(k));
                    let len = pointer.len();
                    push_segment(pointer, k);
                    walk(keyring, target, event_id, child, v, pointer, changed)?;
                    pointer.truncate(len);
                }
                Ok(())
            }
            Value::Array(items) => {
                let child = node.and_then(|n| n.items.as_deref());
                for (i, v) in items.iter_mut().enumerate() {
                    let len = pointer.len();
                    pointer.push('/');
                    pointer.push_str(&i.to_string());
                    walk(keyring, target, event_id, child, v, pointer, changed)?;
                    pointer.truncate(len);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
    refuse_nil(event_id, "")?;
    let mut out = payload.clone();
    let mut changed = false;
    walk(
        keyring,
        target,
        event_id,
        Some(&schema.root),
        &mut out,
        &mut String::new(),
        &mut changed,
    )?;
    Ok(changed.then_some(out))
}

/// A value of a payload that forgetting its aggregate's data key would not erase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unshreddable {
    pub pointer: String,
    /// The keyring key it is sealed under; `None` for a field the schema marks that is clear.
    pub key_id: Option<String>,
}

/// The values of `payload` outside every per-aggregate data key: sealed under a keyring key,
/// or marked sensitive by `schema` and still clear (`Schema::default()` marks nothing). Empty
/// when `keys forget` would erase every sensitive value of the event.
pub fn outside_data_keys(schema: &Schema, payload: &Value) -> Vec<Unshreddable> {
    fn walk(node: Option<&Node>, value: &Value, pointer: &mut String, out: &mut Vec<Unshreddable>) {
        match value {
            Value::String(s) if looks_encrypted(s) => {
                let id = s.split(':').nth(2).unwrap_or("");
                if !shred::is_data_key_id(id) {
                    out.push(Unshreddable {
                        pointer: pointer.clone(),
                        key_id: Some(id.to_string()),
                    });
                }
            }
            _ if node.is_some_and(|n| n.sensitive) => out.push(Unshreddable {
                pointer: pointer.clone(),
                key_id: None,
            }),
            Value::Object(map) => {
                for (k, v) in map {
                    let len = pointer.len();
                    push_segment(pointer, k);
                    walk(node.and_then(|n| n.props.get(k)), v, pointer, out);
                    pointer.truncate(len);
                }
            }
            Value::Array(items) => {
                let child = node.and_then(|n| n.items.as_deref());
                for (i, v) in items.iter().enumerate() {
                    let len = pointer.len();
                    pointer.push('/');
                    pointer.push_str(&i.to_string());
                    walk(child, v, pointer, out);
                    pointer.truncate(len);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(Some(&schema.root), payload, &mut String::new(), &mut out);
    out
}

/// The key ids an event's payload is encrypted under, with how many values each.
pub fn key_ids_in(payload: &Value) -> std::collections::BTreeMap<String, usize> {
    fn walk(v: &Value, out: &mut std::collections::BTreeMap<String, usize>) {
        match v {
            Value::String(s) if looks_encrypted(s) => {
                let id = s.split(':').nth(2).unwrap_or("").to_string();
                *out.entry(id).or_default() += 1;
            }
            Value::Object(m) => m.values().for_each(|c| walk(c, out)),
            Value::Array(a) => a.iter().for_each(|c| walk(c, out)),
            _ => {}
        }
    }
    let mut out = std::collections::BTreeMap::new();
    walk(payload, &mut out);
    out
}

/// A keyring and a schema, shared: what a producer needs ([`crate::Outbox::with_encryption`])
/// and what a consumer needs ([`Encryptor::decrypt_payload`]; the schema is not used there).
#[derive(Debug, Clone)]
pub struct Encryptor {
    keyring: Arc<Keyring>,
    schema: Arc<Schema>,
    // The keystore of per-aggregate data keys is a Postgres table.
    #[cfg(feature = "postgres")]
    keystore: Option<Arc<shred::Keystore>>,
}

impl Encryptor {
    pub fn new(keyring: Keyring, schema: Schema) -> Encryptor {
        Encryptor {
            keyring: Arc::new(keyring),
            schema: Arc::new(schema),
            #[cfg(feature = "postgres")]
            keystore: None,
        }
    }

    /// Seals each event's fields with its aggregate's data key from `keystore` (created on
    /// first use), so `keys forget --aggregate ID` can later erase them (crypto-shredding).
    #[cfg(feature = "postgres")]
    pub fn with_keystore(mut self, keystore: shred::Keystore) -> Encryptor {
        self.keystore = Some(Arc::new(keystore));
        self
    }

    #[cfg(feature = "postgres")]
    pub fn keystore(&self) -> Option<&shred::Keystore> {
        self.keystore.as_deref()
    }

    /// Encrypts an event's payload: under the aggregate's data key when there is a keystore,
    /// else under the keyring's current key.
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub async fn encrypt_event(
        &self,
        event_id: Uuid,
        aggregate_id: &str,
        payload: &Value,
    ) -> Result<Value, crate::Error> {
        #[cfg(feature = "postgres")]
        if let Some(ks) = &self.keystore {
            let (id, material) = ks.data_key_for(&self.keyring, aggregate_id).await?;
            let key = SealingKey {
                id: &id,
                material: &material,
            };
            return Ok(encrypt_payload_with(key, &self.schema, event_id, payload)?);
        }
        Ok(self.encrypt_payload(event_id, payload)?)
    }

    /// Decrypts an event's payload, looking data keys up in the keystore when there is one;
    /// fields whose data key was forgotten come back erased.
    pub async fn decrypt_event(
        &self,
        event_id: Uuid,
        payload: &Value,
    ) -> Result<Decrypted, crate::Error> {
        #[cfg(feature = "postgres")]
        if let Some(ks) = &self.keystore {
            let keys = ks.resolver(&self.keyring, payload).await?;
            return Ok(decrypt_payload_with(&keys, event_id, payload)?);
        }
        Ok(decrypt_payload_with(&*self.keyring, event_id, payload)?)
    }

    /// From a keyring file (or `OUTBOXD_KEYRING` when `keys` is `None`) and a schema file. The
    /// keyring's canaries are checked here, so a bad key fails at start-up.
    pub fn load(
        keys: Option<&std::path::Path>,
        schema: &std::path::Path,
    ) -> Result<Encryptor, CryptoError> {
        let keyring = Keyring::resolve(keys)?;
        let schema = Schema::load(schema)?;
        if !schema.has_sensitive() {
            return Err(CryptoError::Schema {
                problem: "the schema marks no field x-gdpr-sensitive".into(),
                fix: "mark the personal fields with \"x-gdpr-sensitive\": true".into(),
            });
        }
        Ok(Encryptor::new(keyring, schema))
    }

    pub fn keyring(&self) -> &Keyring {
        &self.keyring
    }

    pub fn schema(&self) -> &Schema {
        &self.schema
    }

    pub fn encrypt_payload(&self, event_id: Uuid, payload: &Value) -> Result<Value, CryptoError> {
        encrypt_payload(&self.keyring, &self.schema, event_id, payload)
    }

    pub fn decrypt_payload(&self, event_id: Uuid, payload: &Value) -> Result<Value, CryptoError> {
        decrypt_payload(&self.keyring, event_id, payload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ciphertext_shape() {
        assert!(looks_encrypted("enc:v1:k1:abc"));
        assert!(looks_encrypted("enc:v12:x"));
        assert!(!looks_encrypted("enc:v:x"));
        assert!(!looks_encrypted("enc: my note"));
        assert!(!looks_encrypted("encv1:"));
    }

    #[test]
    fn the_nil_event_id_is_refused() {
        let k = Keyring::generate(8).unwrap();
        let s = Schema::from_pointers(&["/tax_id"]);
        let p = json!({"tax_id": "1234567890"});
        let err = encrypt_payload(&k, &s, Uuid::nil(), &p).unwrap_err();
        assert!(matches!(err, CryptoError::NilEventId { .. }), "{err}");
        assert!(err.to_string().contains("nil event id"), "{err}");
        let err = encrypt_value(&k, Uuid::nil(), "/tax_id", &json!("x")).unwrap_err();
        assert!(
            matches!(&err, CryptoError::NilEventId { pointer } if pointer == "/tax_id"),
            "{err}"
        );
        assert!(encrypt_payload(&k, &s, Uuid::now_v7(), &p).is_ok());
    }

    #[test]
    fn only_marked_fields_are_encrypted_and_types_come_back() {
        let k = Keyring::generate(8).unwrap();
        let s = Schema::from_pointers(&["/tax_id", "/customer/age", "/lines/*/name", "/tags"]);
        let ev = Uuid::now_v7();
        let p = json!({
            "invoice_id": 7, "tax_id": "1234567890",
            "customer": {"age": 41, "country": "TR"},
            "lines": [{"name": "Ayşe", "qty": 1}, {"name": null}],
            "tags": ["a", {"b": true}],
        });
        let e = encrypt_payload(&k, &s, ev, &p).unwrap();
        assert_eq!(e["invoice_id"], 7);
        assert_eq!(e["customer"]["country"], "TR");
        for ptr in [
            "/tax_id",
            "/customer/age",
            "/lines/0/name",
            "/lines/1/name",
            "/tags",
        ] {
            assert!(
                looks_encrypted(e.pointer(ptr).unwrap().as_str().unwrap()),
                "{ptr}"
            );
        }
        assert!(!e.to_string().contains("1234567890"));
        assert_eq!(decrypt_payload(&k, ev, &e).unwrap(), p);
        assert_eq!(key_ids_in(&e).get(k.current_id()), Some(&5));
    }

    #[test]
    fn reencrypting_under_a_data_key_leaves_nothing_outside_it() {
        let k = Keyring::generate(8).unwrap();
        let s = Schema::from_pointers(&["/a", "/b", "/c"]);
        let ev = Uuid::now_v7();
        let under_ring =
            encrypt_payload(&k, &Schema::from_pointers(&["/a"]), ev, &json!({"a": 1})).unwrap();
        let mut p = json!({"a": under_ring["a"].clone(), "b": "clear", "d": 4});
        let found = outside_data_keys(&s, &p);
        assert_eq!(
            found,
            vec![
                Unshreddable {
                    pointer: "/a".into(),
                    key_id: Some(k.current_id().into())
                },
                Unshreddable {
                    pointer: "/b".into(),
                    key_id: None
                },
            ]
        );
        let material = [9u8; 32];
        let dk = SealingKey {
            id: "d-0011223344556677",
            material: &material,
        };
        let moved = reencrypt_payload_with(&k, dk, &s, ev, &p).unwrap().unwrap();
        assert!(outside_data_keys(&s, &moved).is_empty(), "{moved}");
        assert_eq!(key_ids_in(&moved).get(dk.id), Some(&2));
        assert_eq!(moved["d"], 4);
        // Already under a data key: nothing to do.
        assert_eq!(
            reencrypt_payload_with(&k, dk, &s, ev, &moved).unwrap(),
            None
        );
        p["b"] = moved["b"].clone();
        assert_eq!(outside_data_keys(&s, &p).len(), 1);
    }

    #[test]
    fn ambiguous_and_double_encryption_are_refused() {
        let k = Keyring::generate(8).unwrap();
        let s = Schema::from_pointers(&["/a"]);
        let ev = Uuid::now_v7();
        assert!(matches!(
            encrypt_payload(&k, &s, ev, &json!({"a": 1, "b": "enc:v1:x:y"})),
            Err(CryptoError::AmbiguousClearValue { .. })
        ));
        let once = encrypt_payload(&k, &s, ev, &json!({"a": 1})).unwrap();
        assert!(matches!(
            encrypt_payload(&k, &s, ev, &once),
            Err(CryptoError::AlreadyEncrypted { .. })
        ));
    }
}
