//! The keyring: encryption keys (one current, the previous ones kept for decryption, retired
//! ones kept as tombstones without material) and, separately, versioned blind-index keys. It
//! lives in a JSON file that must be private to its owner (mode 0600), or in the environment
//! (`OUTBOXD_KEYRING`). Every key carries a canary sealed when the key was made; loading checks
//! each one, so a key mistyped while copying between machines is caught at start-up rather than
//! after it has encrypted data nobody can read back.
//!
//! Commands that change the file go through [`KeyringFile`]: one writer at a time (a lock file
//! beside the keyring), never over a change made since their read, through symlinks, keeping
//! the file's owner and mode.
//!
//! Its unit tests live in `keyring/tests.rs`. It stays one file: the in-memory ring and its
//! JSON file format validate each other (every key's canary, the ids, the blind-index
//! versions), and split apart each half would need the other's internals.

use super::blind;
use super::envelope::{self, KeyBytes};
use super::error::CryptoError;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use chacha20poly1305::aead::rand_core::RngCore;
use chacha20poly1305::aead::OsRng;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use uuid::Uuid;
use zeroize::Zeroizing;

/// The environment variable that may hold the whole keyring JSON instead of a file.
pub const KEYRING_ENV: &str = "OUTBOXD_KEYRING";
/// The format version of the keyring file.
pub const FILE_VERSION: u32 = 1;
/// Where the canary is sealed: the nil event id and a pointer no payload field can clash with
/// (canaries never meet payloads anyway).
pub const CANARY_POINTER: &str = "/outboxd/canary";
const CANARY_PLAINTEXT: &[u8] = b"\"outboxd keyring canary\"";
/// Default length of a blind index in bytes (64 bits; see docs/encryption.md for sizing).
pub const DEFAULT_BLIND_LEN: usize = 8;

/// Key ids: 1 to 32 of `[A-Za-z0-9_-]`. No `:` (the value separator), nothing that needs
/// escaping in JSON, SQL LIKE patterns aside from `_`, or file names.
pub fn validate_key_id(id: &str) -> Result<(), CryptoError> {
    if id.is_empty()
        || id.len() > 32
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(CryptoError::invalid(
            format!("key id {id:?} is not 1 to 32 characters of [A-Za-z0-9_-]"),
            "use ids as `outboxd keys generate` makes them, e.g. k1f3a9c0d",
        ));
    }
    Ok(())
}

/// `d-…` names per-aggregate data keys (crypto-shredding), never keyring keys.
fn reserved(id: &str) -> Result<(), CryptoError> {
    if super::shred::is_data_key_id(id) {
        return Err(CryptoError::invalid(
            format!("key id {id:?} starts with \"d-\", which names per-aggregate data keys"),
            "rename the key (ids as outboxd keys generate makes them: k1f3a9c0d)",
        ));
    }
    Ok(())
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn random_key() -> KeyBytes {
    let mut k = Zeroizing::new([0u8; 32]);
    OsRng.fill_bytes(k.as_mut());
    k
}

fn decode_key(id: &str, b64: &str) -> Result<KeyBytes, CryptoError> {
    let bytes = Zeroizing::new(URL_SAFE_NO_PAD.decode(b64.trim()).map_err(|_| {
        CryptoError::invalid(
            format!("key {id:?}: material is not unpadded URL-safe base64"),
            "restore the keyring from its backup",
        )
    })?);
    let arr: [u8; 32] = bytes.as_slice().try_into().map_err(|_| {
        CryptoError::invalid(
            format!(
                "key {id:?}: material is {} bytes, not 32",
                bytes.as_slice().len()
            ),
            "restore the keyring from its backup",
        )
    })?;
    Ok(Zeroizing::new(arr))
}

fn encode_key(k: &KeyBytes) -> Zeroizing<String> {
    Zeroizing::new(URL_SAFE_NO_PAD.encode(k.as_ref()))
}

/// One encryption key. `material` is `None` once the key is retired.
#[derive(Clone)]
pub struct EncryptionKey {
    pub id: String,
    pub created_at: String,
    pub retired_at: Option<String>,
    material: Option<KeyBytes>,
    canary: Option<String>,
}

/// One blind-index key with its index length in bytes.
#[derive(Clone)]
pub struct BlindKey {
    pub id: String,
    pub created_at: String,
    pub length: usize,
    material: KeyBytes,
    check: String,
}

impl BlindKey {
    pub(crate) fn material(&self) -> &[u8; 32] {
        &self.material
    }
}

/// Key material never reaches a log through `Debug`.
impl fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncryptionKey")
            .field("id", &self.id)
            .field("retired_at", &self.retired_at)
            .field("material", &"[redacted]")
            .finish()
    }
}

impl fmt::Debug for BlindKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlindKey")
            .field("id", &self.id)
            .field("length", &self.length)
            .field("material", &"[redacted]")
            .finish()
    }
}

/// The keys, loaded and checked.
#[derive(Debug, Clone)]
pub struct Keyring {
    current: String,
    keys: Vec<EncryptionKey>,
    blind_current: String,
    blind: Vec<BlindKey>,
}

/// What `keys list` shows of a key: everything but the material.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub id: String,
    pub kind: &'static str,
    pub status: &'static str,
    pub created_at: String,
    pub retired_at: Option<String>,
    pub blind_length: Option<usize>,
}

// The file format. Unknown fields are refused: a misspelt "current" must not silently fall
// back to something else.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileV1 {
    outboxd_keyring: u32,
    current: String,
    keys: Vec<FileKey>,
    blind_index: FileBlind,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileKey {
    id: String,
    created_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key: Option<Zeroizing<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    canary: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    retired_at: Option<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBlind {
    current: String,
    keys: Vec<FileBlindKey>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBlindKey {
    id: String,
    created_at: String,
    key: Zeroizing<String>,
    length: usize,
    check: String,
}

impl Keyring {
    /// A new keyring: one encryption key and one blind-index key of `blind_length` bytes.
    pub fn generate(blind_length: usize) -> Result<Keyring, CryptoError> {
        validate_blind_length(blind_length)?;
        let mut k = Keyring {
            current: String::new(),
            keys: Vec::new(),
            blind_current: String::new(),
            blind: Vec::new(),
        };
        k.rotate();
        k.rotate_blind(blind_length)?;
        Ok(k)
    }

    /// Adds a new current encryption key; the old ones stay for decryption. Returns its id.
    pub fn rotate(&mut self) -> String {
        let id = self.fresh_id('k');
        let material = random_key();
        let canary = envelope::seal(
            &material,
            &id,
            Uuid::nil(),
            CANARY_POINTER,
            CANARY_PLAINTEXT,
        );
        self.keys.push(EncryptionKey {
            id: id.clone(),
            created_at: now(),
            retired_at: None,
            material: Some(material),
            canary: Some(canary),
        });
        self.current = id.clone();
        id
    }

    /// Adds a new current blind-index key. Indexes made with the old key stay valid for as long
    /// as that key is kept; new rows should be indexed under the new one (and old rows
    /// re-indexed) before the old key is dropped.
    pub fn rotate_blind(&mut self, length: usize) -> Result<String, CryptoError> {
        validate_blind_length(length)?;
        let id = self.fresh_id('b');
        let material = random_key();
        let check = blind::check_value(&material, &id);
        self.blind.push(BlindKey {
            id: id.clone(),
            created_at: now(),
            length,
            material,
            check,
        });
        self.blind_current = id.clone();
        Ok(id)
    }

    /// Removes a previous key's material, keeping its id so that a value still using it fails
    /// as "key retired" rather than "unknown key". The current key cannot be retired.
    pub fn retire(&mut self, id: &str) -> Result<(), CryptoError> {
        if id == self.current {
            return Err(CryptoError::invalid(
                format!("key {id:?} is the current key"),
                "rotate first (outboxd keys rotate), re-encrypt (outboxd reencrypt), then retire it",
            ));
        }
        let k = self.keys.iter_mut().find(|k| k.id == id).ok_or_else(|| {
            CryptoError::invalid(
                format!("no encryption key {id:?} in this keyring"),
                "see the ids with outboxd keys list",
            )
        })?;
        if k.material.is_none() {
            return Err(CryptoError::invalid(
                format!("key {id:?} is already retired"),
                "nothing to do",
            ));
        }
        k.material = None;
        k.canary = None;
        k.retired_at = Some(now());
        Ok(())
    }

    fn fresh_id(&self, prefix: char) -> String {
        loop {
            let mut b = [0u8; 4];
            OsRng.fill_bytes(&mut b);
            let id = format!("{prefix}{:02x}{:02x}{:02x}{:02x}", b[0], b[1], b[2], b[3]);
            if !self.keys.iter().any(|k| k.id == id) && !self.blind.iter().any(|k| k.id == id) {
                return id;
            }
        }
    }

    /// The current encryption key: (id, material).
    pub fn current(&self) -> (&str, &[u8; 32]) {
        let k = self
            .keys
            .iter()
            .find(|k| k.id == self.current)
            .expect("validated: the current key exists and has material");
        (
            &k.id,
            k.material
                .as_ref()
                .expect("validated: the current key has material"),
        )
    }

    pub fn current_id(&self) -> &str {
        &self.current
    }

    /// The material of key `id` for decrypting the field at `pointer`.
    pub fn material(&self, id: &str, pointer: &str) -> Result<&[u8; 32], CryptoError> {
        match self.keys.iter().find(|k| k.id == id) {
            Some(EncryptionKey {
                material: Some(m), ..
            }) => Ok(m),
            Some(k) => Err(CryptoError::KeyMissing {
                pointer: pointer.to_string(),
                key_id: id.to_string(),
                retired_at: k.retired_at.clone().unwrap_or_else(|| "?".into()),
            }),
            None => Err(CryptoError::UnknownKeyId {
                pointer: pointer.to_string(),
                key_id: id.to_string(),
                known: self
                    .keys
                    .iter()
                    .map(|k| k.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// The encryption key ids, oldest first.
    pub fn encryption_key_ids(&self) -> Vec<&str> {
        self.keys.iter().map(|k| k.id.as_str()).collect()
    }

    /// The current blind-index key.
    pub fn blind_current(&self) -> &BlindKey {
        self.blind
            .iter()
            .find(|k| k.id == self.blind_current)
            .expect("validated: the current blind-index key exists")
    }

    /// Every blind-index key, current first (search under each while re-indexing).
    pub fn blind_keys(&self) -> Vec<&BlindKey> {
        let mut v: Vec<&BlindKey> = self.blind.iter().collect();
        v.sort_by_key(|k| {
            (
                k.id != self.blind_current,
                std::cmp::Reverse(k.created_at.clone()),
            )
        });
        v
    }

    /// All keys without material, for `keys list`.
    pub fn list(&self) -> Vec<KeyInfo> {
        let mut out: Vec<KeyInfo> = self
            .keys
            .iter()
            .map(|k| KeyInfo {
                id: k.id.clone(),
                kind: "encryption",
                status: if k.id == self.current {
                    "current"
                } else if k.material.is_none() {
                    "retired"
                } else {
                    "previous"
                },
                created_at: k.created_at.clone(),
                retired_at: k.retired_at.clone(),
                blind_length: None,
            })
            .collect();
        out.extend(self.blind.iter().map(|k| KeyInfo {
            id: k.id.clone(),
            kind: "blind-index",
            status: if k.id == self.blind_current {
                "current"
            } else {
                "previous"
            },
            created_at: k.created_at.clone(),
            retired_at: None,
            blind_length: Some(k.length),
        }));
        out
    }

    /// Parses and checks a keyring (structure, ids, material, every canary).
    pub fn from_json(text: &str) -> Result<Keyring, CryptoError> {
        let file: FileV1 = serde_json::from_str(text).map_err(|e| {
            CryptoError::invalid(
                format!("not an outboxd keyring: {}", describe_json_error(&e)),
                "create one with outboxd keys generate --keys PATH",
            )
        })?;
        if file.outboxd_keyring != FILE_VERSION {
            return Err(CryptoError::invalid(
                format!(
                    "keyring format {} (this build reads {FILE_VERSION})",
                    file.outboxd_keyring
                ),
                "use the outboxd version that wrote it",
            ));
        }
        let mut keys = Vec::with_capacity(file.keys.len());
        for k in file.keys {
            validate_key_id(&k.id)?;
            reserved(&k.id)?;
            let material = match &k.key {
                Some(b64) => Some(decode_key(&k.id, b64)?),
                None => None,
            };
            if material.is_none() && k.retired_at.is_none() {
                return Err(CryptoError::invalid(
                    format!("key {:?} has no material and is not marked retired", k.id),
                    "restore the keyring from its backup",
                ));
            }
            if let Some(m) = &material {
                let canary = k.canary.as_deref().ok_or_else(|| {
                    CryptoError::invalid(
                        format!("key {:?} has no canary", k.id),
                        "restore the keyring from its backup (keys made by outboxd carry one)",
                    )
                })?;
                check_canary(&k.id, m, canary)?;
            }
            keys.push(EncryptionKey {
                id: k.id,
                created_at: k.created_at,
                retired_at: k.retired_at,
                material,
                canary: k.canary,
            });
        }
        let mut blind = Vec::with_capacity(file.blind_index.keys.len());
        for k in file.blind_index.keys {
            validate_key_id(&k.id)?;
            reserved(&k.id)?;
            validate_blind_length(k.length)?;
            let material = decode_key(&k.id, &k.key)?;
            if blind::check_value(&material, &k.id) != k.check {
                return Err(CryptoError::Canary { key_id: k.id });
            }
            blind.push(BlindKey {
                id: k.id,
                created_at: k.created_at,
                length: k.length,
                material,
                check: k.check,
            });
        }
        let mut ids: Vec<&str> = keys
            .iter()
            .map(|k| k.id.as_str())
            .chain(blind.iter().map(|k| k.id.as_str()))
            .collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(CryptoError::invalid(
                format!("key id {:?} appears twice", w[0]),
                "restore the keyring from its backup",
            ));
        }
        if !keys
            .iter()
            .any(|k| k.id == file.current && k.material.is_some())
        {
            return Err(CryptoError::invalid(
                format!(
                    "current key {:?} is not a usable key of this keyring",
                    file.current
                ),
                "point \"current\" at a key that has material (see outboxd keys list)",
            ));
        }
        if !blind.iter().any(|k| k.id == file.blind_index.current) {
            return Err(CryptoError::invalid(
                format!(
                    "current blind-index key {:?} is not in this keyring",
                    file.blind_index.current
                ),
                "point blind_index.current at one of its keys",
            ));
        }
        Ok(Keyring {
            current: file.current,
            keys,
            blind_current: file.blind_index.current,
            blind,
        })
    }

    /// The keyring as JSON (holding key material: write it only to a private file).
    pub fn to_json(&self) -> Zeroizing<String> {
        let file = FileV1 {
            outboxd_keyring: FILE_VERSION,
            current: self.current.clone(),
            keys: self
                .keys
                .iter()
                .map(|k| FileKey {
                    id: k.id.clone(),
                    created_at: k.created_at.clone(),
                    key: k.material.as_ref().map(encode_key),
                    canary: k.canary.clone(),
                    retired_at: k.retired_at.clone(),
                })
                .collect(),
            blind_index: FileBlind {
                current: self.blind_current.clone(),
                keys: self
                    .blind
                    .iter()
                    .map(|k| FileBlindKey {
                        id: k.id.clone(),
                        created_at: k.created_at.clone(),
                        key: encode_key(&k.material),
                        length: k.length,
                        check: k.check.clone(),
                    })
                    .collect(),
            },
        };
        let mut s =
            Zeroizing::new(serde_json::to_string_pretty(&file).expect("the keyring serialises"));
        s.push('\n');
        s
    }

    /// Loads a keyring file, refusing one that group or others can read.
    pub fn load(path: &Path) -> Result<Keyring, CryptoError> {
        Keyring::from_json(&read_text(path)?)
    }

    /// `--keys PATH` if given, else the JSON in `OUTBOXD_KEYRING`.
    pub fn resolve(path: Option<&Path>) -> Result<Keyring, CryptoError> {
        match path {
            Some(p) => Keyring::load(p),
            None => match std::env::var(KEYRING_ENV) {
                Ok(text) => {
                    let text = Zeroizing::new(text);
                    Keyring::from_json(&text)
                }
                Err(_) => Err(CryptoError::NoKeyring),
            },
        }
    }

    /// Writes a new keyring file with mode 0600; refuses to overwrite anything.
    pub fn save_new(&self, path: &Path) -> Result<(), CryptoError> {
        write_private(path, &self.to_json(), None)
    }

    /// Replaces a keyring file atomically (see [`KeyringFile::replace`]), under the writers'
    /// lock. It does not check what the file held before: a command that read the keyring to
    /// change it uses [`KeyringFile`], which refuses a file changed since it was read.
    pub fn save_replace(&self, path: &Path) -> Result<(), CryptoError> {
        KeyringFile::lock(path, |_| {})?.replace(self)
    }
}

/// The text of a keyring file: opened once, checked on the descriptor, read from it
/// (crate::secret_file).
fn read_text(path: &Path) -> Result<Zeroizing<String>, CryptoError> {
    let io = |problem: String, fix: &str| CryptoError::KeyringIo {
        path: path.display().to_string(),
        problem,
        fix: fix.to_string(),
    };
    use crate::secret_file::SecretFileError as E;
    crate::secret_file::read_string(path).map_err(|e| match e {
        E::Mode { mode, .. } => CryptoError::KeyringPermissions {
            path: path.display().to_string(),
            mode,
        },
        E::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound => io(
            format!("cannot read it: {source}"),
            "create one with outboxd keys generate --keys PATH, or point --keys at it",
        ),
        other => io(other.to_string(), &other.fix()),
    })
}

/// What a keyring file was when a command read it: the content, and the inode and mtime (a
/// rewrite in place changes the mtime, a replacement the inode, even with the same content).
struct Seen {
    text: Zeroizing<String>,
    identity: (u64, u64, Option<std::time::SystemTime>),
}

fn identity(meta: &std::fs::Metadata) -> (u64, u64, Option<std::time::SystemTime>) {
    #[cfg(unix)]
    let (dev, ino) = {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    };
    #[cfg(not(unix))]
    let (dev, ino) = (0, 0);
    (dev, ino, meta.modified().ok())
}

/// A keyring file held for a change (`keys rotate`, `keys retire`). Writers serialise on an
/// advisory lock (`flock`) on `<keyring>.lock` beside the file, held from the read to the
/// write: a `keys rotate` while `keys retire` scans the table waits instead of being undone by
/// retire's write. A program that does not take the lock (an editor, a restore) is caught
/// instead: the write is refused when the file changed since it was read. Symlinks are
/// followed to the file they name, which is the one replaced, keeping its owner and mode (an
/// operator's `root:outboxd 0400` stays so; a symlink into a secrets mount stays a symlink).
pub struct KeyringFile {
    /// As the user gave it (for messages).
    given: PathBuf,
    /// The file itself, symlinks resolved: what is read, locked beside and replaced.
    target: PathBuf,
    /// Held open: the lock lasts as long as this value.
    _lock: std::fs::File,
    seen: Option<Seen>,
}

impl fmt::Debug for KeyringFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyringFile")
            .field("path", &self.given)
            .field("target", &self.target)
            .finish()
    }
}

impl KeyringFile {
    /// Takes the writers' lock of the keyring at `path` (waiting for another writer to finish;
    /// `on_wait` is told the lock file's path first, so a command can say why it waits).
    pub fn lock(path: &Path, on_wait: impl FnOnce(&Path)) -> Result<KeyringFile, CryptoError> {
        let io = |p: &Path, problem: String, fix: String| CryptoError::KeyringIo {
            path: p.display().to_string(),
            problem,
            fix,
        };
        let target = std::fs::canonicalize(path).map_err(|e| {
            io(
                path,
                format!("cannot read it: {e}"),
                "point --keys at the keyring file (create one with outboxd keys generate --keys PATH)"
                    .into(),
            )
        })?;
        let mut name = target.file_name().unwrap_or_default().to_os_string();
        name.push(".lock");
        let lock_path = target.with_file_name(name);
        let mut opts = std::fs::OpenOptions::new();
        // Never truncated nor removed: removing a lock file lets two writers lock two files.
        opts.write(true).create(true).truncate(false);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let lock = opts.open(&lock_path).map_err(|e| {
            io(
                &lock_path,
                format!("cannot open the keyring's lock file: {e}"),
                "run the command as a user who may write the keyring's directory".into(),
            )
        })?;
        flock(&lock, &lock_path, on_wait)?;
        Ok(KeyringFile {
            given: path.to_path_buf(),
            target,
            _lock: lock,
            seen: None,
        })
    }

    /// Reads and checks the keyring, remembering what the file was for [`Self::replace`].
    pub fn read(&mut self) -> Result<Keyring, CryptoError> {
        let text = read_text(&self.target)?;
        let meta = std::fs::metadata(&self.target).map_err(|e| self.io_error(e, "read"))?;
        let keyring = Keyring::from_json(&text)?;
        self.seen = Some(Seen {
            text,
            identity: identity(&meta),
        });
        Ok(keyring)
    }

    fn io_error(&self, e: std::io::Error, what: &str) -> CryptoError {
        CryptoError::KeyringIo {
            path: self.given.display().to_string(),
            problem: format!("cannot {what} it: {e}"),
            fix: "point --keys at the keyring file".into(),
        }
    }

    /// Replaces the file atomically (temporary file beside it, fsync, rename, fsync of the
    /// directory): a crash leaves the old keyring or the new one, never half of one — losing
    /// the keyring loses the data. The new file gets the old one's owner, group and mode.
    /// Refused when the file changed since [`Self::read`].
    pub fn replace(&self, keyring: &Keyring) -> Result<(), CryptoError> {
        let path = &self.target;
        let meta = std::fs::metadata(path).map_err(|e| self.io_error(e, "read"))?;
        check_private(path, &meta)?;
        if let Some(seen) = &self.seen {
            let now = read_text(path)?;
            if identity(&meta) != seen.identity || *now != *seen.text {
                return Err(CryptoError::KeyringChanged {
                    path: self.given.display().to_string(),
                });
            }
        }
        let tmp = tmp_path(path);
        let _ = std::fs::remove_file(&tmp);
        if let Err(e) = write_private(&tmp, &keyring.to_json(), Some(&meta)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, path).map_err(|e| CryptoError::KeyringIo {
            path: path.display().to_string(),
            problem: format!("cannot replace it: {e}"),
            fix: format!(
                "the new keyring is in {}; move it into place",
                tmp.display()
            ),
        })?;
        if let Some(dir) = path.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            if let Ok(d) = std::fs::File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }
}

/// An exclusive `flock` on `file`, waiting for the holder when there is one.
#[cfg(unix)]
fn flock(
    file: &std::fs::File,
    path: &Path,
    on_wait: impl FnOnce(&Path),
) -> Result<(), CryptoError> {
    use std::os::unix::io::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: flock on a descriptor this function borrows; no memory is passed.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
        return Err(CryptoError::KeyringIo {
            path: path.display().to_string(),
            problem: format!("cannot lock it: {e}"),
            fix: "put the keyring on a file system that supports flock (a local one)".into(),
        });
    }
    on_wait(path);
    loop {
        // SAFETY: as above.
        if unsafe { libc::flock(fd, libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(CryptoError::KeyringIo {
                path: path.display().to_string(),
                problem: format!("cannot lock it: {e}"),
                fix: "put the keyring on a file system that supports flock (a local one)".into(),
            });
        }
    }
}

#[cfg(not(unix))]
fn flock(
    _file: &std::fs::File,
    _path: &Path,
    _on_wait: impl FnOnce(&Path),
) -> Result<(), CryptoError> {
    Ok(())
}

/// A serde_json error without the content it quotes: "invalid type: string \"…\"" would
/// print whatever string sat in the wrong place, which in a keyring may be key material. Field
/// names (unknown or missing field) are safe and help most, so they are kept.
fn describe_json_error(e: &serde_json::Error) -> String {
    let msg = e.to_string();
    let safe = msg.starts_with("unknown field") || msg.starts_with("missing field");
    let what = if safe {
        msg.split(" at line ").next().unwrap_or("").to_string()
    } else {
        match e.classify() {
            serde_json::error::Category::Syntax => "JSON syntax error".into(),
            serde_json::error::Category::Eof => "unexpected end of the file".into(),
            serde_json::error::Category::Data => "a value of the wrong type or form".into(),
            serde_json::error::Category::Io => "read error".into(),
        }
    };
    format!("{what} at line {} column {}", e.line(), e.column())
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

fn validate_blind_length(n: usize) -> Result<(), CryptoError> {
    if !(1..=32).contains(&n) {
        return Err(CryptoError::invalid(
            format!("blind-index length {n} is not 1 to 32 bytes"),
            "use e.g. --blind-index-length 8 (see docs/encryption.md, sizing)",
        ));
    }
    Ok(())
}

fn check_canary(id: &str, material: &[u8; 32], canary: &str) -> Result<(), CryptoError> {
    let fail = || CryptoError::Canary {
        key_id: id.to_string(),
    };
    let parsed = envelope::parse(canary, CANARY_POINTER).map_err(|_| fail())?;
    if parsed.key_id != id {
        return Err(fail());
    }
    let plain =
        envelope::open(material, &parsed, Uuid::nil(), CANARY_POINTER).map_err(|_| fail())?;
    if plain.as_slice() != CANARY_PLAINTEXT {
        return Err(fail());
    }
    Ok(())
}

#[cfg(unix)]
fn check_private(path: &Path, meta: &std::fs::Metadata) -> Result<(), CryptoError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(CryptoError::KeyringPermissions {
            path: path.display().to_string(),
            mode,
        });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_path: &Path, _meta: &std::fs::Metadata) -> Result<(), CryptoError> {
    Ok(())
}

/// Creates `path` with mode 0600 from the start (never chmod after the fact: the key would be
/// readable in between) and refuses an existing file. `like`: the file this one replaces,
/// whose owner, group and mode it takes before it is renamed into place.
fn write_private(
    path: &Path,
    text: &str,
    like: Option<&std::fs::Metadata>,
) -> Result<(), CryptoError> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(|e| CryptoError::KeyringIo {
        path: path.display().to_string(),
        problem: if e.kind() == std::io::ErrorKind::AlreadyExists {
            "already exists; outboxd never overwrites a keyring (that would lose the data its keys encrypted)".into()
        } else {
            format!("cannot create it: {e}")
        },
        fix: if e.kind() == std::io::ErrorKind::AlreadyExists {
            "choose another path, or use outboxd keys rotate --keys PATH to add a key".into()
        } else {
            "choose a writable directory".into()
        },
    })?;
    #[cfg(unix)]
    if let Some(old) = like {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let mine = f.metadata().map_err(|e| CryptoError::KeyringIo {
            path: path.display().to_string(),
            problem: format!("cannot read it back: {e}"),
            fix: "check the disk".into(),
        })?;
        if (mine.uid(), mine.gid()) != (old.uid(), old.gid()) {
            std::os::unix::fs::fchown(&f, Some(old.uid()), Some(old.gid())).map_err(|e| {
                CryptoError::KeyringIo {
                    path: path.display().to_string(),
                    problem: format!(
                        "cannot give the new keyring the old one's owner {}:{}: {e}",
                        old.uid(),
                        old.gid()
                    ),
                    fix: "run the command as the keyring's owner (or as root)".into(),
                }
            })?;
        }
        // The old file's mode, which was checked private (check_private) before this.
        f.set_permissions(std::fs::Permissions::from_mode(old.mode() & 0o7777))
            .map_err(|e| CryptoError::KeyringIo {
                path: path.display().to_string(),
                problem: format!("cannot set its mode: {e}"),
                fix: "check the file system".into(),
            })?;
    }
    #[cfg(not(unix))]
    let _ = like;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(|e| CryptoError::KeyringIo {
            path: path.display().to_string(),
            problem: format!("cannot write it: {e}"),
            fix: "check the disk".into(),
        })
}

#[cfg(test)]
mod tests;
