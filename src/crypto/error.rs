//! The typed errors of field-level encryption. Each way a value can fail to decrypt has its own
//! variant, because the operator's next step differs: an unknown key id means the wrong keyring,
//! a retired key means a restore from backup, another event id means a copied value, a moved
//! field means a swapped value, and only a failed tag with everything else matching means the
//! bytes were altered. Messages name the field (its JSON Pointer) and the key id, never a value
//! or key material.

/// Errors of the `crypto` module.
#[derive(Debug, thiserror::Error)]
pub enum CryptoError {
    /// The value names a key id this keyring has never held: most likely the wrong keyring.
    #[error("{pointer}: encrypted with key {key_id:?}, which this keyring does not hold (it holds {known}); decrypt with the keyring that wrote it")]
    UnknownKeyId {
        pointer: String,
        key_id: String,
        known: String,
    },

    /// The value is sealed with a per-aggregate data key, and no keystore was given.
    #[error("{pointer}: encrypted with the per-aggregate data key {key_id:?}; decrypt with the keystore that holds it (--keystore DSN)")]
    NeedKeystore { pointer: String, key_id: String },

    /// The keyring knows the key id but its material is gone (`keys retire`): the value can
    /// only be read again with a backup of the keyring from before the key was retired.
    #[error("{pointer}: key {key_id:?} was retired on {retired_at} and its material removed; restore the keyring from a backup taken before then to read this value")]
    KeyMissing {
        pointer: String,
        key_id: String,
        retired_at: String,
    },

    /// The value was sealed for another event (copied from another row or message).
    #[error("{pointer}: this value was encrypted for another event, not {event_id} (copied between events, or its header bytes were altered)")]
    WrongEvent { pointer: String, event_id: String },

    /// The value was sealed for another field of the payload (moved or swapped).
    #[error("{pointer}: this value was encrypted for another field (moved or swapped within the payload, or its header bytes were altered)")]
    MovedField { pointer: String },

    /// Event and field match, but the authentication tag does not: the bytes were changed.
    #[error("{pointer}: authentication failed: the encrypted value (key {key_id:?}) was altered")]
    Tampered { pointer: String, key_id: String },

    /// Fewer bytes than the value's length field says: cut short in transit or storage.
    #[error("{pointer}: encrypted value is truncated: {got} bytes where {expected} were written")]
    Truncated {
        pointer: String,
        expected: usize,
        got: usize,
    },

    /// Not an `enc:v1:<key id>:<base64>` value.
    #[error("{pointer}: malformed encrypted value: {reason}")]
    Malformed { pointer: String, reason: String },

    /// `enc:<version>:…` with a version this build does not read.
    #[error("{pointer}: encrypted value has format version {version:?}; this build reads v1 only")]
    UnsupportedVersion { pointer: String, version: String },

    /// A clear value that starts with `enc:` would be taken for ciphertext by every reader.
    #[error("{pointer}: a clear value starts with \"enc:\" and would be read as ciphertext; change the value or mark the field sensitive")]
    AmbiguousClearValue { pointer: String },

    /// A sensitive field already holds an encrypted value (encrypting twice).
    #[error("{pointer}: already encrypted; decrypt first (or use `outboxd reencrypt` to move it to the current key)")]
    AlreadyEncrypted { pointer: String },

    /// The keyring file is readable by group or others.
    #[error(
        "keyring {path} is readable by group or others (mode {mode:04o})\n  fix: chmod 600 {path}"
    )]
    KeyringPermissions { path: String, mode: u32 },

    /// The keyring cannot be read or written.
    #[error("keyring {path}: {problem}\n  fix: {fix}")]
    KeyringIo {
        path: String,
        problem: String,
        fix: String,
    },

    /// The keyring file changed between the command's read and its write (a program that does
    /// not take the writers' lock): writing would undo that change.
    #[error("keyring {path} changed since this command read it (another program rewrote it); nothing was written\n  fix: check the file (keys list), then run the command again: it reads the new keyring")]
    KeyringChanged { path: String },

    /// The keyring's content is not valid.
    #[error("keyring: {problem}\n  fix: {fix}")]
    KeyringInvalid { problem: String, fix: String },

    /// A key does not decrypt the canary written when it was made: its material was changed.
    #[error("keyring: key {key_id:?} fails its canary check: its material is not what it was when the key was made (mistyped or truncated copy?)\n  fix: restore the keyring from the backup taken when the key was made")]
    Canary { key_id: String },

    /// No keyring given.
    #[error("no keyring given\n  fix: pass --keys PATH (or set OUTBOXD_KEYS, or put the keyring JSON in OUTBOXD_KEYRING)")]
    NoKeyring,

    /// The schema file is not usable.
    #[error("schema: {problem}\n  fix: {fix}")]
    Schema { problem: String, fix: String },

    /// Encryption for the nil event id, which the keyring reserves for its canaries and the
    /// wrapped data keys: a payload field sealed for it could be confused with them.
    #[error("{pointer}: refusing to encrypt for the nil event id (00000000-0000-0000-0000-000000000000), which is reserved; give the event its real id")]
    NilEventId { pointer: String },

    /// The aggregate's data key was deleted (crypto-shredding). Decryption turns this into an
    /// erased value rather than failing; the error form is for callers that want it.
    #[error(
        "{pointer}: the data of aggregate {aggregate:?} was erased (its data key was forgotten)"
    )]
    Erased { pointer: String, aggregate: String },
}

impl CryptoError {
    /// Whether this is a problem with configuration (keyring or schema) rather than with data:
    /// the former exit 2, the latter 1 (docs/configuration.md).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            CryptoError::KeyringPermissions { .. }
                | CryptoError::KeyringIo { .. }
                | CryptoError::KeyringInvalid { .. }
                | CryptoError::Canary { .. }
                | CryptoError::NoKeyring
                | CryptoError::Schema { .. }
        )
    }

    pub(crate) fn malformed(pointer: &str, reason: impl Into<String>) -> Self {
        CryptoError::Malformed {
            pointer: pointer.to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        CryptoError::KeyringInvalid {
            problem: problem.into(),
            fix: fix.into(),
        }
    }
}
