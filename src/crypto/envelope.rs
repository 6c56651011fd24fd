//! The `enc:v1:<key id>:<base64>` value format: one field sealed with XChaCha20-Poly1305 under a
//! key derived per field with HKDF-SHA256, bound by its associated data to the format version,
//! the key id, the event id and the field's JSON Pointer. `docs/encryption.md` documents every
//! byte; keep the two in step.

use super::error::CryptoError;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{Tag, XChaCha20Poly1305, XNonce};
use hkdf::Hkdf;
use sha2::{Digest, Sha256};
use uuid::Uuid;
use zeroize::Zeroizing;

/// Every encrypted value starts with this.
pub const PREFIX: &str = "enc:";
/// The one format version this build writes and reads.
pub const VERSION: &str = "v1";
pub const NONCE_LEN: usize = 24;
pub const TAG_LEN: usize = 16;
/// Two check bytes for the event id, two for the field pointer (diagnosis only, see below).
pub const CHECK_LEN: usize = 4;
/// Largest ciphertext body the length field may announce (the relay's message cap is 16 MiB).
pub const MAX_BODY: usize = (1 << 28) - 1;
/// The HKDF `info` label of field keys.
pub const FIELD_KEY_LABEL: &[u8] = b"outboxd field key";
/// The HKDF `info` label of the keys that wrap per-aggregate data keys: a wrapping key is never
/// a field key, so no value sealed for a payload can ever stand in for a wrapped key (or the
/// reverse), whatever its event id and pointer.
pub const WRAP_KEY_LABEL: &[u8] = b"outboxd data key wrap";

/// A 256-bit key, wiped from memory when dropped.
pub type KeyBytes = Zeroizing<[u8; 32]>;

/// Canonical length-prefixed encoding: each item as a 4-byte big-endian length, then its
/// bytes. Unambiguous for any items (no separator can be forged inside one), so two different
/// tuples never encode alike.
pub fn length_prefixed(items: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(items.iter().map(|i| 4 + i.len()).sum());
    for item in items {
        out.extend_from_slice(&(item.len() as u32).to_be_bytes());
        out.extend_from_slice(item);
    }
    out
}

/// The associated data of one field: (format version, key id, event id as its 16 bytes, JSON
/// Pointer). Authenticated, not stored: the reader rebuilds it from where the value sits.
pub fn associated_data(key_id: &str, event_id: Uuid, pointer: &str) -> Vec<u8> {
    length_prefixed(&[
        VERSION.as_bytes(),
        key_id.as_bytes(),
        event_id.as_bytes(),
        pointer.as_bytes(),
    ])
}

/// The field key: HKDF-SHA256 with no salt (the input is already a uniformly random key) and
/// `info` binding the label, the version, the key id and the pointer. Every field gets its own
/// key, so no two fields ever share a (key, nonce) space and a field key handed out can open one
/// field only.
pub fn field_key(material: &[u8; 32], key_id: &str, pointer: &str) -> KeyBytes {
    derive_key(FIELD_KEY_LABEL, material, key_id, pointer)
}

/// [`field_key`] with another `info` label ([`FIELD_KEY_LABEL`] or [`WRAP_KEY_LABEL`]).
fn derive_key(label: &[u8], material: &[u8; 32], key_id: &str, pointer: &str) -> KeyBytes {
    let info = length_prefixed(&[
        label,
        VERSION.as_bytes(),
        key_id.as_bytes(),
        pointer.as_bytes(),
    ]);
    let hk = Hkdf::<Sha256>::new(None, material);
    let mut okm = Zeroizing::new([0u8; 32]);
    hk.expand(&info, okm.as_mut())
        .expect("32 bytes is a valid HKDF-SHA256 output length");
    okm
}

/// Two bytes of SHA-256 over a value: the check bytes stored in clear so that a failed tag can be
/// explained (another event? another field?). They carry no secret (event id and pointer are
/// visible anyway) and protect nothing: authenticity rests on the tag alone.
fn check2(data: &[u8]) -> [u8; 2] {
    let d = Sha256::digest(data);
    [d[0], d[1]]
}

fn checks(event_id: Uuid, pointer: &str) -> [u8; CHECK_LEN] {
    let e = check2(event_id.as_bytes());
    let f = check2(pointer.as_bytes());
    [e[0], e[1], f[0], f[1]]
}

/// LEB128 (7 bits a byte, low first), at most 4 bytes.
fn put_varint(out: &mut Vec<u8>, mut n: usize) {
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

fn get_varint(bytes: &[u8]) -> Option<(usize, usize)> {
    let mut n = 0usize;
    for (i, &b) in bytes.iter().take(4).enumerate() {
        n |= ((b & 0x7f) as usize) << (7 * i);
        if b & 0x80 == 0 {
            // Canonical form only: no redundant trailing zero groups.
            if i > 0 && b == 0 {
                return None;
            }
            return Some((n, i + 1));
        }
    }
    None
}

/// Seals `plaintext` for (`key_id`, `event_id`, `pointer`) and returns the `enc:v1:…` string.
pub fn seal(
    material: &[u8; 32],
    key_id: &str,
    event_id: Uuid,
    pointer: &str,
    plaintext: &[u8],
) -> String {
    use chacha20poly1305::aead::rand_core::RngCore;
    // A random 192-bit nonce: no counter to persist or coordinate between producers, and the
    // chance of a repeat stays negligible far beyond any realistic number of values per key.
    let mut nonce = [0u8; NONCE_LEN];
    chacha20poly1305::aead::OsRng.fill_bytes(&mut nonce);
    seal_with_nonce(
        FIELD_KEY_LABEL,
        material,
        key_id,
        event_id,
        pointer,
        plaintext,
        &nonce,
    )
}

/// Wraps a per-aggregate data key under a keyring key: the `enc:v1:` format, keyed by
/// [`WRAP_KEY_LABEL`] (docs/encryption.md, "Per-aggregate data keys").
pub fn seal_wrapped_key(
    material: &[u8; 32],
    key_id: &str,
    pointer: &str,
    plaintext: &[u8],
) -> String {
    use chacha20poly1305::aead::rand_core::RngCore;
    let mut nonce = [0u8; NONCE_LEN];
    chacha20poly1305::aead::OsRng.fill_bytes(&mut nonce);
    seal_with_nonce(
        WRAP_KEY_LABEL,
        material,
        key_id,
        Uuid::nil(),
        pointer,
        plaintext,
        &nonce,
    )
}

/// [`seal`] with a given label and nonce. Private: a nonce must never be used twice with one
/// key, and only [`seal`] and [`seal_wrapped_key`] (fresh random nonces) may call it; the
/// known-answer vector of docs/encryption.md is checked by this module's tests.
fn seal_with_nonce(
    label: &[u8],
    material: &[u8; 32],
    key_id: &str,
    event_id: Uuid,
    pointer: &str,
    plaintext: &[u8],
    nonce: &[u8; NONCE_LEN],
) -> String {
    let key = derive_key(label, material, key_id, pointer);
    let cipher = XChaCha20Poly1305::new(key.as_ref().into());
    let ad = associated_data(key_id, event_id, pointer);

    let mut buf = Vec::with_capacity(NONCE_LEN + CHECK_LEN + 4 + plaintext.len() + TAG_LEN);
    buf.extend_from_slice(nonce);
    buf.extend_from_slice(&checks(event_id, pointer));
    put_varint(&mut buf, plaintext.len());
    let body_start = buf.len();
    buf.extend_from_slice(plaintext);
    let tag = cipher
        .encrypt_in_place_detached(XNonce::from_slice(nonce), &ad, &mut buf[body_start..])
        .expect("XChaCha20-Poly1305 accepts any message below 256 GiB");
    buf.extend_from_slice(&tag);

    let mut out = String::with_capacity(8 + key_id.len() + buf.len().div_ceil(3) * 4);
    out.push_str(PREFIX);
    out.push_str(VERSION);
    out.push(':');
    out.push_str(key_id);
    out.push(':');
    URL_SAFE_NO_PAD.encode_string(&buf, &mut out);
    out
}

/// Whether a JSON string is an encrypted value (of any version) rather than clear text.
pub fn is_encrypted(s: &str) -> bool {
    s.starts_with(PREFIX)
}

/// An `enc:` value split into its parts, not yet authenticated.
#[derive(Debug)]
pub struct Parsed<'a> {
    pub key_id: &'a str,
    pub bytes: Vec<u8>,
}

/// Splits `enc:v1:<key id>:<base64>`; `pointer` only names the field in errors.
pub fn parse<'a>(value: &'a str, pointer: &str) -> Result<Parsed<'a>, CryptoError> {
    let rest = value
        .strip_prefix(PREFIX)
        .ok_or_else(|| CryptoError::malformed(pointer, "does not start with \"enc:\""))?;
    let (version, rest) = rest
        .split_once(':')
        .ok_or_else(|| CryptoError::malformed(pointer, "no version"))?;
    if version != VERSION {
        return Err(CryptoError::UnsupportedVersion {
            pointer: pointer.to_string(),
            version: version.chars().take(16).collect(),
        });
    }
    let (key_id, b64) = rest
        .split_once(':')
        .ok_or_else(|| CryptoError::malformed(pointer, "no key id"))?;
    super::keyring::validate_key_id(key_id)
        .map_err(|_| CryptoError::malformed(pointer, "the key id is not [A-Za-z0-9_-]{1,32}"))?;
    let bytes = URL_SAFE_NO_PAD.decode(b64).map_err(|e| {
        CryptoError::malformed(
            pointer,
            format!("not unpadded URL-safe base64 (RFC 4648 §5): {e}"),
        )
    })?;
    Ok(Parsed { key_id, bytes })
}

/// Opens a parsed value with the key's material; returns the plaintext.
pub fn open(
    material: &[u8; 32],
    parsed: &Parsed<'_>,
    event_id: Uuid,
    pointer: &str,
) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
    open_labeled(FIELD_KEY_LABEL, material, parsed, event_id, pointer)
}

/// Unwraps a data key sealed by [`seal_wrapped_key`].
pub fn open_wrapped_key(
    material: &[u8; 32],
    parsed: &Parsed<'_>,
    pointer: &str,
) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
    open_labeled(WRAP_KEY_LABEL, material, parsed, Uuid::nil(), pointer)
}

fn open_labeled(
    label: &[u8],
    material: &[u8; 32],
    parsed: &Parsed<'_>,
    event_id: Uuid,
    pointer: &str,
) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
    let b = &parsed.bytes;
    let fixed = NONCE_LEN + CHECK_LEN;
    let truncated = |expected: usize| CryptoError::Truncated {
        pointer: pointer.to_string(),
        expected,
        got: b.len(),
    };
    if b.len() < fixed + 1 + TAG_LEN {
        return Err(truncated(fixed + 1 + TAG_LEN));
    }
    let (body_len, n) = get_varint(&b[fixed..])
        .ok_or_else(|| CryptoError::malformed(pointer, "bad length field"))?;
    if body_len > MAX_BODY {
        return Err(CryptoError::malformed(pointer, "length field out of range"));
    }
    let body_start = fixed + n;
    let total = body_start + body_len + TAG_LEN;
    if b.len() < total {
        return Err(truncated(total));
    }
    if b.len() > total {
        return Err(CryptoError::malformed(
            pointer,
            format!("{} bytes after the tag", b.len() - total),
        ));
    }
    let key = derive_key(label, material, parsed.key_id, pointer);
    let cipher = XChaCha20Poly1305::new(key.as_ref().into());
    let ad = associated_data(parsed.key_id, event_id, pointer);
    let mut plain = Zeroizing::new(b[body_start..body_start + body_len].to_vec());
    let tag = Tag::from_slice(&b[body_start + body_len..]);
    let want = checks(event_id, pointer);
    let have = &b[NONCE_LEN..NONCE_LEN + CHECK_LEN];
    match cipher.decrypt_in_place_detached(
        XNonce::from_slice(&b[..NONCE_LEN]),
        &ad,
        &mut plain,
        tag,
    ) {
        // The check bytes are not in the AD, but they are a function of what is: once the tag
        // holds they must equal the recomputed ones, so no byte of the value changes unnoticed.
        Ok(()) if have == want => Ok(plain),
        Ok(()) => Err(CryptoError::Tampered {
            pointer: pointer.to_string(),
            key_id: parsed.key_id.to_string(),
        }),
        Err(_) => {
            // The tag failed: say why as precisely as the clear check bytes allow.
            Err(if have[..2] != want[..2] {
                CryptoError::WrongEvent {
                    pointer: pointer.to_string(),
                    event_id: event_id.to_string(),
                }
            } else if have[2..] != want[2..] {
                CryptoError::MovedField {
                    pointer: pointer.to_string(),
                }
            } else {
                CryptoError::Tampered {
                    pointer: pointer.to_string(),
                    key_id: parsed.key_id.to_string(),
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known-answer vector printed in docs/encryption.md.
    #[test]
    fn known_answer_vector() {
        let material: [u8; 32] = std::array::from_fn(|i| i as u8);
        let nonce: [u8; NONCE_LEN] = std::array::from_fn(|i| 0x40 + i as u8);
        let ev = Uuid::parse_str("0192f3a4-5b6c-7d8e-9f00-112233445566").unwrap();
        let key = field_key(&material, "k1f3a9c0d", "/customer/tax_id");
        let s = seal_with_nonce(
            FIELD_KEY_LABEL,
            &material,
            "k1f3a9c0d",
            ev,
            "/customer/tax_id",
            b"\"1234567890\"",
            &nonce,
        );
        println!("field key {}", super::super::blind::hex(key.as_ref()));
        println!("value {s}");
        println!(
            "bytes {}",
            super::super::blind::hex(&parse(&s, "").unwrap().bytes)
        );
        assert_eq!(s, KAT_VALUE);
        let p = parse(&s, "/customer/tax_id").unwrap();
        assert_eq!(
            &open(&material, &p, ev, "/customer/tax_id").unwrap()[..],
            b"\"1234567890\""
        );
    }

    const KAT_VALUE: &str = "enc:v1:k1f3a9c0d:QEFCQ0RFRkdISUpLTE1OT1BRUlNUVVZXZkdK7Ayc7erOn7bi-oIwl-eP93c7HoH8pXYwk27JPo_T";

    #[test]
    fn varints_are_canonical() {
        for n in [0usize, 1, 127, 128, 300, 16383, 16384, MAX_BODY] {
            let mut v = Vec::new();
            put_varint(&mut v, n);
            assert_eq!(get_varint(&v), Some((n, v.len())), "{n}");
        }
        assert_eq!(get_varint(&[0x80, 0x00]), None);
        assert_eq!(get_varint(&[0x80, 0x80, 0x80, 0x80, 0x01]), None);
    }

    #[test]
    fn length_prefixing_is_unambiguous() {
        assert_ne!(
            length_prefixed(&[b"ab", b"c"]),
            length_prefixed(&[b"a", b"bc"])
        );
        assert_eq!(length_prefixed(&[b"v1"]), vec![0, 0, 0, 2, b'v', b'1']);
    }

    #[test]
    fn seal_open_and_each_failure() {
        let m = [7u8; 32];
        let ev = Uuid::now_v7();
        let s = seal(&m, "k1", ev, "/a", b"\"hello\"");
        assert!(s.starts_with("enc:v1:k1:"));
        let p = parse(&s, "/a").unwrap();
        assert_eq!(&open(&m, &p, ev, "/a").unwrap()[..], b"\"hello\"");
        assert!(matches!(
            open(&m, &p, Uuid::now_v7(), "/a"),
            Err(CryptoError::WrongEvent { .. })
        ));
        assert!(matches!(
            open(&m, &p, ev, "/b"),
            Err(CryptoError::MovedField { .. })
        ));
        assert!(matches!(
            open(&[8u8; 32], &p, ev, "/a"),
            Err(CryptoError::Tampered { .. })
        ));
        let mut cut = parse(&s, "/a").unwrap();
        cut.bytes.pop();
        assert!(matches!(
            open(&m, &cut, ev, "/a"),
            Err(CryptoError::Truncated { .. })
        ));
    }
}
