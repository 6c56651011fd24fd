//! Idempotency keys for effects outside the transaction. `processed_messages` makes database
//! effects happen once, but a call to a payment or e-invoice API is not rolled back with the
//! transaction: a consumer that called the API and then crashed before commit calls it again
//! on the redelivery. The cure is to pass the API a key it deduplicates on, the same key on
//! every attempt — derived from what is stable across redeliveries: the event id, the
//! consumer, and the step (one event may cause several calls).
//!
//! The derivation is fixed so other languages can recompute it (docs/consumer.md):
//!
//! ```text
//! SHA-256( "outboxd.idempotency.v1"
//!          || event id (16 bytes, RFC 4122 order)
//!          || u32 BE length of consumer || consumer (UTF-8)
//!          || u32 BE length of step     || step (UTF-8) )
//! ```
//!
//! Lengths make the encoding unambiguous (`("ab", "c")` ≠ `("a", "bc")`). No secret is
//! involved: the key names an attempt, it does not authenticate anything.

use sha2::{Digest, Sha256};
use std::fmt;
use uuid::Uuid;

const DOMAIN: &[u8] = b"outboxd.idempotency.v1";

/// A stable key for one external call: same event, consumer and step → same key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdempotencyKey([u8; 32]);

impl IdempotencyKey {
    pub fn derive(event_id: Uuid, consumer: &str, step: &str) -> IdempotencyKey {
        let mut h = Sha256::new();
        h.update(DOMAIN);
        h.update(event_id.as_bytes());
        for part in [consumer, step] {
            h.update((part.len() as u32).to_be_bytes());
            h.update(part.as_bytes());
        }
        IdempotencyKey(h.finalize().into())
    }

    /// 64 lowercase hex digits: for `Idempotency-Key` headers (Stripe and most HTTP APIs
    /// accept up to 255 characters).
    pub fn hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// A UUID (version 8, RFC 9562) from the first 16 bytes: for APIs that want a UUID, such
    /// as an e-invoice's ETTN.
    pub fn uuid(&self) -> Uuid {
        let mut b = [0u8; 16];
        b.copy_from_slice(&self.0[..16]);
        uuid::Builder::from_custom_bytes(b).into_uuid()
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Uuid {
        Uuid::parse_str("0190a5c4-7e2b-7000-8000-00000000abcd").unwrap()
    }

    #[test]
    fn stable_and_distinct() {
        let k = IdempotencyKey::derive(id(), "billing", "charge");
        assert_eq!(k, IdempotencyKey::derive(id(), "billing", "charge"));
        assert_ne!(k, IdempotencyKey::derive(id(), "billing", "refund"));
        assert_ne!(k, IdempotencyKey::derive(id(), "shipping", "charge"));
        assert_ne!(k, IdempotencyKey::derive(Uuid::nil(), "billing", "charge"));
        // Length prefixes: moving a byte between the parts changes the key.
        assert_ne!(
            IdempotencyKey::derive(id(), "ab", "c"),
            IdempotencyKey::derive(id(), "a", "bc")
        );
        assert_eq!(k.hex().len(), 64);
        assert_eq!(k.uuid().get_version_num(), 8);
        assert_eq!(k.uuid().get_variant(), uuid::Variant::RFC4122);
    }

    /// The documented test vector (docs/consumer.md): other implementations check against it.
    #[test]
    fn documented_vector() {
        let k = IdempotencyKey::derive(id(), "billing", "e-invoice");
        assert_eq!(
            k.hex(),
            "9be8f90633e82f98652e9326e261ea267b6de96841db524d7d0859b671c0e7e2"
        );
        assert_eq!(k.uuid().to_string(), "9be8f906-33e8-8f98-a52e-9326e261ea26");
    }
}
