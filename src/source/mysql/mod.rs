//! The MySQL/MariaDB source: the server's binlog dump stream read with `mysql_async` (feature
//! `binlog`), decoded by [`decode`] (shared with the binlog-file source), rows mapped by
//! [`rows`], MariaDB GTIDs by [`gtid`]; plain SQL with `mysql_async` too.
//!
//! What the library leaves to us: `@mariadb_slave_capability=4` so MariaDB sends GTID
//! events, raw GTID/GTID_LIST parsing, GTID resume through `@slave_connect_state`, the CRC32
//! bytes in the first (fake) Rotate's file name, heartbeats plus a read timeout on every read,
//! and reconnecting — the library has none.
//!
//! Position rule (kept by the transaction assembler, [`assemble`]; `run` is the I/O around it):
//! an event's position is `file:end_pos:index` where `end_pos` ends its
//! transaction, so a transaction's rows are held until its commit (up to
//! `txn_buffer_bytes`; a larger one is scanned to its end once, then re-read from its start
//! and streamed with the end known). Rows a transaction rolled back inside its group (to a
//! savepoint, or whole) are dropped from what it holds; a streamed one that rolls back rows
//! stops the relay with the fix (a larger `--txn-buffer`) instead, before any of its rows goes
//! out where the scan sees the rollback. After each transaction the source sends a checkpoint
//! (file, end position, GTID state). Transactions that only wrote `outboxd_state` (the lease
//! keeper's own writes) move no checkpoint, so storing the position never causes another
//! write. A reconnect resumes from the last transaction boundary read, so nothing is read twice
//! except the transaction that was open.

pub mod admin;
pub(crate) mod assemble;
pub mod decode;
pub mod diagnostics;
pub mod file;
pub mod gtid;
pub mod hub;
pub(crate) mod identity;
pub mod log;
pub(crate) mod poll;
pub(crate) mod replicas;
pub mod rows;
pub(crate) mod snapshot;
pub(crate) mod startup;
pub mod takeover;
pub mod xa_pin;

use crate::backoff::Backoff;
// The MySQL client every module uses lives in `crate::db::mysql`; re-exported here for the
// source's own modules.
pub use crate::db::mysql::{classify, connect_sql, connect_state, server_code};
use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::source::assemble::{self as assemble_out, deliver};
use crate::source::{Outlet, SourceLink};
use crate::state::checkpoint::Checkpointer;
use crate::telemetry::events::{BinlogStreaming, InternalEvent, SourceKind, SourceReconnecting};
use crate::Error;
use assemble::{Assembler, Next};
use futures::StreamExt;
use gtid::{GtidState, MysqlGtidSet};
use mysql_async::binlog::events::Event;
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStreamRequest, Conn};
use rows::OutboxTable;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Everything the MySQL source needs to run.
#[derive(Debug, Clone)]
pub struct MySqlSourceConfig {
    pub dsn: DbDsn,
    pub name: String,
    /// The outbox tables (`--table`, one or more): one binlog stream serves them all.
    pub tables: Vec<OutboxTable>,
    /// The replica server id this relay registers with (unique per relay name).
    pub server_id: u32,
    /// How often the server sends a heartbeat while it has nothing else to send.
    pub heartbeat: Duration,
    /// No event and no heartbeat for this long: the connection is dead, reconnect.
    pub(crate) read_timeout: Duration,
    /// Largest transaction (bytes of outbox events) held until its commit; a larger one is
    /// scanned to its end first, then re-read and streamed.
    pub txn_buffer_bytes: usize,
    /// Largest uncompressed size a compressed transaction may declare
    /// (`--max-txn-payload-bytes`).
    pub max_payload_bytes: u64,
    /// Whether the server writes MariaDB GTIDs (then positions carry the GTID state and resume
    /// uses it).
    pub mariadb: bool,
    /// `--xa-prepare-limit`: how long a prepared XA transaction with outbox rows may hold the
    /// stored position back before `xa_prepare_expired` applies.
    pub xa_prepare_limit: Duration,
    /// `--xa-prepare-expired`: stop, or move the position past it.
    pub xa_prepare_expired: xa_pin::XaExpired,
    /// `--sync-replica`: replicas that must have applied a transaction before its events are
    /// published (see [`replicas`]).
    pub sync_replicas: Vec<DbDsn>,
}

/// The server id a relay of this name registers with: stable per name (a reconnect replaces
/// its own stale dump thread, as a replica does), far from the small ids servers use.
pub fn server_id_for(name: &str) -> u32 {
    // FNV-1a, 32 bit.
    let mut h: u32 = 0x811c_9dc5;
    for b in b"outboxd:".iter().chain(name.as_bytes()) {
        h ^= *b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    0x4000_0000 | (h & 0x3fff_ffff)
}

/// Where a stream starts: a transaction boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resume {
    pub file: String,
    pub pos: u64,
    /// MariaDB: the GTID state at that boundary (every domain).
    pub gtid: Option<GtidState>,
    /// MySQL: the executed GTID set at that boundary (for `COM_BINLOG_DUMP_GTID`).
    pub mysql_gtids: Option<MysqlGtidSet>,
    /// Open the stream by file and position even where a GTID state is known (the stored
    /// position had none, e.g. after `offset set` by position).
    pub by_position: bool,
}

impl Resume {
    pub(crate) fn from_checkpoint(cp: &Checkpoint) -> Option<Resume> {
        match cp {
            Checkpoint::Binlog {
                file,
                pos,
                gtid_state,
            } => Some(Resume {
                file: file.clone(),
                pos: *pos,
                gtid: gtid_state.as_deref().and_then(GtidState::parse),
                mysql_gtids: gtid_state
                    .as_deref()
                    .and_then(MysqlGtidSet::parse)
                    .filter(|s| !s.is_empty()),
                by_position: gtid_state.as_deref().is_none_or(str::is_empty),
            }),
            _ => None,
        }
    }

    /// Whether the stream opens by GTID: with a known state (MariaDB) or executed set
    /// (MySQL), unless told otherwise.
    pub(crate) fn by_gtid(&self, mariadb: bool) -> bool {
        !self.by_position
            && if mariadb {
                self.gtid.as_ref().is_some_and(|g| !g.is_empty())
            } else {
                self.mysql_gtids.as_ref().is_some_and(|g| !g.is_empty())
            }
    }

    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint::Binlog {
            file: self.file.clone(),
            pos: self.pos,
            gtid_state: self
                .gtid
                .as_ref()
                .filter(|g| !g.is_empty())
                .map(|g| g.to_string())
                .or_else(|| {
                    self.mysql_gtids
                        .as_ref()
                        .filter(|g| !g.is_empty())
                        .map(|g| g.to_string())
                }),
        }
    }

    /// A start at a MySQL binlog head (file, position and the executed GTID set there).
    pub(crate) fn from_mysql_head(head: admin::Head) -> Resume {
        Resume {
            mysql_gtids: MysqlGtidSet::parse(&head.gtid_executed).filter(|s| !s.is_empty()),
            file: head.file,
            pos: head.pos,
            gtid: None,
            by_position: false,
        }
    }
}

/// The server's current position as a place to start streaming (first start): the head of the
/// binlog and, on MariaDB, the GTID state exactly there.
pub(crate) async fn current_position(conn: &mut Conn, mariadb: bool) -> Result<Resume, Error> {
    if !mariadb {
        // MySQL: the new statement name first (8.2+), the old one where it is unknown.
        let flavour = admin::Flavour::MySql { major: 8, minor: 4 };
        return Ok(Resume::from_mysql_head(
            admin::head_status(conn, Some(flavour)).await?,
        ));
    }
    let (file, pos) = admin::head(conn).await?;
    let gtid = Some(admin::gtid_at(conn, &file, pos).await?);
    Ok(Resume {
        file,
        pos,
        gtid,
        mysql_gtids: None,
        by_position: false,
    })
}

/// Opens the dump stream at `from`: by GTID where the state has one, else by file/position.
/// With `verify` the server's binlog is checked against `from` first (a reconnect may reach a
/// server whose binlog started again, or another server behind the same address).
async fn open_stream(
    cfg: &MySqlSourceConfig,
    from: &Resume,
    verify: Option<Option<&Resume>>,
) -> Result<mysql_async::BinlogStream, Error> {
    let mut conn = connect_sql(&cfg.dsn).await?;
    if let Some(sent) = verify {
        // Another server behind the same address (a failover under a running relay). Its
        // coordinates may sort before the stored ones, which the forward-only store would
        // refuse: a new start stores the GTID state at this server's coordinates first.
        let another = |why: String| {
            Error::Other(format!(
                "the server at {}:{} is another one now (a failover or switchover): {why}. Start the relay again: its start resumes by GTID at this server's coordinates where the server holds the stored GTID state, and refuses otherwise",
                cfg.dsn.host, cfg.dsn.port
            ))
        };
        match admin::require_position(&mut conn, &cfg.name, from, cfg.mariadb, false).await {
            Ok(admin::Verdict::Streams) => {}
            Ok(admin::Verdict::ByGtid(why)) => return Err(another(why)),
            Ok(admin::Verdict::Lost(l)) => return Err(l.into_error(&cfg.name)),
            Err(lost @ Error::PositionLost { .. }) => {
                // What was read after the last checkpoint sent are transactions without outbox
                // events (the relay's own state writes among them): a server that lacks only
                // those lacks nothing the relay published.
                if let Some(sent) = sent.filter(|s| *s != from) {
                    if let Ok(v) =
                        admin::require_position(&mut conn, &cfg.name, sent, cfg.mariadb, false)
                            .await
                    {
                        let why = match v {
                            admin::Verdict::ByGtid(why) => why,
                            _ => format!(
                                "its binlog holds the last position the relay sent ({}:{})",
                                sent.file, sent.pos
                            ),
                        };
                        return Err(another(format!(
                            "{why}; it lacks only transactions without outbox events read after it"
                        )));
                    }
                }
                return Err(lost);
            }
            Err(e) => return Err(e),
        }
    }
    let setup = async {
        // MariaDB: send GTID events (not BEGIN/dummy queries).
        conn.query_drop("SET @mariadb_slave_capability = 4").await?;
        // Heartbeats while the server has nothing to send (nanoseconds).
        conn.query_drop(format!(
            "SET @master_heartbeat_period = {}",
            cfg.heartbeat.as_nanos()
        ))
        .await?;
        Ok::<_, mysql_async::Error>(())
    };
    setup.await?;
    let by_gtid = from.by_gtid(cfg.mariadb);
    let request = BinlogStreamRequest::new(cfg.server_id);
    let stream = if by_gtid && !cfg.mariadb {
        // MySQL: COM_BINLOG_DUMP_GTID with the executed set; the server sends every
        // transaction not in it (8.4 tagged GTIDs switch the request to the tagged format).
        let set = from.mysql_gtids.as_ref().expect("checked");
        conn.get_binlog_stream(
            request
                .with_gtid()
                .with_gtid_set(set.to_sids())
                .with_filename(b"")
                .with_pos(4u64),
        )
        .await
    } else if by_gtid {
        let state = from.gtid.as_ref().expect("checked").to_string();
        conn.exec_drop("SET @slave_connect_state = ?", (state,))
            .await?;
        conn.query_drop("SET @slave_gtid_strict_mode = 0").await?;
        conn.query_drop("SET @slave_gtid_ignore_duplicates = 0")
            .await?;
        conn.get_binlog_stream(request.with_filename(b"").with_pos(4u64))
            .await
    } else {
        conn.get_binlog_stream(
            request
                .with_filename(from.file.as_bytes())
                .with_pos(from.pos),
        )
        .await
    };
    stream.map_err(|e| stream_error(e, cfg))
}

/// An error of the dump stream: a purged or impossible position is a lost position.
fn stream_error(e: mysql_async::Error, cfg: &MySqlSourceConfig) -> Error {
    if server_code(&e) == Some(1236) {
        return Error::PositionLost {
            problem: format!("the server cannot send the binlog from the stored position: {e}"),
            fix: admin::lost_position_fix(&cfg.name),
        };
    }
    classify(e)
}

/// What a first start does before streaming.
#[derive(Debug)]
pub enum FirstStart {
    /// Not a first start.
    No,
    /// A first start with nothing to publish from the table.
    Empty,
    /// Publish the rows of this open snapshot (taken at the start position) first.
    Snapshot(snapshot::Snapshot),
}

/// Streams from `start` until `shutdown`, then stops at a transaction boundary. A first start
/// publishes its snapshot first and then acknowledges the start position, which tells the
/// lease keeper that the first start is done. Forwarded transactions' commit times go to
/// `checkpoints`, for a recovery through the table.
pub async fn run(
    cfg: MySqlSourceConfig,
    link: SourceLink,
    start: Resume,
    first: FirstStart,
    checkpoints: Checkpointer,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    run_with(cfg, link, start, first, checkpoints, shutdown, None).await
}

/// [`run`], reading through a shared binlog stream where `feed` is one ([`hub`]).
async fn run_with(
    cfg: MySqlSourceConfig,
    link: SourceLink,
    start: Resume,
    first: FirstStart,
    checkpoints: Checkpointer,
    shutdown: CancellationToken,
    feed: Option<hub::Feed>,
) -> Result<(), Error> {
    let SourceLink { outlet, .. } = link;
    if cfg.sync_replicas.is_empty() {
        return stream(cfg, outlet, start, first, checkpoints, shutdown, feed).await;
    }
    let start_gtid = match start.checkpoint() {
        Checkpoint::Binlog { gtid_state, .. } => gtid_state,
        _ => None,
    };
    let (outlet, gate) = replicas::gate(
        &cfg.sync_replicas,
        cfg.mariadb,
        start_gtid,
        outlet,
        shutdown.clone(),
    );
    let streamed = stream(cfg, outlet, start, first, checkpoints, shutdown, feed).await;
    // The gate's own failure (a replica refusing, no GTIDs) is why the source's sends failed.
    match gate.await {
        Ok(Err(e)) => Err(e),
        Err(e) => Err(Error::Other(format!("the --sync-replica gate failed: {e}"))),
        Ok(Ok(())) => streamed,
    }
}

async fn stream(
    cfg: MySqlSourceConfig,
    outlet: Outlet,
    start: Resume,
    first: FirstStart,
    checkpoints: Checkpointer,
    shutdown: CancellationToken,
    mut feed: Option<hub::Feed>,
) -> Result<(), Error> {
    match first {
        FirstStart::No => {}
        FirstStart::Empty => outlet.send_checkpoint(start.checkpoint()).await?,
        FirstStart::Snapshot(snap) => {
            snap.publish(&outlet).await?;
            outlet.send_checkpoint(start.checkpoint()).await?;
        }
    }
    // The last checkpoint sent: a transaction boundary whose transactions all went to the relay
    // (at first the start, which a first start sent above and a resume had stored).
    let mut sent: Option<Resume> = Some(start.clone());
    let mut asm = Assembler::new(cfg.tables.clone(), start, &cfg, Instant::now());
    let mut backoff = Backoff::standard();
    // What holds the stored position back (prepared XA transactions), looked at every second.
    let mut xa_tick = tokio::time::interval(Duration::from_secs(1));
    xa_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The start position was checked before the source started; every reopen after a break
    // checks again (not the re-read of a large transaction, which follows a read of the same
    // stream at once).
    let mut verify = false;
    'connect: loop {
        let check = std::mem::replace(&mut verify, true);
        let checked_against = check.then_some(sent.as_ref());
        let Some(mut stream) =
            open(&cfg, asm.resume(), checked_against, &mut backoff, &shutdown).await?
        else {
            break 'connect;
        };
        asm.restart();
        // The client library hands out the events of a compressed transaction again after
        // the payload event (it inflates it itself): those copies are checked and skipped.
        let mut copies = std::collections::VecDeque::<(u8, u32)>::new();
        // One deadline for the next event or heartbeat, kept across the loop's other wake-ups
        // (the XA watch's tick every second, a held checkpoint): a timeout made anew at each
        // turn would never run out on a stalled connection.
        let mut read_by = tokio::time::Instant::now() + cfg.read_timeout;
        loop {
            let flush_at = asm.flush_at().map(tokio::time::Instant::from_std);
            let item = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !asm.in_txn() => break 'connect,
                _ = xa_tick.tick() => {
                    let out = asm.xa_check(cfg.xa_prepare_limit, cfg.xa_prepare_expired, Instant::now())?;
                    if let Some(o) = out {
                        send(o, &mut sent, &outlet, &checkpoints).await?;
                    }
                    continue;
                }
                // A checkpoint held back by the rate limit goes out once the stream pauses.
                _ = tokio::time::sleep_until(flush_at.unwrap_or(read_by)), if flush_at.is_some() => {
                    if let Some(o) = asm.flush(Instant::now()) {
                        send(o, &mut sent, &outlet, &checkpoints).await?;
                    }
                    continue;
                }
                // `next()` keeps its partial read in the stream: dropping it is safe. The
                // library parses events (and unpacks compressed transactions) inside it, and
                // its parsers can panic on a corrupt event: that becomes an error here.
                r = tokio::time::timeout_at(
                    read_by,
                    futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(stream.next())),
                ) => r,
            };
            read_by = tokio::time::Instant::now() + cfg.read_timeout;
            let ev = match read(item, &cfg, asm.resume(), &mut backoff)? {
                Read::Event(ev) => ev,
                Read::Reconnect => continue 'connect,
                Read::Retry(d) => tokio::select! {
                    _ = tokio::time::sleep(d) => continue 'connect,
                    _ = shutdown.cancelled(), if !asm.in_txn() => break 'connect,
                },
            };
            backoff.reset();
            if handle(&ev, &mut asm, &mut copies, &mut sent, &outlet, &checkpoints).await?
                == Next::Reread
            {
                verify = false;
                continue 'connect;
            }
            // A tenant of a shared stream goes on with the hub's events once its own stream
            // reached (or passed) the boundary the hub queues them from.
            let Some(f) = feed.as_mut() else { continue };
            if !copies.is_empty() || asm.in_txn() || !f.ready(asm.resume(), Instant::now()) {
                continue;
            }
            drop(stream);
            let mut on = Shared {
                feed: f,
                asm: &mut asm,
                copies: &mut copies,
                sent: &mut sent,
                outlet: &outlet,
                checkpoints: &checkpoints,
            };
            if on.run(&cfg, &mut xa_tick, &shutdown).await? {
                break 'connect;
            }
            // Left the hub: reopens its own stream at its last boundary.
            continue 'connect;
        }
    }
    if let Some(o) = asm.finish(Instant::now()) {
        send(o, &mut sent, &outlet, &checkpoints).await?;
    }
    let at = asm.resume();
    tracing::info!(file = %at.file, pos = at.pos, "stopped at a transaction boundary");
    // Dropping the outlet closes the relay's input: it drains and ends.
    drop(outlet);
    Ok(())
}

/// A tenant reading the shared stream's events (see [`hub`]).
struct Shared<'a> {
    feed: &'a mut hub::Feed,
    asm: &'a mut Assembler,
    copies: &'a mut std::collections::VecDeque<(u8, u32)>,
    sent: &'a mut Option<Resume>,
    outlet: &'a Outlet,
    checkpoints: &'a Checkpointer,
}

impl Shared<'_> {
    /// Reads the hub's events until `shutdown` (true) or until the tenant leaves the hub
    /// (false: it reads on its own from its last boundary). The same loop as the tenant's own
    /// stream, without the read timeout: the hub keeps that of its connection, and a hub that
    /// stops ends the queue.
    async fn run(
        &mut self,
        cfg: &MySqlSourceConfig,
        xa_tick: &mut tokio::time::Interval,
        shutdown: &CancellationToken,
    ) -> Result<bool, Error> {
        loop {
            let flush_at = self.asm.flush_at().map(tokio::time::Instant::from_std);
            let here = hub::Mark::of(self.asm.resume());
            let in_txn = self.asm.in_txn();
            let ev = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !in_txn => return Ok(true),
                _ = xa_tick.tick() => {
                    let out = self.asm.xa_check(cfg.xa_prepare_limit, cfg.xa_prepare_expired, Instant::now())?;
                    if let Some(o) = out {
                        send(o, self.sent, self.outlet, self.checkpoints).await?;
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(flush_at.unwrap_or_else(tokio::time::Instant::now)), if flush_at.is_some() => {
                    if let Some(o) = self.asm.flush(Instant::now()) {
                        send(o, self.sent, self.outlet, self.checkpoints).await?;
                    }
                    continue;
                }
                ev = self.feed.recv(&here) => match ev {
                    Some(ev) => ev,
                    None => return Ok(false),
                },
            };
            let next = handle(
                &ev,
                self.asm,
                self.copies,
                self.sent,
                self.outlet,
                self.checkpoints,
            )
            .await?;
            if next == Next::Reread {
                // A transaction larger than the buffer is read twice: on the tenant's own
                // stream.
                self.feed.leave(Instant::now());
                return Ok(false);
            }
        }
    }
}

/// Opens the stream at `from`, retrying what can be retried; `None` when `shutdown` came
/// first.
async fn open(
    cfg: &MySqlSourceConfig,
    from: &Resume,
    verify: Option<Option<&Resume>>,
    backoff: &mut Backoff,
    shutdown: &CancellationToken,
) -> Result<Option<mysql_async::BinlogStream>, Error> {
    loop {
        if shutdown.is_cancelled() {
            return Ok(None);
        }
        let stream = tokio::select! {
            r = open_stream(cfg, from, verify) => r,
            _ = shutdown.cancelled() => return Ok(None),
        };
        match stream {
            Ok(s) => {
                BinlogStreaming {
                    file: &from.file,
                    pos: from.pos,
                    gtid: &from
                        .gtid
                        .as_ref()
                        .map(|g| g.to_string())
                        .unwrap_or_default(),
                    by: if from.by_gtid(cfg.mariadb) {
                        "gtid"
                    } else {
                        "position"
                    },
                    server_id: cfg.server_id,
                }
                .emit();
                return Ok(Some(s));
            }
            Err(e) if e.is_retryable() => {
                let d = backoff.next_delay();
                tracing::warn!(error = %e, retry_in = ?d, "binlog connect failed");
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = shutdown.cancelled() => return Ok(None),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// What one read of the stream gave.
enum Read {
    Event(Event),
    /// Open the stream again at once.
    Reconnect,
    /// Open it again after this delay.
    Retry(Duration),
}

type ReadResult = Result<
    Result<Option<Result<Event, mysql_async::Error>>, Box<dyn std::any::Any + Send>>,
    tokio::time::error::Elapsed,
>;

/// Sorts one read of the stream (under the read timeout, panics caught) into an event, a
/// reconnect, or an error that ends the relay.
fn read(
    item: ReadResult,
    cfg: &MySqlSourceConfig,
    at: &Resume,
    backoff: &mut Backoff,
) -> Result<Read, Error> {
    let (message, error, timeout, retry) = match item {
        Ok(Ok(Some(Ok(ev)))) => return Ok(Read::Event(ev)),
        Ok(Err(_)) => {
            return Err(Error::Decode(format!(
                "the binlog client library failed (panicked) on an event after {}:{}: the server sent an event it cannot parse",
                at.file, at.pos
            )))
        }
        Err(_) => ("no binlog event and no heartbeat in time: reconnecting", None, Some(cfg.read_timeout), None),
        Ok(Ok(None)) => ("the server ended the binlog stream: reconnecting", None, None, None),
        Ok(Ok(Some(Err(e)))) => {
            let err = stream_error(e, cfg);
            if !err.is_retryable() {
                return Err(err);
            }
            let d = backoff.next_delay();
            ("binlog stream broke; resuming from the last transaction boundary", Some(err), None, Some(d))
        }
    };
    SourceReconnecting {
        source: SourceKind::MySql,
        message,
        error: error.as_ref().map(|e| e as &dyn std::fmt::Display),
        timeout,
        retry_in: retry,
    }
    .emit();
    Ok(retry.map_or(Read::Reconnect, Read::Retry))
}

/// Hands one output on and notes the last checkpoint sent (what a reconnect to another server
/// is checked against besides the last boundary read, see [`open_stream`]).
async fn send(
    o: assemble_out::Output,
    sent: &mut Option<Resume>,
    outlet: &Outlet,
    checkpoints: &Checkpointer,
) -> Result<(), Error> {
    match &o {
        assemble_out::Output::Checkpoint(cp)
        | assemble_out::Output::Committed { checkpoint: cp, .. } => {
            if let Some(r) = Resume::from_checkpoint(cp) {
                *sent = Some(r);
            }
        }
        assemble_out::Output::Event(_) => {}
    }
    deliver(o, outlet, checkpoints).await
}

/// Decodes one event of the stream and hands on what the assembler makes of it. A compressed
/// transaction is fed one inner event at a time, so that the transaction buffer applies to its
/// rows as to any other's (and memory holds one event of it); the copies of those events the
/// client library sends after it are checked and skipped.
async fn handle(
    ev: &Event,
    asm: &mut Assembler,
    copies: &mut std::collections::VecDeque<(u8, u32)>,
    sent: &mut Option<Resume>,
    outlet: &Outlet,
    checkpoints: &Checkpointer,
) -> Result<Next, Error> {
    if let Some((kind, size)) = copies.pop_front() {
        let h = ev.header();
        if h.event_type_raw() == kind && h.event_size() == size {
            return Ok(Next::Read);
        }
        let (file, pos) = (asm.decoder().file().to_string(), asm.resume().pos);
        return Err(Error::Decode(format!(
            "after the compressed transaction before {file}:{pos}, the client library sent an event (type {}, {} bytes) that is not the next one of that transaction (type {kind}, {size} bytes)",
            h.event_type_raw(), h.event_size()
        )));
    }
    let mut inner = asm.decoder().payload_events(ev)?;
    let mut whole = Some(ev);
    let mut out = Vec::new();
    loop {
        let steps = match inner.as_mut() {
            None => match whole.take() {
                Some(e) => asm.decoder().feed(e)?,
                None => return Ok(Next::Read),
            },
            Some(p) => match p.next_event() {
                Ok(Some(e)) => {
                    copies.push_back((e.header().event_type_raw(), e.header().event_size()));
                    asm.decoder().feed_inner(&e, ev)?
                }
                Ok(None) => return Ok(Next::Read),
                Err(m) => return Err(asm.decoder().payload_err(decode::span(ev).0, m)),
            },
        };
        for step in steps {
            let next = asm.step(step, Instant::now(), &mut out)?;
            for o in out.drain(..) {
                send(o, sent, outlet, checkpoints).await?;
            }
            if next == Next::Reread {
                return Ok(next);
            }
        }
    }
}

#[cfg(test)]
mod tests;
