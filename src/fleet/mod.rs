//! `outboxd fleet`: one process runs many sources, each `DIR/<name>.toml` one relay with its own
//! name, lease, stored position and sink — the pipeline of `outboxd run`, in-process, one task
//! each, on one runtime. This module owns the supervision: the directory scanned every few
//! seconds (and on demand, SIGHUP) so that sources are added, restarted when their file
//! changes, and stopped when it goes, without a restart of the process; each source's runs,
//! retried with backoff after a failure without touching the others; a file that does not load
//! reported once per change; the per-source status (`status`); and, when several fleet
//! processes share the directory, which sources this one runs (`share`). Reading a file into
//! a run is the caller's [`Loader`] (the command line's, which reads `run`'s keys): the library
//! knows no flags. Every run takes its lease as a standby would (`--ha`), so a source another
//! process still holds is waited for, never published twice.

pub mod members;
pub(crate) mod share;
pub mod status;

use crate::backoff::Backoff;
use crate::dsn::DbDsn;
use crate::pipeline::RunPlan;
use crate::source::mysql::hub::{HubOptions, MysqlHub};
use crate::telemetry::live::{self, Live};
use crate::Error;
use futures::future::BoxFuture;
use futures::FutureExt;
use share::Share;
use status::{State, Status};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// One source of a fleet, as read from its file: runs until its token is cancelled (a
/// graceful stop) or fails; run again after a failure.
pub trait Tenant: Send + Sync + 'static {
    fn run(&self, shutdown: CancellationToken) -> BoxFuture<'static, Result<(), Error>>;
    /// [`Tenant::run`] in a fleet, whose sources of one MySQL/MariaDB server can read its
    /// binlog through one shared stream (`hubs`); a source that cannot just runs.
    fn run_in(
        &self,
        shutdown: CancellationToken,
        hubs: &Hubs,
    ) -> BoxFuture<'static, Result<(), Error>> {
        let _ = hubs;
        self.run(shutdown)
    }
    /// The database server it reads (`host:port`), for the status.
    fn server(&self) -> Option<String> {
        None
    }
}

impl Tenant for RunPlan {
    fn run(&self, shutdown: CancellationToken) -> BoxFuture<'static, Result<(), Error>> {
        self.clone().run(shutdown).map(|r| r.map(drop)).boxed()
    }
    fn run_in(
        &self,
        shutdown: CancellationToken,
        hubs: &Hubs,
    ) -> BoxFuture<'static, Result<(), Error>> {
        let Some(dsn) = self.shared_binlog().cloned() else {
            return self.run(shutdown);
        };
        let (plan, hubs) = (self.clone(), hubs.clone());
        async move {
            let hub = hubs.get(&dsn).await?;
            plan.run_shared(shutdown, hub).await.map(drop)
        }
        .boxed()
    }
    fn server(&self) -> Option<String> {
        RunPlan::server(self)
    }
}

/// The fleet's shared binlog streams (`source::mysql::hub`), one per MySQL/MariaDB server and
/// user its sources read: one dump connection serves every source of that server in this
/// process, instead of one each reading the whole binlog. Opened by the first source of a
/// server that runs, kept for the fleet's life (a hub without tenants holds no connection).
#[derive(Clone, Default)]
pub struct Hubs(Arc<tokio::sync::Mutex<HashMap<String, MysqlHub>>>);

impl Hubs {
    /// The shared stream of `dsn`'s server, opened through `dsn` if none is yet.
    async fn get(&self, dsn: &DbDsn) -> Result<MysqlHub, Error> {
        let key = format!("{}@{}:{}", dsn.user, dsn.host, dsn.port);
        let mut hubs = self.0.lock().await;
        if let Some(hub) = hubs.get(&key) {
            return Ok(hub.clone());
        }
        // The hub's name derives its replica server id: one per process and server, apart
        // from every other fleet process's hub on the same server (a second dump connection
        // with the same server id makes the server end the first).
        let name = format!("fleet {} {key}", crate::state::holder_id());
        let hub = MysqlHub::connect(dsn.clone(), HubOptions::new(&name)).await?;
        hubs.insert(key, hub.clone());
        Ok(hub)
    }
}

/// Reads the file of source `name` into a [`Tenant`]; an error is the file's problem, reported
/// once until the file changes.
pub type Loader = Arc<dyn Fn(&str, &Path) -> Result<Arc<dyn Tenant>, Error> + Send + Sync>;

/// How a fleet runs.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// The directory of source files (`<name>.toml`).
    pub dir: PathBuf,
    /// How often the directory is read again.
    pub rescan: Duration,
    /// The first and the longest wait before a failed source is run again.
    pub retry: (Duration, Duration),
    /// A run that lasted this long was healthy: the next failure waits the shortest time again.
    pub healthy_after: Duration,
}

impl FleetOptions {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FleetOptions {
            dir: dir.into(),
            rescan: Duration::from_secs(2),
            retry: (Duration::from_secs(1), Duration::from_secs(60)),
            healthy_after: Duration::from_secs(60),
        }
    }
}

/// The largest source file read (a file holds a few keys).
const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// A fleet process: its options, its loader and what it reports.
pub struct Fleet {
    opts: FleetOptions,
    loader: Loader,
    status: Arc<Status>,
    rescan: Arc<Notify>,
    share: Option<Arc<dyn Share>>,
    hubs: Hubs,
}

/// What the supervisor keeps of one file.
struct Entry {
    /// When last read.
    stamp: Stamp,
    /// The source's task's current definition (`None`: stop).
    spec: Option<watch::Sender<Option<Arc<dyn Tenant>>>>,
    /// The last version that loaded (run again when this process owns the source again).
    tenant: Option<Arc<dyn Tenant>>,
}

impl Fleet {
    pub fn new(opts: FleetOptions, loader: Loader) -> Self {
        Fleet {
            opts,
            loader,
            status: Arc::new(Status::default()),
            rescan: Arc::new(Notify::new()),
            share: None,
            hubs: Hubs::default(),
        }
    }

    /// Runs only the sources `share` gives this process (several fleet processes on one
    /// directory).
    pub fn with_share(mut self, share: Arc<dyn Share>) -> Self {
        self.share = Some(share);
        self
    }

    pub fn status(&self) -> Arc<Status> {
        self.status.clone()
    }

    /// Notified: the directory is read again at once (SIGHUP).
    pub fn rescan_trigger(&self) -> Arc<Notify> {
        self.rescan.clone()
    }

    /// Runs every source until `shutdown` is cancelled, then stops each gracefully (positions
    /// stored, leases released). Fails only when the directory cannot be read at the start.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        std::fs::read_dir(&self.opts.dir).map_err(|e| {
            Error::config(
                format!("--sources {}: {e}", self.opts.dir.display()),
                "name a directory holding one <name>.toml per source",
            )
        })?;
        let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
        let mut tasks = JoinSet::new();
        let share_changed = self.share.as_ref().map(|s| s.changed());
        let mut share_changed = share_changed;
        loop {
            self.scan(&mut entries, &mut tasks, &shutdown);
            self.status.scanned();
            // Reap the tasks of removed sources as they end.
            while tasks.try_join_next().is_some() {}
            let share_tick = async {
                match share_changed.as_mut() {
                    Some(rx) => {
                        if rx.changed().await.is_err() {
                            std::future::pending::<()>().await
                        }
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(self.opts.rescan) => {}
                _ = self.rescan.notified() => tracing::info!("reading the sources again"),
                _ = share_tick => {}
            }
        }
        // Every task sees the token and stops its run gracefully.
        drop(entries);
        while tasks.join_next().await.is_some() {}
        Ok(())
    }

    /// Whether this process runs `name` now.
    fn owns(&self, name: &str) -> bool {
        self.share.as_ref().is_none_or(|s| s.owns(name))
    }

    /// One pass over the directory: new files start, changed ones restart, removed ones stop;
    /// sources this process no longer owns stop, newly owned ones start.
    fn scan(
        &self,
        entries: &mut BTreeMap<String, Entry>,
        tasks: &mut JoinSet<()>,
        shutdown: &CancellationToken,
    ) {
        let found = match files(&self.opts.dir) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(dir = %self.opts.dir.display(), "cannot read the sources directory (kept what runs): {e}");
                return;
            }
        };
        entries.retain(|name, entry| {
            if found.contains_key(name) {
                return true;
            }
            tracing::info!(source = %name, "source file removed: stopping it");
            if let Some(tx) = entry.spec.take() {
                let _ = tx.send(None);
            }
            self.status.remove(name);
            false
        });
        for (name, (path, stamp)) in found {
            let changed = entries.get(&name).is_none_or(|e| e.stamp != stamp);
            let entry = entries.entry(name.clone()).or_insert_with(|| Entry {
                stamp,
                spec: None,
                tenant: None,
            });
            if changed {
                entry.stamp = stamp;
                match self.load(&name, &path, stamp.1) {
                    Ok(t) => {
                        if entry.tenant.is_some() {
                            tracing::info!(source = %name, "source file changed: restarting it");
                        }
                        self.status.config_error(&name, None);
                        entry.tenant = Some(t.clone());
                        if let Some(tx) = &entry.spec {
                            let _ = tx.send(Some(t));
                        }
                    }
                    Err(e) => {
                        tracing::error!(source = %name, file = %path.display(), "source file not loaded{}: {e}", if entry.tenant.is_some() { " (the previous version goes on running)" } else { "" });
                        self.status.config_error(&name, Some(e.to_string()));
                    }
                }
            }
            // Each source runs in its own task, on its own connections but one: sources of
            // one MySQL/MariaDB server read its binlog through the fleet's one shared stream
            // of that server (`Hubs`, opened by the first of them to run).
            let owned = self.owns(&name);
            match (&entry.spec, owned, &entry.tenant) {
                (None, true, Some(t)) => {
                    let (tx, rx) = watch::channel(Some(t.clone()));
                    entry.spec = Some(tx);
                    tasks.spawn(tenant_task(
                        name.clone(),
                        rx,
                        self.hubs.clone(),
                        self.status.clone(),
                        self.opts.clone(),
                        shutdown.clone(),
                    ));
                }
                (Some(_), false, _) => {
                    tracing::info!(source = %name, "source now owned by another fleet process: stopping it here");
                    if let Some(tx) = entry.spec.take() {
                        let _ = tx.send(None);
                    }
                }
                (None, false, Some(_)) => self.status.stopped(&name, State::Elsewhere),
                _ => {}
            }
        }
    }

    fn load(&self, name: &str, path: &Path, len: u64) -> Result<Arc<dyn Tenant>, Error> {
        if len > MAX_FILE_BYTES {
            return Err(Error::config(
                format!(
                    "{}: {len} bytes, more than the {MAX_FILE_BYTES} allowed",
                    path.display()
                ),
                "a source file holds a few keys: keep it small",
            ));
        }
        (self.loader)(name, path)
    }
}

/// A file's modification time and length: another means it changed.
type Stamp = (SystemTime, u64);

/// The source files of `dir` by name: `<name>.toml`, hidden files (an editor's) left out.
fn files(dir: &Path) -> std::io::Result<BTreeMap<String, (PathBuf, Stamp)>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let Some(name) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".toml"))
        else {
            continue;
        };
        if name.starts_with('.') || name.is_empty() {
            continue;
        }
        // Followed through a symlink (a mounted ConfigMap's files are links).
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        let mtime = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        out.insert(name.to_string(), (path, (mtime, meta.len())));
    }
    Ok(out)
}

/// One source's life: runs its current definition; after a failure waits (backoff, reset by a
/// healthy run or a new definition) and runs it again; a new definition stops the run and
/// starts the new one; `None` or the fleet's stop ends it, each after a graceful stop.
async fn tenant_task(
    name: String,
    mut spec: watch::Receiver<Option<Arc<dyn Tenant>>>,
    hubs: Hubs,
    status: Arc<Status>,
    opts: FleetOptions,
    shutdown: CancellationToken,
) {
    let mut backoff = Backoff::new(opts.retry.0, opts.retry.1);
    let span = tracing::info_span!("source", source = %name);
    loop {
        let Some(tenant) = spec.borrow_and_update().clone() else {
            break;
        };
        let live = Arc::new(Live::default());
        status.run_started(&name, live.clone(), tenant.server());
        let stop = shutdown.child_token();
        let began = Instant::now();
        let mut run = std::pin::pin!(
            live::scope(live, tenant.run_in(stop.clone(), &hubs)).instrument(span.clone())
        );
        let result = tokio::select! {
            r = &mut run => r,
            changed = spec.changed() => {
                stop.cancel();
                if let Err(e) = run.await {
                    tracing::warn!(source = %name, "stopped with an error: {e}");
                }
                if changed.is_err() {
                    break;
                }
                backoff.reset();
                continue;
            }
        };
        if shutdown.is_cancelled() {
            if let Err(e) = result {
                tracing::error!(source = %name, "stopped with an error: {e}");
            }
            break;
        }
        let reason = match result {
            Ok(()) => "the run ended by itself".to_string(),
            Err(e) => e.to_string(),
        };
        if began.elapsed() >= opts.healthy_after {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        tracing::error!(source = %name, retry_in = ?delay, "source failed: {reason}");
        status.failing(&name, reason, delay);
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            changed = spec.changed() => {
                if changed.is_err() {
                    break;
                }
                backoff.reset();
            }
            _ = shutdown.cancelled() => break,
        }
    }
    status.ended(&name);
}
