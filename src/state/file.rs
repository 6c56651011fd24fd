//! `--offset-file PATH`: a MySQL/MariaDB relay's position in a local file instead of the
//! source database's `outboxd_state` table (for a database user that may not write, or a relay
//! that should leave no trace in the source). Same rules as the table: the position moves only
//! forward, is the end of the last transaction whose events are all confirmed, and a first
//! start is a start without a finished first start on record.
//!
//! Each write replaces the file atomically (temporary file, fsync, rename, fsync of the
//! directory), so a crash leaves the old or the new position, never half of one. The lease is an
//! exclusive `flock` on `PATH.lock`, held as long as the process lives: the kernel drops it when
//! the process dies, however it dies. (The lock is not on `PATH` itself: every write renames a
//! new file over it, and a lock stays with the old one.)

use super::{Lease, StateStore, Stored};
use crate::event::Checkpoint;
use crate::Error;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};

const VERSION: u32 = 1;

/// What the file holds (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffsetFile {
    pub version: u32,
    /// The relay (`--name`) whose position this is.
    pub name: String,
    /// `mysql`: a binlog position.
    pub source: String,
    /// Counts starts: each relay that takes the lock raises it.
    pub epoch: i64,
    /// The process that took the lock last (`host:pid:nonce`).
    pub holder: Option<String>,
    pub binlog_file: Option<String>,
    pub binlog_pos: Option<u64>,
    /// The server's GTID state at the position (MariaDB: every domain).
    pub gtid_state: Option<String>,
    /// The first start's snapshot is durable: later starts resume from the position.
    pub initialized: bool,
    /// An unfinished first start's snapshot: the last row whose publication is durable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_key: Option<String>,
    pub updated_at: String,
}

impl OffsetFile {
    fn new(name: &str) -> Self {
        OffsetFile {
            version: VERSION,
            name: name.to_string(),
            source: "mysql".into(),
            epoch: 0,
            holder: None,
            binlog_file: None,
            binlog_pos: None,
            gtid_state: None,
            initialized: false,
            snapshot_key: None,
            updated_at: String::new(),
        }
    }

    pub fn position(&self) -> Option<Checkpoint> {
        Some(Checkpoint::Binlog {
            file: self.binlog_file.clone()?,
            pos: self.binlog_pos?,
            gtid_state: self.gtid_state.clone().filter(|g| !g.is_empty()),
        })
    }

    fn set_position(&mut self, cp: &Checkpoint) -> Result<(), Error> {
        match cp {
            Checkpoint::Binlog {
                file,
                pos,
                gtid_state,
            } => {
                self.binlog_file = Some(file.clone());
                self.binlog_pos = Some(*pos);
                self.gtid_state = gtid_state.clone();
                Ok(())
            }
            other => Err(Error::Other(format!(
                "a {other} position cannot be stored in an offset file"
            ))),
        }
    }
}

fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

fn unreadable(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::config(
        format!("offset file {}: {why}", path.display()),
        format!(
            "restore the file from a backup, or move it aside and store the position by hand: \
             outboxd offset set --offset-file {} --binlog-position FILE:POS --source … --name … \
             (FILE:POS from the last x-source-position the consumers saw)",
            path.display()
        ),
    )
}

/// Reads the offset file; `None` when there is none yet. A file that exists but cannot be read
/// or parsed is a configuration error with the fix.
fn read_any(path: &Path) -> Result<Option<OffsetFile>, Error> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unreadable(path, format!("cannot be read: {e}"))),
    };
    let f: OffsetFile = serde_json::from_slice(&bytes)
        .map_err(|e| unreadable(path, format!("is not an outboxd offset file ({e})")))?;
    if f.version != VERSION || f.source != "mysql" {
        return Err(unreadable(
            path,
            format!(
                "has version {} for a {:?} source; this relay reads version {VERSION} for a mysql source",
                f.version, f.source
            ),
        ));
    }
    if f.initialized && f.position().is_none() {
        return Err(unreadable(
            path,
            "records a finished first start but no position",
        ));
    }
    Ok(Some(f))
}

/// Refuses a file that holds another relay name's position.
fn owned_by(path: &Path, f: OffsetFile, name: &str) -> Result<OffsetFile, Error> {
    if f.name != name {
        return Err(Error::config(
            format!(
                "offset file {} holds the position of relay {:?}, not {name:?}",
                path.display(),
                f.name
            ),
            format!(
                "run with --name {}, or give this relay its own --offset-file",
                f.name
            ),
        ));
    }
    Ok(f)
}

/// The offset file of relay `name`; `None` when there is none yet.
pub fn read(path: &Path, name: &str) -> Result<Option<OffsetFile>, Error> {
    read_any(path)?.map(|f| owned_by(path, f, name)).transpose()
}

/// Replaces the file atomically: a crash leaves the old content or the new, never a mix.
fn write_atomic(path: &Path, content: &OffsetFile) -> Result<(), Error> {
    let io = |what: &str, e: std::io::Error| {
        Error::source(format!("offset file {}: {what}: {e}", path.display()), true)
    };
    let mut bytes = serde_json::to_vec_pretty(content).map_err(|e| Error::Other(e.to_string()))?;
    bytes.push(b'\n');
    // A fresh name each time, created exclusively (O_CREAT|O_EXCL, which never follows a
    // symbolic link): a link planted at a predictable temporary name cannot redirect the
    // write to another file, and a leftover from a crash is never reused.
    let (tmp, mut f) = create_temporary(path).map_err(|e| io("create the temporary file", e))?;
    let written = f
        .write_all(&bytes)
        .map_err(|e| io("write", e))
        .and_then(|()| f.sync_all().map_err(|e| io("fsync", e)));
    drop(f);
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path).map_err(|e| io("rename", e)))
    {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("fsync the directory", e))?;
    Ok(())
}

/// A new file `PATH.<random>.tmp` beside `path`, created with `create_new` (mode 0600): never
/// an existing file, never through a symbolic link.
fn create_temporary(path: &Path) -> std::io::Result<(PathBuf, File)> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut last = None;
    for _ in 0..8 {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{:016x}.tmp", rand::random::<u64>()));
        let tmp = PathBuf::from(tmp);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no free temporary name")))
}

/// Takes the lock of `path` without waiting: `LeaseHeld` while another process holds it.
fn lock(path: &Path) -> Result<File, Error> {
    let lp = lock_path(path);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lp)
        .map_err(|e| {
            Error::config(
                format!(
                    "cannot open the lock file {} of --offset-file: {e}",
                    lp.display()
                ),
                "give --offset-file a path in a directory that exists and this user may write",
            )
        })?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(Error::LeaseHeld(format!(
            "offset file {} is in use by another relay (it holds the lock on {}); \
             stop that relay, or give this one its own --offset-file",
            path.display(),
            lp.display()
        ))),
        Err(TryLockError::Error(e)) => Err(Error::config(
            format!("cannot lock {}: {e}", lp.display()),
            "put --offset-file on a local file system that supports flock",
        )),
    }
}

/// The lease keeper's view of an offset file. Holds the lock until dropped or released.
pub struct FileStore {
    path: PathBuf,
    lock: Option<File>,
    content: OffsetFile,
}

impl FileStore {
    /// A store on `path` that holds no lock yet: [`StateStore::acquire`] takes it.
    pub fn open(path: &Path) -> FileStore {
        FileStore {
            path: path.to_path_buf(),
            lock: None,
            content: OffsetFile::new(""),
        }
    }

    /// Takes the lock (refused while another relay holds it), reads the file and records this
    /// start. Returns the lease and the stored position (on a first start, the one an earlier,
    /// interrupted run of it started from, if it got that far).
    pub fn acquire(
        path: &Path,
        name: &str,
        holder: &str,
    ) -> Result<(FileStore, Lease, Option<Checkpoint>), Error> {
        let mut store = FileStore::open(path);
        let (lease, stored) = store.take_lease(name, holder)?;
        Ok((store, lease, stored))
    }

    fn take_lease(
        &mut self,
        name: &str,
        holder: &str,
    ) -> Result<(Lease, Option<Checkpoint>), Error> {
        let path = self.path.as_path();
        let lock = lock(path)?;
        let mut content = read(path, name)?.unwrap_or_else(|| OffsetFile::new(name));
        if let Some(prev) = &content.holder {
            tracing::info!(previous_holder = %prev, "offset file: took the lock");
        }
        content.epoch += 1;
        content.holder = Some(holder.to_string());
        content.updated_at = now();
        write_atomic(path, &content)?;
        let lease = Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            epoch: content.epoch,
            first_start: !content.initialized,
            replay_since: None,
        };
        let stored = content.position();
        self.lock = Some(lock);
        self.content = content;
        Ok((lease, stored))
    }

    async fn save(&mut self, next: OffsetFile) -> Result<(), Error> {
        let path = self.path.clone();
        let c = next.clone();
        tokio::task::spawn_blocking(move || write_atomic(&path, &c))
            .await
            .map_err(|e| Error::Other(format!("offset file writer: {e}")))??;
        self.content = next;
        Ok(())
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// Stores a position by hand (`offset set --offset-file`): waits for no one, refused while a
/// relay holds the lock. The first start counts as done: the next start resumes there.
pub fn set_position(path: &Path, name: &str, cp: &Checkpoint) -> Result<(), Error> {
    let _lock = lock(path).map_err(|e| match e {
        Error::LeaseHeld(m) => Error::config(m, "stop the relay first"),
        e => e,
    })?;
    // A file that cannot be read is replaced: that is the fix its error names.
    let mut content = match read_any(path) {
        Ok(Some(f)) => owned_by(path, f, name)?,
        Ok(None) => OffsetFile::new(name),
        Err(e) => {
            tracing::warn!(error = %e, "replacing the unreadable offset file");
            OffsetFile::new(name)
        }
    };
    content.set_position(cp)?;
    content.initialized = true;
    content.snapshot_key = None;
    content.updated_at = now();
    write_atomic(path, &content)
}

impl StateStore for FileStore {
    async fn acquire(
        &mut self,
        name: &str,
        holder: &str,
    ) -> Result<(Lease, Option<Checkpoint>), Error> {
        self.take_lease(name, holder)
    }

    async fn load(&mut self, name: &str) -> Result<Option<Stored>, Error> {
        Ok(read(&self.path, name)?.map(|f| Stored {
            position: f.position(),
            initialized: f.initialized,
            snapshot_key: f.snapshot_key.clone(),
            // The file keeps no commit times: recovery through the table replays from the
            // fallback (see source::startup::replay_start).
            commit: Default::default(),
            stream_start: None,
            created_at: None,
        }))
    }

    async fn renew(
        &mut self,
        _lease: &Lease,
        position: Option<&Checkpoint>,
        _commit: &super::DurableCommit,
    ) -> Result<(), Error> {
        let Some(cp) = position else { return Ok(()) };
        if let Checkpoint::Snapshot { key, .. } = cp {
            let mut next = self.content.clone();
            next.snapshot_key = Some(key.clone());
            next.updated_at = now();
            return self.save(next).await;
        }
        // Never backwards: an older position than the stored one is not written.
        if let Some(stored) = self.content.position() {
            if !cp.is_after(&stored) {
                return Ok(());
            }
        }
        let mut next = self.content.clone();
        next.set_position(cp)?;
        next.updated_at = now();
        self.save(next).await
    }

    async fn mark_initialized(&mut self, _lease: &Lease) -> Result<(), Error> {
        if self.content.initialized {
            return Ok(());
        }
        let mut next = self.content.clone();
        next.initialized = true;
        next.snapshot_key = None;
        next.updated_at = now();
        self.save(next).await
    }

    async fn store_start(
        &mut self,
        _lease: &Lease,
        start: &Checkpoint,
        done: bool,
    ) -> Result<(), Error> {
        let mut next = self.content.clone();
        if next.position().is_none() {
            next.set_position(start)?;
        }
        next.initialized |= done;
        next.updated_at = now();
        self.save(next).await
    }

    async fn release(&mut self, _lease: &Lease) -> Result<(), Error> {
        // Dropping the file closes it, which releases the flock.
        self.lock = None;
        Ok(())
    }

    async fn restart(
        &mut self,
        _lease: &Lease,
        replay_since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), Error> {
        if replay_since.is_some() {
            return Err(super::mysql::no_replay());
        }
        let mut next = self.content.clone();
        next.binlog_file = None;
        next.binlog_pos = None;
        next.gtid_state = None;
        next.snapshot_key = None;
        next.initialized = false;
        next.updated_at = now();
        self.save(next).await
    }

    async fn replace_position(&mut self, _lease: &Lease, marker: &Checkpoint) -> Result<(), Error> {
        let mut next = self.content.clone();
        next.set_position(marker)?;
        next.updated_at = now();
        self.save(next).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cp(file: &str, pos: u64) -> Checkpoint {
        Checkpoint::Binlog {
            file: file.into(),
            pos,
            gtid_state: Some("0-1-5".into()),
        }
    }

    #[test]
    fn the_temporary_file_never_follows_a_symbolic_link() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("offsets.json");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        // The old fixed name, planted as a link to another file.
        std::os::unix::fs::symlink(&victim, dir.path().join("offsets.json.tmp")).unwrap();
        let content = OffsetFile::new("r1");
        write_atomic(&path, &content).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_file());
        // Exclusive creation: an existing name (a link included) is refused, not opened.
        let (tmp, _f) = create_temporary(&path).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let err = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&link)
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
        assert_ne!(tmp, dir.path().join("offsets.json.tmp"));
        // No temporary file is left behind by a successful write.
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp") && n != "offsets.json.tmp")
            .collect();
        assert_eq!(left.len(), 1, "only the one this test made: {left:?}");
    }

    #[tokio::test]
    async fn positions_move_forward_only_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("offsets.json");
        let (mut store, lease, stored) = FileStore::acquire(&path, "r1", "h:1:a").unwrap();
        assert!(lease.first_start);
        assert_eq!(stored, None);
        let c = super::super::DurableCommit::default();
        store
            .renew(&lease, Some(&cp("b.000002", 900)), &c)
            .await
            .unwrap();
        store.mark_initialized(&lease).await.unwrap();
        store
            .renew(&lease, Some(&cp("b.000002", 400)), &c)
            .await
            .unwrap();
        store
            .renew(&lease, Some(&cp("b.000001", 9999)), &c)
            .await
            .unwrap();
        assert_eq!(
            read(&path, "r1").unwrap().unwrap().position(),
            Some(cp("b.000002", 900))
        );
        // Held: a second relay is refused.
        assert!(matches!(
            FileStore::acquire(&path, "r1", "h:2:b"),
            Err(Error::LeaseHeld(_))
        ));
        store.release(&lease).await.unwrap();
        let (_s, lease2, stored) = FileStore::acquire(&path, "r1", "h:2:b").unwrap();
        assert!(!lease2.first_start);
        assert_eq!(lease2.epoch, 2);
        assert_eq!(stored, Some(cp("b.000002", 900)));
    }

    #[test]
    fn a_corrupt_or_foreign_file_is_a_config_error_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("offsets.json");
        std::fs::write(&path, b"{\"version\":1,\"name\":\"r1\",\"sour").unwrap();
        let e = FileStore::acquire(&path, "r1", "h:1:a").err().unwrap();
        assert!(matches!(e, Error::Config { .. }), "{e}");
        assert!(e.to_string().contains("offset set --offset-file"), "{e}");
        set_position(&path, "r1", &cp("b.000003", 4)).unwrap();
        let (_s, lease, stored) = FileStore::acquire(&path, "r1", "h:1:a").unwrap();
        assert!(!lease.first_start);
        assert_eq!(stored, Some(cp("b.000003", 4)));
        drop(_s);
        let e = FileStore::acquire(&path, "other", "h:1:a").err().unwrap();
        assert!(e.to_string().contains("--name r1"), "{e}");
    }
}
