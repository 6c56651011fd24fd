//! Files that hold secrets: the keyring, `--source-file`/`--sink-file`/`--keystore-file` and
//! every TLS private key (`sslkey`, `ssl-key`, `--sink-key`). Each is opened once and checked on
//! the open descriptor (`fstat`), then read from that same descriptor, so the file checked is
//! the file read: no check-by-path-then-reopen race. The rule is libpq's for `sslkey`: a regular
//! file owned by the effective user with no group or other permission bits (0600 or stricter),
//! or owned by root with no write bit for the group and nothing for others (0640, for keys a
//! system package installs for a group).

use std::io::Read;
use std::path::{Path, PathBuf};
use zeroize::Zeroizing;

/// Largest secret file read: keyrings, DSNs and PEM keys are a few KiB; a larger "secret" is a
/// wrong path, and is refused before anything is allocated for it.
pub(crate) const MAX_LEN: u64 = 1 << 20;

/// Why a secret file was refused; the message names the path and the exact fix.
#[derive(Debug, thiserror::Error)]
pub enum SecretFileError {
    #[error("cannot read {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error("{} is owned by uid {owner}, not by the user outboxd runs as (uid {euid}) nor root", path.display())]
    Owner {
        path: PathBuf,
        owner: u32,
        euid: u32,
    },
    #[error("{} has group or other permissions (mode {mode:04o})", path.display())]
    Mode { path: PathBuf, mode: u32 },
    #[error("{} is larger than {MAX_LEN} bytes: not a secret file", path.display())]
    TooLarge { path: PathBuf },
}

impl SecretFileError {
    /// The exact command or step that fixes it.
    pub fn fix(&self) -> String {
        match self {
            SecretFileError::Open { .. } => {
                "point the option at a file that exists and the user outboxd runs as may read"
                    .into()
            }
            SecretFileError::NotAFile { .. } | SecretFileError::TooLarge { .. } => {
                "point the option at the file that holds the secret".into()
            }
            SecretFileError::Owner { path, .. } => format!(
                "chown $(id -u) {} (as root), or run outboxd as the file's owner",
                path.display()
            ),
            SecretFileError::Mode { path, .. } => format!("chmod 600 {}", path.display()),
        }
    }

    /// A configuration error of the crate, with the fix.
    pub fn into_config(self) -> crate::Error {
        let fix = self.fix();
        crate::Error::config(self.to_string(), fix)
    }
}

/// The decision on an open file's status: `uid`/`mode` from `fstat`, `euid` the process's.
pub(crate) fn check_status(
    path: &Path,
    is_file: bool,
    uid: u32,
    mode: u32,
    euid: u32,
) -> Result<(), SecretFileError> {
    if !is_file {
        return Err(SecretFileError::NotAFile { path: path.into() });
    }
    let mode = mode & 0o7777;
    let allowed = if uid == euid {
        0o700
    } else if uid == 0 {
        // libpq: a root-owned key may be group-readable (a group the service is in).
        0o740
    } else {
        return Err(SecretFileError::Owner {
            path: path.into(),
            owner: uid,
            euid,
        });
    };
    if mode & !allowed & 0o777 != 0 {
        return Err(SecretFileError::Mode {
            path: path.into(),
            mode,
        });
    }
    Ok(())
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Opens `path`, checks the open descriptor, and reads the whole file from it.
pub(crate) fn read(path: &Path) -> Result<Zeroizing<Vec<u8>>, SecretFileError> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let open_err = |source| SecretFileError::Open {
        path: path.into(),
        source,
    };
    // O_NONBLOCK: opening a FIFO planted at the path must not hang the start; the status check
    // then refuses it.
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(open_err)?;
    let meta = file.metadata().map_err(open_err)?;
    check_status(path, meta.is_file(), meta.uid(), meta.mode(), euid())?;
    if meta.len() > MAX_LEN {
        return Err(SecretFileError::TooLarge { path: path.into() });
    }
    let mut buf = Zeroizing::new(Vec::with_capacity(meta.len() as usize));
    // take: a file that grows after the fstat is still read only up to the cap.
    (&mut file)
        .take(MAX_LEN + 1)
        .read_to_end(&mut buf)
        .map_err(open_err)?;
    if buf.len() as u64 > MAX_LEN {
        return Err(SecretFileError::TooLarge { path: path.into() });
    }
    Ok(buf)
}

/// [`read`], as UTF-8 text.
pub fn read_string(path: &Path) -> Result<Zeroizing<String>, SecretFileError> {
    let bytes = read(path)?;
    match std::str::from_utf8(&bytes) {
        Ok(s) => Ok(Zeroizing::new(s.to_string())),
        Err(_) => Err(SecretFileError::Open {
            path: path.into(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_rule_is_libpqs() {
        let p = Path::new("/k");
        let me = 1000;
        assert!(check_status(p, true, me, 0o100600, me).is_ok());
        assert!(check_status(p, true, me, 0o100400, me).is_ok());
        for bad in [0o640, 0o604, 0o644, 0o660, 0o601, 0o610] {
            let e = check_status(p, true, me, bad, me).unwrap_err();
            assert!(matches!(e, SecretFileError::Mode { .. }), "{bad:o}");
            assert_eq!(e.fix(), "chmod 600 /k");
        }
        // Root-owned: group may read, not write; others nothing.
        assert!(check_status(p, true, 0, 0o640, me).is_ok());
        assert!(check_status(p, true, 0, 0o600, me).is_ok());
        assert!(check_status(p, true, 0, 0o660, me).is_err());
        assert!(check_status(p, true, 0, 0o644, me).is_err());
        // Someone else's file, however strict its mode.
        let e = check_status(p, true, 1001, 0o600, me).unwrap_err();
        assert!(matches!(
            e,
            SecretFileError::Owner {
                owner: 1001,
                euid: 1000,
                ..
            }
        ));
        assert!(e.fix().contains("chown"));
        assert!(matches!(
            check_status(p, false, me, 0o600, me),
            Err(SecretFileError::NotAFile { .. })
        ));
        // Running as root: root's own files follow the owner rule (0600).
        assert!(check_status(p, true, 0, 0o600, 0).is_ok());
        assert!(check_status(p, true, 0, 0o640, 0).is_err());
    }

    #[test]
    fn reads_from_the_checked_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "pw-Qx7\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read(&path).unwrap_err();
        assert!(
            matches!(e, SecretFileError::Mode { mode: 0o644, .. }),
            "{e}"
        );
        assert!(!e.to_string().contains("pw-Qx7"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(&*read_string(&path).unwrap(), "pw-Qx7\n");
        assert!(matches!(
            read(dir.path()),
            Err(SecretFileError::NotAFile { .. })
        ));
        assert!(matches!(
            read(&dir.path().join("missing")),
            Err(SecretFileError::Open { .. })
        ));
        // A FIFO does not hang the read: refused as not a regular file.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(matches!(read(&fifo), Err(SecretFileError::NotAFile { .. })));
        // Too large: refused before it is read.
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; MAX_LEN as usize + 1]).unwrap();
        std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(read(&big), Err(SecretFileError::TooLarge { .. })));
    }
}
