//! The MySQL/MariaDB source: the server's binlog dump stream read with `mysql_async` (feature
//! `binlog`), decoded by [`decode`] (shared with the binlog-file source), rows mapped by
//! [`rows`], MariaDB GTIDs by [`gtid`]; plain SQL with `mysql_async` too.
//!
//! What the library leaves to us: `@mariadb_slave_capability=4` so MariaDB sends GTID
//! events, raw GTID/GTID_LIST parsing, GTID resume through `@slave_connect_state`, the CRC32
//! bytes in the first (fake) Rotate's file name, heartbeats plus a read timeout on every read,
//! and reconnecting — the library has none.
//!
//! Position rule: an event's position is `file:end_pos:index` where `end_pos` ends its
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
pub mod decode;
pub mod diagnostics;
pub mod file;
pub mod gtid;
pub mod poll;
pub mod rows;
pub mod snapshot;
pub mod startup;
pub mod xa_pin;

use crate::backoff::Backoff;
// The MySQL client every module uses lives in `crate::db::mysql`; re-exported here for the
// source's own modules.
pub use crate::db::mysql::{classify, connect_sql, connect_state, server_code};
use crate::dsn::DbDsn;
use crate::event::{Checkpoint, OutboxEvent, SourcePosition};
use crate::source::SourceLink;
use crate::telemetry::events::{BinlogStreaming, InternalEvent, SourceKind, SourceReconnecting};
use crate::Error;
use decode::{row_index, Decoder, Step};
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
    pub read_timeout: Duration,
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
    pub fn from_checkpoint(cp: &Checkpoint) -> Option<Resume> {
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
    pub fn by_gtid(&self, mariadb: bool) -> bool {
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
    pub fn from_mysql_head(head: admin::Head) -> Resume {
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
pub async fn current_position(conn: &mut Conn, mariadb: bool) -> Result<Resume, Error> {
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
    verify: bool,
) -> Result<mysql_async::BinlogStream, Error> {
    let mut conn = connect_sql(&cfg.dsn).await?;
    if verify {
        admin::require_position(&mut conn, &cfg.name, from, cfg.mariadb, false).await?;
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

/// How the open transaction's rows are handled.
#[derive(Debug, PartialEq, Eq)]
enum Mode {
    /// Held until the commit (the end position is not known before).
    Buffer,
    /// The end position is known (from an earlier scan): sent as they come.
    Stream { end: u64 },
    /// Too large to hold: read to the end to learn the end position, then re-read.
    Scan,
}

struct Open {
    start_file: String,
    start_pos: u64,
    mode: Mode,
    buffered: Vec<OutboxEvent>,
    buffered_bytes: usize,
    /// Rows of this transaction already sent before a reconnect (streamed mode): skipped.
    skip: u32,
    seen: u32,
    /// The earliest `created_at` among its rows (for the commit-vs-created gap).
    min_created: Option<chrono::DateTime<chrono::Utc>>,
    /// The first statement that rolled back some of its rows (to a savepoint), in any mode:
    /// streaming it would send those rows before the rollback is read again, so a scan that
    /// ends with one set stops the relay instead.
    undone: Option<String>,
    /// Bytes of every outbox row read of it, undone ones included: what a buffer holding it
    /// whole needs at most.
    total_bytes: usize,
}

/// A streamed transaction that was cut off: where it starts and how many rows went out.
struct Partial {
    file: String,
    pos: u64,
    sent: u32,
}

/// How often a checkpoint for transactions without outbox events is sent at most.
const IDLE_CHECKPOINT_INTERVAL: Duration = Duration::from_millis(200);

/// When only the relay's own state writes follow the last checkpoint for this long, one of
/// them becomes a checkpoint anyway: on a quiet server the stored position would otherwise
/// stay behind until its binlog file is purged. One write per interval is no loop.
const OWN_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(300);

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
/// lease keeper that the first start is done.
pub async fn run(
    cfg: MySqlSourceConfig,
    link: SourceLink,
    start: Resume,
    first: FirstStart,
    checkpoints: crate::pipeline::checkpoint::Checkpointer,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let SourceLink { outlet, .. } = link;
    match first {
        FirstStart::No => {}
        FirstStart::Empty => outlet.send_checkpoint(start.checkpoint()).await?,
        FirstStart::Snapshot(snap) => {
            snap.publish(&outlet).await?;
            outlet.send_checkpoint(start.checkpoint()).await?;
        }
    }
    let mut resume = start;
    let mut backoff = Backoff::standard();
    // A transaction whose end position was learnt by scanning: (file, start, end).
    let mut known_end: Option<(String, u64, u64)> = None;
    let mut partial: Option<Partial> = None;
    let mut pending: Option<Checkpoint> = None;
    let mut last_sent = Instant::now();
    let mut dec = Decoder::new(cfg.tables.clone(), &resume.file, None)
        .with_limits(cfg.txn_buffer_bytes, cfg.max_payload_bytes);
    // What holds the stored position back (prepared XA transactions), looked at every second.
    let mut xa_watch = xa_pin::XaWatch::default();
    let mut xa_tick = tokio::time::interval(Duration::from_secs(1));
    xa_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    // The start position was checked before the source started; every reopen after a break
    // checks again (not the re-read of a large transaction, which follows a read of the same
    // stream at once).
    let mut verify = false;
    'connect: loop {
        if shutdown.is_cancelled() {
            break 'connect;
        }
        let check = std::mem::replace(&mut verify, true);
        let mut stream = tokio::select! {
            r = open_stream(&cfg, &resume, check) => match r {
                Ok(s) => s,
                Err(e) if e.is_retryable() => {
                    let d = backoff.next_delay();
                    tracing::warn!(error = %e, retry_in = ?d, "binlog connect failed");
                    tokio::select! {
                        _ = tokio::time::sleep(d) => continue 'connect,
                        _ = shutdown.cancelled() => break 'connect,
                    }
                }
                Err(e) => return Err(e),
            },
            _ = shutdown.cancelled() => break 'connect,
        };
        BinlogStreaming {
            file: &resume.file,
            pos: resume.pos,
            gtid: &resume
                .gtid
                .as_ref()
                .map(|g| g.to_string())
                .unwrap_or_default(),
            by: if resume.by_gtid(cfg.mariadb) {
                "gtid"
            } else {
                "position"
            },
            server_id: cfg.server_id,
        }
        .emit();
        // A new stream: the decoder keeps only the prepared XA transactions it holds.
        dec.restart(
            &resume.file,
            cfg.mariadb.then(|| resume.gtid.clone().unwrap_or_default()),
            if cfg.mariadb {
                None
            } else {
                resume.mysql_gtids.clone()
            },
        );
        let mut open: Option<Open> = None;
        // The client library hands out the events of a compressed transaction again after
        // the payload event (it inflates it itself): those copies are checked and skipped.
        let mut copies = std::collections::VecDeque::<(u8, u32)>::new();

        // One deadline for the next event or heartbeat, kept across the loop's other wake-ups
        // (acknowledgements, the XA watch's tick every second): a timeout made anew at each
        // turn would never run out on a stalled connection.
        let mut read_by = tokio::time::Instant::now() + cfg.read_timeout;
        loop {
            let flush_at = tokio::time::Instant::from_std(last_sent + IDLE_CHECKPOINT_INTERVAL);
            let item = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !dec.in_txn() => break 'connect,
                _ = xa_tick.tick() => {
                    if xa_watch.check(&mut dec, cfg.xa_prepare_limit, cfg.xa_prepare_expired)? {
                        // Prepares given up: the position read so far goes out now, no longer
                        // held before them (on a quiet server no commit would send it).
                        let cp = pending.take().unwrap_or_else(|| resume.checkpoint());
                        outlet.send_checkpoint(held(cp, &dec)).await?;
                        last_sent = Instant::now();
                    }
                    continue;
                }
                // A checkpoint held back by the rate limit goes out once the stream pauses.
                _ = tokio::time::sleep_until(flush_at), if pending.is_some() => {
                    outlet.send_checkpoint(held(pending.take().expect("checked"), &dec)).await?;
                    last_sent = Instant::now();
                    continue;
                }
                // `next()` keeps its partial read in the stream: dropping it is safe. The
                // library parses events (and unpacks compressed transactions) inside it, and
                // its parsers can panic on a corrupt event: that becomes an error here.
                r = tokio::time::timeout_at(
                    read_by,
                    futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(stream.next())),
                ) => match r {
                    Ok(Err(_)) => return Err(Error::Decode(format!(
                        "the binlog client library failed (panicked) on an event after {}:{}: the server sent an event it cannot parse",
                        resume.file, resume.pos
                    ))),
                    Ok(Ok(item)) => Ok(item),
                    Err(e) => Err(e),
                },
            };
            read_by = tokio::time::Instant::now() + cfg.read_timeout;
            let ev: Event = match item {
                Err(_) => {
                    SourceReconnecting {
                        source: SourceKind::MySql,
                        message: "no binlog event and no heartbeat in time: reconnecting",
                        error: None,
                        timeout: Some(cfg.read_timeout),
                        retry_in: None,
                    }
                    .emit();
                    continue 'connect;
                }
                Ok(None) => {
                    SourceReconnecting {
                        source: SourceKind::MySql,
                        message: "the server ended the binlog stream: reconnecting",
                        error: None,
                        timeout: None,
                        retry_in: None,
                    }
                    .emit();
                    continue 'connect;
                }
                Ok(Some(Err(e))) => {
                    let err = stream_error(e, &cfg);
                    if !err.is_retryable() {
                        return Err(err);
                    }
                    let d = backoff.next_delay();
                    SourceReconnecting {
                        source: SourceKind::MySql,
                        message: "binlog stream broke; resuming from the last transaction boundary",
                        error: Some(&err),
                        timeout: None,
                        retry_in: Some(d),
                    }
                    .emit();
                    tokio::select! {
                        _ = tokio::time::sleep(d) => continue 'connect,
                        _ = shutdown.cancelled(), if !dec.in_txn() => break 'connect,
                    }
                }
                Ok(Some(Ok(ev))) => ev,
            };
            backoff.reset();
            if let Some((kind, size)) = copies.pop_front() {
                let h = ev.header();
                if h.event_type_raw() == kind && h.event_size() == size {
                    continue;
                }
                return Err(Error::Decode(format!(
                    "after the compressed transaction before {}:{}, the client library sent an event (type {}, {} bytes) that is not the next one of that transaction (type {kind}, {size} bytes)",
                    dec.file(), resume.pos, h.event_type_raw(), h.event_size()
                )));
            }
            let mut inner = dec.payload_events(&ev)?;
            let mut whole = Some(&ev);
            loop {
                // One event at a time, also inside a compressed transaction, so that the
                // transaction buffer applies to its rows as to any other's.
                let steps = match inner.as_mut() {
                    None => match whole.take() {
                        Some(e) => dec.feed(e)?,
                        None => break,
                    },
                    Some(p) => match p.next_event() {
                        Ok(Some(e)) => {
                            copies
                                .push_back((e.header().event_type_raw(), e.header().event_size()));
                            dec.feed_inner(&e, &ev)?
                        }
                        Ok(None) => break,
                        Err(m) => return Err(dec.payload_err(decode::span(&ev).0, m)),
                    },
                };
                for step in steps {
                    match step {
                        Step::Nothing => {}
                        Step::Begin { file, pos } => {
                            let mode = match &known_end {
                                Some((f, s, end)) if *f == file && *s == pos => {
                                    Mode::Stream { end: *end }
                                }
                                _ => Mode::Buffer,
                            };
                            let skip = match &partial {
                                Some(p) if p.file == file && p.pos == pos => p.sent,
                                _ => 0,
                            };
                            open = Some(Open {
                                start_file: file,
                                start_pos: pos,
                                mode,
                                buffered: Vec::new(),
                                buffered_bytes: 0,
                                skip,
                                seen: 0,
                                min_created: None,
                                undone: None,
                                total_bytes: 0,
                            });
                        }
                        Step::Rows(events) => {
                            let Some(o) = open.as_mut() else {
                                return Err(Error::Decode("rows outside a transaction".into()));
                            };
                            for mut event in events {
                                o.seen += 1;
                                o.min_created = Some(
                                    o.min_created
                                        .map_or(event.created_at, |m| m.min(event.created_at)),
                                );
                                o.total_bytes += event.size();
                                match o.mode {
                                    Mode::Buffer => {
                                        o.buffered_bytes += event.size();
                                        o.buffered.push(event);
                                        if o.buffered_bytes > cfg.txn_buffer_bytes {
                                            tracing::info!(
                                                file = %o.start_file, pos = o.start_pos, bytes = o.buffered_bytes,
                                                "a transaction larger than the buffer: reading to its end, then streaming it from its start"
                                            );
                                            o.buffered = Vec::new();
                                            o.mode = Mode::Scan;
                                        }
                                    }
                                    Mode::Stream { end } => {
                                        if o.seen <= o.skip {
                                            continue;
                                        }
                                        set_end(&mut event, end);
                                        outlet.send_event(event).await?;
                                        partial = Some(Partial {
                                            file: o.start_file.clone(),
                                            pos: o.start_pos,
                                            sent: o.seen,
                                        });
                                    }
                                    Mode::Scan => {}
                                }
                            }
                        }
                        Step::Undo { keep, what } => {
                            let Some(o) = open.as_mut() else { continue };
                            o.undone.get_or_insert(what.clone());
                            match o.mode {
                                Mode::Buffer => {
                                    o.buffered.retain(|e| row_index(e) < keep);
                                    o.buffered_bytes =
                                        o.buffered.iter().map(OutboxEvent::size).sum();
                                    o.min_created = o.buffered.iter().map(|e| e.created_at).min();
                                    o.seen = o.buffered.len() as u32;
                                }
                                Mode::Scan if keep == 0 => {
                                    // All of it undone and nothing of it sent: what follows
                                    // is held again. (Should it outgrow the buffer again,
                                    // its scan ends in the error: `undone` stays set.)
                                    o.mode = Mode::Buffer;
                                    o.buffered_bytes = 0;
                                    o.min_created = None;
                                    o.seen = 0;
                                }
                                Mode::Scan => {
                                    // Nothing sent yet: read on to learn its whole size for
                                    // the fix, then stop at its end.
                                }
                                Mode::Stream { .. } => {
                                    // Every row this stream read of it went out (or went out
                                    // before a reconnect): the undone ones among them.
                                    return Err(undone_in_stream(
                                        o,
                                        &what,
                                        cfg.txn_buffer_bytes,
                                        true,
                                    ));
                                }
                            }
                        }
                        Step::Abort { .. } => {
                            open = None;
                        }
                        Step::Commit {
                            start_file,
                            start_pos,
                            checkpoint,
                            own,
                            committed_at,
                        } => {
                            let o = open.take();
                            let Checkpoint::Binlog { pos: end, .. } = &checkpoint else {
                                unreachable!("binlog checkpoints only")
                            };
                            let end = *end;
                            let mut had_events = false;
                            let o_min_created = o.as_ref().and_then(|o| o.min_created);
                            if let Some(o) = o {
                                match o.mode {
                                    Mode::Scan => {
                                        if let Some(what) = &o.undone {
                                            return Err(undone_in_stream(
                                                &o,
                                                what,
                                                cfg.txn_buffer_bytes,
                                                false,
                                            ));
                                        }
                                        known_end = Some((start_file, start_pos, end));
                                        tracing::info!(end, "end of the large transaction found; re-reading it from its start");
                                        verify = false;
                                        continue 'connect;
                                    }
                                    Mode::Stream { .. } => {
                                        had_events = o.seen > 0;
                                        known_end = None;
                                        partial = None;
                                    }
                                    Mode::Buffer => {
                                        had_events = !o.buffered.is_empty();
                                        for mut event in
                                            o.buffered.into_iter().skip(o.skip as usize)
                                        {
                                            set_end(&mut event, end);
                                            outlet.send_event(event).await?;
                                        }
                                        partial = None;
                                    }
                                }
                            }
                            resume = Resume {
                                file: dec.file().to_string(),
                                pos: end,
                                gtid: dec.gtid_state().cloned(),
                                mysql_gtids: dec.mysql_gtids().cloned(),
                                by_position: resume.by_position,
                            };
                            if had_events {
                                if let Some(at) = committed_at {
                                    if let Some(created) = o_min_created {
                                        // Whole seconds: the commit may be up to 1 s later.
                                        checkpoints
                                            .observe(at + chrono::Duration::seconds(1), created);
                                    }
                                }
                                checkpoints.forwarded(&checkpoint, committed_at);
                                outlet.send_checkpoint(held(checkpoint, &dec)).await?;
                                pending = None;
                                last_sent = Instant::now();
                            } else if !own {
                                pending = Some(checkpoint);
                                if last_sent.elapsed() >= IDLE_CHECKPOINT_INTERVAL {
                                    outlet
                                        .send_checkpoint(held(pending.take().expect("set"), &dec))
                                        .await?;
                                    last_sent = Instant::now();
                                }
                            } else if pending.is_none()
                                && last_sent.elapsed() >= OWN_CHECKPOINT_INTERVAL
                            {
                                outlet.send_checkpoint(held(checkpoint, &dec)).await?;
                                last_sent = Instant::now();
                            }
                        }
                        Step::Heartbeat => {
                            if let Some(cp) = pending.take() {
                                outlet.send_checkpoint(held(cp, &dec)).await?;
                                last_sent = Instant::now();
                            }
                        }
                    }
                }
            }
        }
    }
    if let Some(cp) = pending.take() {
        outlet.send_checkpoint(held(cp, &dec)).await?;
    }
    for p in dec.pins() {
        // The next start reads everything since this prepare again: said at the level that
        // gets read.
        tracing::warn!(xid = %p.xid, prepared_at = %p.prepared_at.to_rfc3339(), held_at = %p.floor, rows = p.rows, "an XA transaction is prepared but not committed: the stored position stays before its prepare, so the next start reads it again and publishes again everything committed since (end it: XA COMMIT {0}; or XA ROLLBACK {0};)", p.xid);
    }
    tracing::info!(file = %resume.file, pos = resume.pos, "stopped at a transaction boundary");
    // Dropping the outlet closes the relay's input: it drains and ends.
    drop(outlet);
    Ok(())
}

/// The checkpoint to send instead of `cp` while an XA transaction is prepared and its outcome
/// not read: the position before its prepare. Its rows live only in this process until its
/// XA COMMIT; a stored position past the prepare would lose them on a restart. Holding the
/// position there means a restart reads the transactions after the prepare again (duplicates,
/// never a loss).
fn held(cp: Checkpoint, dec: &Decoder) -> Checkpoint {
    match dec.held_checkpoint() {
        Some(floor) => floor.clone(),
        None => cp,
    }
}

/// A transaction too large for `--txn-buffer` (so streamed, not held to its commit) rolled
/// back some of its outbox rows inside its group. `sent`: rows of it already went to the sink.
fn undone_in_stream(o: &Open, what: &str, limit: usize, sent: bool) -> Error {
    let bytes = o.total_bytes.max(limit + 1);
    Error::config(
        format!(
            "the transaction at {}:{} has more outbox rows than --txn-buffer holds ({} bytes of them, the limit is {limit}), so the relay streams it \
             instead of holding it until its commit, and {what} rolls back some of them; {}",
            o.start_file,
            o.start_pos,
            o.total_bytes,
            if sent {
                "rows of it were handed to the sink before the rollback was read and may have been published \
                 (the stored position stays before this transaction)"
            } else {
                "nothing of it was published: the relay stops rather than publish rows that were rolled back"
            }
        ),
        format!(
            "raise --txn-buffer above {bytes} bytes (e.g. --txn-buffer {}) so that the transaction is held until its commit and only the rows it kept are published; then start the relay again",
            bytes.next_power_of_two()
        ),
    )
}

fn set_end(event: &mut OutboxEvent, end: u64) {
    if let SourcePosition::Binlog { end_pos, .. } = &mut event.position {
        *end_pos = end;
    }
}

#[cfg(test)]
mod tests;
