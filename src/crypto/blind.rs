//! Blind indexes: a deterministic, truncated HMAC-SHA256 of a normalised field value, stored in
//! its own column so that `WHERE tax_id_idx = ?` finds rows whose encrypted field holds a value,
//! without decrypting. The keys are separate from encryption keys and versioned, so rotating
//! encryption keys never breaks search; the key is derived per field, so equal values in two
//! fields do not give equal indexes (no linking across columns).

use super::envelope::length_prefixed;
use super::error::CryptoError;
use super::keyring::BlindKey;
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

const LABEL: &[u8] = b"outboxd blind index";
const VERSION: &[u8] = b"v1";

/// One normalisation step, applied in the order given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalize {
    /// Strip leading and trailing whitespace.
    Trim,
    /// Unicode lowercase (emails, user names).
    Lowercase,
    /// Keep only the ASCII digits (tax ids, phone numbers written with spaces or dashes).
    Digits,
    /// Keep only letters and digits, uppercased (IBANs, postcodes).
    Alnum,
    /// Turn every run of whitespace into one space.
    CollapseSpace,
}

impl Normalize {
    pub fn parse(s: &str) -> Result<Normalize, CryptoError> {
        Ok(match s.trim() {
            "trim" => Normalize::Trim,
            "lowercase" => Normalize::Lowercase,
            "digits" => Normalize::Digits,
            "alnum" => Normalize::Alnum,
            "collapse-space" => Normalize::CollapseSpace,
            other => {
                return Err(CryptoError::Schema {
                    problem: format!("unknown normalisation {other:?}"),
                    fix: "use trim, lowercase, digits, alnum or collapse-space".into(),
                })
            }
        })
    }

    /// Parses `trim,lowercase`; `none` or empty means no step.
    pub fn parse_list(s: &str) -> Result<Vec<Normalize>, CryptoError> {
        if s.trim().is_empty() || s.trim() == "none" {
            return Ok(Vec::new());
        }
        s.split(',').map(Normalize::parse).collect()
    }

    fn apply(self, s: &str) -> String {
        match self {
            Normalize::Trim => s.trim().to_string(),
            Normalize::Lowercase => s.to_lowercase(),
            Normalize::Digits => s.chars().filter(char::is_ascii_digit).collect(),
            Normalize::Alnum => s
                .chars()
                .filter(|c| c.is_alphanumeric())
                .flat_map(char::to_uppercase)
                .collect(),
            Normalize::CollapseSpace => s.split_whitespace().collect::<Vec<_>>().join(" "),
        }
    }
}

/// The default when neither the schema nor the command line says: trim only.
pub const DEFAULT_NORMALIZE: &[Normalize] = &[Normalize::Trim];

/// Applies the steps in order.
pub fn normalize(value: &str, steps: &[Normalize]) -> Zeroizing<String> {
    let mut s = Zeroizing::new(value.to_string());
    for step in steps {
        s = Zeroizing::new(step.apply(&s));
    }
    s
}

/// `tax_id` → `/tax_id`; a JSON Pointer stays as it is. Indexes are keyed by this form, so the
/// two spellings of a top-level field give the same index.
pub fn field_pointer(field: &str) -> String {
    if field.starts_with('/') {
        field.to_string()
    } else {
        format!("/{}", field.replace('~', "~0").replace('/', "~1"))
    }
}

fn field_mac(material: &[u8; 32], key_id: &str, field: &str) -> Hmac<Sha256> {
    let info = length_prefixed(&[LABEL, VERSION, key_id.as_bytes(), field.as_bytes()]);
    let mut k = Zeroizing::new([0u8; 32]);
    Hkdf::<Sha256>::new(None, material)
        .expand(&info, k.as_mut())
        .expect("32 bytes is a valid HKDF-SHA256 output length");
    <Hmac<Sha256> as Mac>::new_from_slice(k.as_ref()).expect("HMAC takes any key length")
}

/// The full 32-byte HMAC of an already normalised value.
pub fn mac(material: &[u8; 32], key_id: &str, field: &str, normalized: &str) -> [u8; 32] {
    let mut m = field_mac(material, key_id, field);
    m.update(normalized.as_bytes());
    m.finalize().into_bytes().into()
}

/// One blind index: the key that made it and the truncated HMAC in lowercase hex.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlindIndex {
    pub key_id: String,
    pub hex: String,
}

impl std::fmt::Display for BlindIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.key_id, self.hex)
    }
}

/// The blind index of `value` in `field` under `key`, normalised by `steps`, truncated to
/// `length` bytes (default: the key's).
pub fn blind_index(
    key: &BlindKey,
    field: &str,
    value: &str,
    steps: &[Normalize],
    length: Option<usize>,
) -> BlindIndex {
    let n = normalize(value, steps);
    let full = mac(key.material(), &key.id, &field_pointer(field), &n);
    let len = length.unwrap_or(key.length).clamp(1, 32);
    BlindIndex {
        key_id: key.id.clone(),
        hex: hex(&full[..len]),
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The check stored beside a blind-index key: 8 bytes of its MAC of a fixed value, verified at
/// load like the encryption keys' canaries.
pub fn check_value(material: &[u8; 32], key_id: &str) -> String {
    hex(&mac(
        material,
        key_id,
        "/outboxd/canary",
        "outboxd keyring canary",
    )[..8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisations() {
        let n = |v: &str, s: &str| normalize(v, &Normalize::parse_list(s).unwrap()).to_string();
        assert_eq!(
            n("  Ayşe@Example.COM \n", "trim,lowercase"),
            "ayşe@example.com"
        );
        assert_eq!(n("123 456-78 90", "digits"), "1234567890");
        assert_eq!(n("gb82 west 1234", "alnum"), "GB82WEST1234");
        assert_eq!(n(" a \t b  c ", "collapse-space"), "a b c");
        assert_eq!(n(" x ", "none"), " x ");
        assert!(Normalize::parse_list("soundex").is_err());
        assert_eq!(field_pointer("tax_id"), "/tax_id");
        assert_eq!(field_pointer("/customer/tax_id"), "/customer/tax_id");
        assert_eq!(field_pointer("a/b"), "/a~1b");
    }
}
