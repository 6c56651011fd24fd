//! The Postgres source: a logical replication slot with the pgoutput plugin and a publication
//! on the outbox tables only (`publish = 'insert'`, through the partition root for partitioned
//! ones), read with `pgwire-replication`, decoded by our own [`pgoutput`] module, plain SQL with
//! `tokio-postgres`. Several `--table`s share the one slot and its commit order.
//!
//! Position rule: the slot is confirmed only up to the end LSN of a transaction whose every
//! event the sink made durable (or, when idle, the `wal_end` of a keepalive that came after
//! them), and only once the state row holds it (`state::checkpoint::slot_confirm`). A
//! reconnect resumes from the slot; the transaction assembler ([`assemble`]) skips what the
//! server sends again, so a dropped connection adds neither gaps nor duplicates. `run` is the
//! I/O around it: connect, read, deliver, confirm.

pub mod admin;
pub(crate) mod assemble;
pub mod diagnostics;
pub mod log;
pub mod pgoutput;
pub mod poll;
pub(crate) mod rows;
pub mod snapshot;
pub(crate) mod startup;
pub mod takeover;
pub mod tls_bridge;
pub mod version;

use crate::backoff::Backoff;
// The Postgres client every module uses lives in `crate::db::postgres`; re-exported here for
// the source's own modules.
pub use crate::db::postgres::{
    connect_sql, describe_pg_error, is_retryable_pg, is_server_stopping,
};
pub(crate) use crate::db::postgres::{sql_config, tls_connect_error};
use crate::dsn::{DbDsn, TlsMode};
use crate::event::{format_lsn, Checkpoint};
use crate::outbox::{ColumnMap, TableName};
use crate::source::assemble::{deliver, Output};
use crate::source::{Outlet, SourceLink};
use crate::state::checkpoint::{Checkpointer, Upstream};
use crate::telemetry::events::{
    InternalEvent, PgStreaming, RowRead, SourceKind, SourceLag, SourceReconnecting,
};
use crate::{Error, ErrorKind, ServerCode};
use assemble::{Assembler, Input};
use pgwire_replication::{
    Lsn, PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent, TlsConfig,
};
use rows::RowMapper;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Everything the Postgres source needs to run.
#[derive(Debug, Clone)]
pub struct PgSourceConfig {
    pub dsn: DbDsn,
    pub name: String,
    /// The outbox tables (`--table`, one or more): one slot and one publication serve them.
    pub tables: Vec<TableName>,
    pub columns: ColumnMap,
    pub slot: String,
    pub publication: String,
    /// How often the applied position is reported to the server at most.
    pub(crate) status_interval: Duration,
    /// Existing rows to publish before streaming (first start, or a requested replay), per
    /// table.
    pub snapshot: Vec<(TableName, snapshot::SnapshotPlan)>,
    /// How far an interrupted run got through that snapshot.
    pub(crate) snapshot_after: Option<snapshot::SnapshotKey>,
    /// Largest replication message accepted ([`wire_message_limit`] of `--max-message-bytes`).
    pub max_wire_message_bytes: usize,
}

/// Room for a row's other columns and the protocol's own bytes beside the payload.
const WIRE_OVERHEAD: usize = 1024 * 1024;

/// The largest replication message the reader accepts for `--max-message-bytes`
/// `max_message_bytes`: the row travels as text, where a `bytea` payload takes two hex digits
/// per byte, so twice the largest message the sink publishes plus room for the other columns.
/// A row up to that size still arrives and is dead-lettered as too large to publish; a larger
/// one is refused before the reader buffers it.
pub fn wire_message_limit(max_message_bytes: usize) -> usize {
    max_message_bytes
        .saturating_mul(2)
        .saturating_add(WIRE_OVERHEAD)
}

/// Starts the replication stream. With TLS (any `sslmode` but `disable`, over TCP) the
/// connection is made and verified here and handed to pgwire-replication through a private
/// Unix socket (see [`tls_bridge`]); Unix-socket hosts never use TLS, as in libpq.
async fn connect_replication(
    cfg: &PgSourceConfig,
    start: u64,
    confirmed: u64,
) -> Result<ReplicationClient, Error> {
    let via = if cfg.dsn.tls.mode == TlsMode::Disable || cfg.dsn.host.starts_with('/') {
        None
    } else {
        let upstream = tls_bridge::connect(&cfg.dsn).await?;
        Some(tls_bridge::serve(upstream, cfg.dsn.port)?)
    };
    ReplicationClient::connect(replication_config(cfg, start, confirmed, via))
        .await
        .map_err(|e| wire_error(e, &cfg.slot, &cfg.name))
}

/// How long the replication stream may be silent before the relay sends a status update
/// anyway (see [`replication_config`]).
pub(crate) const IDLE_WAKEUP: Duration = Duration::from_secs(10);

/// Replication messages the library may hold decoded before the relay takes them: memory is
/// bounded by `--max-inflight-bytes` plus this many rows.
pub(crate) const REPLICATION_BUFFER_EVENTS: usize = 32;

/// The pgwire-replication settings: stream from `start`, confirming `confirmed` until told
/// more; `via` is the socket directory of a TLS bridge, which then replaces the host
/// (pgwire-replication itself always speaks plain protocol).
fn replication_config(
    cfg: &PgSourceConfig,
    start: u64,
    confirmed: u64,
    via: Option<String>,
) -> ReplicationConfig {
    ReplicationConfig::new(
        via.unwrap_or_else(|| cfg.dsn.host.clone()),
        cfg.dsn.user.clone(),
        cfg.dsn.password.clone().unwrap_or_default(),
        cfg.dsn.database.clone(),
        cfg.slot.clone(),
        cfg.publication.clone(),
    )
    .with_port(cfg.dsn.port)
    .with_tls(TlsConfig::disabled())
    .with_start_lsn(Lsn::from_u64(start))
    // Report exactly what is durable and stored until the relay says more.
    .with_ack_lsn(Lsn::from_u64(confirmed))
    .with_status_interval(cfg.status_interval)
    // A status update when the stream has been silent this long. Nothing needs it sooner: a
    // newer position goes out within the status interval, a keepalive that asks for a reply
    // is answered at once (the server asks at half its `wal_sender_timeout`), and an idle
    // stream is not silent anyway (the lease's renewals write WAL every second, and the
    // walsender reports each). At one second it only woke the relay and its walsender.
    .with_wakeup_interval(IDLE_WAKEUP)
    // Few decoded messages wait in the library: our byte budget (`--max-inflight-bytes`)
    // starts after them, so with large rows its queue alone could hold many megabytes.
    .with_buffer_size(REPLICATION_BUFFER_EVENTS)
    // A message is buffered whole at the length the server announces: bound it before that.
    .with_max_message_size(cfg.max_wire_message_bytes)
    // Timestamps are parsed with their offset, but pinning the style keeps the text format
    // one we parse, whatever the server's defaults.
    .with_options("-c datestyle=ISO -c timezone=UTC -c intervalstyle=postgres")
    .with_application_name(format!("outboxd_{}", cfg.name))
}

fn wire_error(e: PgWireError, slot: &str, name: &str) -> Error {
    let text = e.to_string();
    let code = match &e {
        PgWireError::Server(m) => server_sqlstate(m),
        _ => None,
    };
    // undefined_object, said of the slot (a missing publication has the same code).
    if code == Some("42704") && text.contains("replication slot") {
        return Error::PositionLost {
            problem: format!("replication slot {slot:?} does not exist: {text}"),
            fix: format!(
                "the events since the last stored position may be gone from the WAL. To start over from now: \
                 `outboxd teardown --name {name} --yes`, then `outboxd run --snapshot since=<time of the last delivered event> ...`"
            ),
        };
    }
    if let PgWireError::MessageTooLarge {
        payload_bytes,
        limit_bytes,
    } = &e
    {
        let need = payload_bytes.saturating_sub(WIRE_OVERHEAD).div_ceil(2);
        return Error::config(
            format!(
                "the replication stream sent a message of {payload_bytes} bytes, more than the reader accepts ({limit_bytes}: twice --max-message-bytes plus 1 MiB): a row of the publication's tables is that large"
            ),
            format!(
                "raise --max-message-bytes to at least {need} bytes (e.g. --max-message-bytes {}MiB); the relay reads the row then, and publishes it or dead-letters it as larger than the limit",
                need.div_ceil(1024 * 1024).max(1)
            ),
        );
    }
    // pgwire-replication words a server error as text: its SQLSTATE is read once, here, and
    // kept as data on the error.
    let kind = match (&e, code) {
        (PgWireError::Io(_) | PgWireError::Task(_), _) => ErrorKind::Connection,
        (PgWireError::Server(_), Some(code)) => ErrorKind::of_sqlstate(code),
        (PgWireError::Protocol(m), _) if m.contains("EOF") || m.contains("closed") => {
            ErrorKind::Connection
        }
        _ => ErrorKind::Permanent,
    };
    Error::server(
        format!("replication stream: {text}"),
        kind,
        code.map(ServerCode::sqlstate),
    )
}

/// The SQLSTATE of a server error as pgwire-replication words it: `<message> (SQLSTATE
/// XXXXX)`, the code last. Only that position counts: digits elsewhere in the message (a
/// slot, table or host name, an LSN) are not a code.
fn server_sqlstate(message: &str) -> Option<&str> {
    let rest = message.strip_suffix(')')?;
    let at = rest.rfind("(SQLSTATE ")?;
    let code = &rest[at + "(SQLSTATE ".len()..];
    (code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric())).then_some(code)
}

/// Streams from the slot until `shutdown`, then stops at a transaction boundary, waits for the
/// relay to confirm everything, and makes sure the final position reached the server.
///
/// The slot is confirmed only as far as `checkpoints` allows (what the state row holds, see
/// [`crate::state::checkpoint::slot_confirm`]), so a slot found ahead of that was moved by
/// something else (it was dropped and created again) and is reported as a lost position,
/// never streamed from.
pub async fn run(
    cfg: PgSourceConfig,
    link: SourceLink,
    start: u64,
    checkpoints: Checkpointer,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let SourceLink { outlet, mut acks } = link;
    publish_snapshot(&cfg, start, &outlet).await?;
    let mut asm = Assembler::new(RowMapper::for_tables(
        cfg.tables.clone(),
        cfg.columns.clone(),
    ));
    let mut upstream = checkpoints.upstream();
    let mut acked: u64 = start;
    // The highest position ever confirmed to the server by this process.
    let mut reported: u64 = upstream.borrow_and_update().confirm;
    let mut backoff = Backoff::standard();
    let mut catch_up = crate::progress::CatchUp::new("WAL");
    'connect: loop {
        reported = reported.max(upstream.borrow_and_update().confirm);
        let Some(mut client) = open(&cfg, acked, reported, &mut backoff, &shutdown).await? else {
            return Ok(());
        };
        let streaming_since = Instant::now();
        PgStreaming {
            slot: &cfg.slot,
            from: &format_lsn(acked),
        }
        .emit();
        asm.restart();
        loop {
            tokio::select! {
                biased;
                changed = acks.changed() => {
                    if changed.is_err() {
                        // The relay ended before we stopped: it failed, and says why.
                        client.abort();
                        return Ok(());
                    }
                    if let Some(Checkpoint::Lsn(l)) = *acks.borrow_and_update() {
                        acked = acked.max(l);
                    }
                }
                _ = upstream.changed() => {
                    let up = *upstream.borrow_and_update();
                    confirm(&client, up.confirm, &mut reported);
                    // Only a shutdown seen while this stream ran: an older one is over.
                    if up.server_stopping.is_some_and(|at| at > streaming_since) {
                        // The slot cannot be confirmed up to the server's shutdown checkpoint
                        // any more (it cannot be stored): closing the stream lets it stop; the
                        // slot keeps the last stored position.
                        client.abort();
                        let d = backoff.next_delay();
                        reconnecting("the server is shutting down: closed the replication stream so that it can; resuming from the slot", None, Some(d));
                        tokio::time::sleep(d).await;
                        continue 'connect;
                    }
                }
                _ = shutdown.cancelled(), if !asm.in_txn() => {
                    tracing::info!("stopping at a transaction boundary");
                    // Closing the channel tells the relay that no more events come.
                    drop(outlet);
                    drain_and_confirm(&mut client, &mut acks, &mut upstream, &mut acked, &mut reported).await;
                    return Ok(());
                }
                ev = client.recv() => {
                    let ev = match ev {
                        Ok(Some(ev)) => ev,
                        Ok(None) => {
                            let err = Error::source("replication stream ended", true);
                            reconnecting("reconnecting", Some(&err), None);
                            continue 'connect;
                        }
                        Err(e) => {
                            let err = wire_error(e, &cfg.slot, &cfg.name);
                            if !err.is_retryable() {
                                return Err(err);
                            }
                            let d = backoff.next_delay();
                            reconnecting("replication stream broke; resuming from the slot", Some(&err), Some(d));
                            tokio::time::sleep(d).await;
                            continue 'connect;
                        }
                    };
                    backoff.reset();
                    let read = (Instant::now(), chrono::Utc::now());
                    let sent = match &ev {
                        ReplicationEvent::XLogData { server_time_micros, .. } => rows::pg_time(*server_time_micros),
                        _ => None,
                    };
                    let Some(input) = input_of(ev, acked, &mut catch_up)? else { continue };
                    if let Some(mut out) = asm.feed(input, acked)? {
                        if let Output::Event(event) = &mut out {
                            event.read_at = Some(read.0);
                            RowRead { committed: event.committed_at, sent, read: read.1 }.emit();
                        }
                        deliver(out, &outlet, &checkpoints).await?;
                    }
                }
            }
        }
    }
}

/// A first start's (or a requested replay's) existing rows, before streaming. Acknowledging
/// the start position after them means every snapshot row is durable: the lease keeper then
/// marks the first start done.
async fn publish_snapshot(cfg: &PgSourceConfig, start: u64, outlet: &Outlet) -> Result<(), Error> {
    if cfg
        .snapshot
        .iter()
        .all(|(_, p)| *p == snapshot::SnapshotPlan::Nothing)
    {
        return Ok(());
    }
    let mut sql = connect_sql(&cfg.dsn, &format!("outboxd_{}_snapshot", cfg.name)).await?;
    // Numbered on from the last durable row, as in the life that published it.
    let mut sent = snapshot::SnapshotKey::next_index(cfg.snapshot_after.as_ref());
    for (i, (table, plan)) in cfg.snapshot.iter().enumerate() {
        let Some(resume) = snapshot::SnapshotKey::applies(cfg.snapshot_after.as_ref(), i) else {
            continue;
        };
        sent += snapshot::publish(
            &mut sql,
            &cfg.tables,
            table,
            &cfg.columns,
            plan,
            (start, sent),
            outlet,
            (i, cfg.snapshot_after.as_ref().filter(|_| resume)),
        )
        .await?;
    }
    outlet.send_checkpoint(Checkpoint::Lsn(start)).await
}

/// Connects and starts streaming from `acked` with the slot confirmed to `reported`, retrying
/// what can be retried; `None` when `shutdown` came first.
async fn open(
    cfg: &PgSourceConfig,
    acked: u64,
    reported: u64,
    backoff: &mut Backoff,
    shutdown: &CancellationToken,
) -> Result<Option<ReplicationClient>, Error> {
    loop {
        let (err, what) = match connect_replication(cfg, acked, reported).await {
            Err(err) => (err, "replication connect failed"),
            Ok(mut client) => {
                let started = tokio::select! {
                    r = client.wait_started() => r,
                    _ = shutdown.cancelled() => {
                        client.abort();
                        return Ok(None);
                    }
                };
                match started {
                    Err(e) => (
                        wire_error(e, &cfg.slot, &cfg.name),
                        "replication start refused; retrying",
                    ),
                    // Now that our walsender holds the slot nobody can swap it: check that it
                    // is still the one we confirmed to (it may have been dropped and created
                    // again meanwhile).
                    Ok(()) => match slot_is_ours(cfg, reported).await {
                        Ok(()) => return Ok(Some(client)),
                        Err(err) => {
                            client.abort();
                            (err, "could not check the slot; reconnecting")
                        }
                    },
                }
            }
        };
        if !err.is_retryable() {
            return Err(err);
        }
        let d = backoff.next_delay();
        tracing::warn!(error = %err, retry_in = ?d, "{what}");
        tokio::time::sleep(d).await;
    }
}

/// The assembler's input for one message of the stream (`None`: nothing for it); a keepalive
/// also reports how far behind the acknowledged position the server's WAL is. Both tell
/// `catch_up` how far behind the server's end the stream is.
fn input_of(
    ev: ReplicationEvent,
    acked: u64,
    catch_up: &mut crate::progress::CatchUp,
) -> Result<Option<Input>, Error> {
    Ok(Some(match ev {
        ReplicationEvent::Begin {
            final_lsn,
            commit_time_micros,
            ..
        } => Input::Begin {
            final_lsn: final_lsn.as_u64(),
            commit_time_micros,
        },
        ReplicationEvent::XLogData {
            data,
            wal_start,
            wal_end,
            ..
        } => {
            catch_up.behind(wal_end.as_u64().saturating_sub(wal_start.as_u64()));
            Input::Message(pgoutput::decode(data).map_err(|e| Error::Decode(e.to_string()))?)
        }
        ReplicationEvent::Commit { end_lsn, .. } => Input::Commit {
            end_lsn: end_lsn.as_u64(),
        },
        ReplicationEvent::KeepAlive { wal_end, .. } => {
            let wal_end = wal_end.as_u64();
            SourceLag {
                bytes: wal_end.saturating_sub(acked),
            }
            .emit();
            catch_up.behind(wal_end.saturating_sub(acked));
            Input::KeepAlive {
                wal_end,
                at: Instant::now(),
            }
        }
        ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => return Ok(None),
    }))
}

fn reconnecting(message: &'static str, error: Option<&Error>, retry_in: Option<Duration>) {
    SourceReconnecting {
        source: SourceKind::Postgres,
        message,
        error: error.map(|e| e as &dyn std::fmt::Display),
        timeout: None,
        retry_in,
    }
    .emit();
}

/// Tells the server the slot may move to `to`, if that is further than before.
fn confirm(client: &ReplicationClient, to: u64, reported: &mut u64) {
    if to > *reported {
        *reported = to;
        client.update_applied_lsn(Lsn::from_u64(to));
        tracing::debug!(position = %format_lsn(to), "durable and stored; confirming to the server");
    }
}

/// Fails with a lost position when the slot confirms more than this process ever reported:
/// it is not the slot we streamed from.
async fn slot_is_ours(cfg: &PgSourceConfig, reported: u64) -> Result<(), Error> {
    let sql = connect_sql(&cfg.dsn, &format!("outboxd_{}", cfg.name)).await?;
    let Some(info) = admin::slot(&sql, &cfg.slot).await? else {
        return Ok(());
    };
    match info.confirmed_flush_lsn {
        Some(c) if c > reported => Err(Error::PositionLost {
            problem: format!(
                "replication slot {:?} confirms {} but this relay never confirmed past {}: it was dropped and created again \
                 while the stream was down, so the events between those positions were never relayed",
                cfg.slot,
                format_lsn(c),
                format_lsn(reported)
            ),
            fix: admin::lost_slot_fix(&cfg.name, &cfg.slot),
        }),
        _ => Ok(()),
    }
}

/// After the last event was handed over: take every acknowledgement until the relay ends, then
/// make sure the final one reached the server before the stream closes (the library sends no
/// final status update on stop).
async fn drain_and_confirm(
    client: &mut ReplicationClient,
    acks: &mut tokio::sync::watch::Receiver<Option<Checkpoint>>,
    upstream: &mut tokio::sync::watch::Receiver<Upstream>,
    acked: &mut u64,
    reported: &mut u64,
) {
    loop {
        let changed = acks.changed().await;
        if let Some(Checkpoint::Lsn(l)) = *acks.borrow_and_update() {
            *acked = (*acked).max(l);
        }
        confirm(client, upstream.borrow().confirm, reported);
        if changed.is_err() {
            break;
        }
    }
    let metrics = client.metrics();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics.last_applied_lsn().as_u64() < *acked && Instant::now() < deadline {
        // The lease keeper stores the final position on its next renewal; only then may the
        // slot have it.
        confirm(client, upstream.borrow().confirm, reported);
        // Keep the stream's events flowing so the worker is not blocked on a full channel.
        let _ = tokio::time::timeout(Duration::from_millis(50), client.recv()).await;
    }
    if metrics.last_applied_lsn().as_u64() < *acked {
        tracing::warn!(
            acked = %format_lsn(*acked),
            reported = %format_lsn(metrics.last_applied_lsn().as_u64()),
            "the final position did not reach the server in time: the last transactions will be delivered again"
        );
    } else {
        tracing::info!(position = %format_lsn(*acked), "final position confirmed to the server");
    }
    client.stop();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(Some(_)) = client.recv().await {}
    })
    .await;
}

#[cfg(test)]
mod tests;
