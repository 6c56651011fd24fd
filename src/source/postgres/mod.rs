//! The Postgres source: a logical replication slot with the pgoutput plugin and a publication
//! on the outbox tables only (`publish = 'insert'`, through the partition root for partitioned
//! ones), read with `pgwire-replication`, decoded by our own [`pgoutput`] module, plain SQL with
//! `tokio-postgres`. Several `--table`s share the one slot and its commit order.
//!
//! Position rule: the slot is confirmed only up to the end LSN of a transaction whose every
//! event the sink made durable (or, when idle, the `wal_end` of a keepalive that came after
//! them). A reconnect resumes from the slot and skips transactions this process already
//! forwarded, and the events of a transaction it was forwarding when the stream broke that
//! were already handed over (same commit LSN and index: the server sends the transaction again
//! from its start), so a dropped connection adds neither gaps nor duplicates.

pub mod admin;
pub mod diagnostics;
pub mod pgoutput;
pub mod poll;
pub mod rows;
pub mod snapshot;
pub mod startup;
pub mod tls_bridge;
pub mod version;

use crate::backoff::Backoff;
// The Postgres client every module uses lives in `crate::db::postgres`; re-exported here for
// the source's own modules.
pub(crate) use crate::db::postgres::retryable_sqlstate;
pub use crate::db::postgres::{
    connect_sql, describe_pg_error, is_retryable_pg, is_server_stopping,
};
pub(crate) use crate::db::postgres::{sql_config, tls_connect_error};
use crate::dsn::{DbDsn, TlsMode};
use crate::event::{format_lsn, Checkpoint};
use crate::outbox::{ColumnMap, TableName};
use crate::source::SourceLink;
use crate::state::postgres::DurableCommit;
use crate::telemetry::events::{
    InternalEvent, PgStreaming, SourceKind, SourceLag, SourceReconnecting,
};
use crate::Error;
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
    pub status_interval: Duration,
    /// Existing rows to publish before streaming (first start, or a requested replay), per
    /// table.
    pub snapshot: Vec<(TableName, snapshot::SnapshotPlan)>,
    /// How far an interrupted run got through that snapshot.
    pub snapshot_after: Option<snapshot::SnapshotKey>,
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

/// Replication messages the library may hold decoded before the relay takes them: memory is
/// bounded by `--max-inflight-bytes` plus this many rows.
pub const REPLICATION_BUFFER_EVENTS: usize = 32;

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
    .with_wakeup_interval(Duration::from_secs(1))
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
    let retryable = match &e {
        PgWireError::Io(_) | PgWireError::Task(_) => true,
        PgWireError::Server(_) => code.is_some_and(retryable_sqlstate),
        PgWireError::Protocol(m) => m.contains("EOF") || m.contains("closed"),
        _ => false,
    };
    Error::source(format!("replication stream: {text}"), retryable)
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
/// `stored` says which positions the state row holds: the slot is confirmed only up to
/// min(durable, stored), so a slot found ahead of the row was moved by something else (it was
/// dropped and created again) and is reported as a lost position, never streamed from.
pub async fn run(
    cfg: PgSourceConfig,
    link: SourceLink,
    start: u64,
    mut stored: tokio::sync::watch::Receiver<u64>,
    durable_commits: tokio::sync::watch::Sender<DurableCommit>,
    mut server_stopping: tokio::sync::watch::Receiver<Option<Instant>>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let mut commits = crate::state::CommitLog::<u64>::default();
    let SourceLink { outlet, mut acks } = link;
    if cfg
        .snapshot
        .iter()
        .any(|(_, p)| *p != snapshot::SnapshotPlan::Nothing)
    {
        let mut sql = connect_sql(&cfg.dsn, &format!("outboxd_{}_snapshot", cfg.name)).await?;
        let mut sent = 0;
        for (i, (table, plan)) in cfg.snapshot.iter().enumerate() {
            let Some(resume) = snapshot::SnapshotKey::applies(cfg.snapshot_after.as_ref(), i)
            else {
                continue;
            };
            sent += snapshot::publish(
                &mut sql,
                &cfg.tables,
                table,
                &cfg.columns,
                plan,
                (start, sent),
                &outlet,
                (i, cfg.snapshot_after.as_ref().filter(|_| resume)),
            )
            .await?;
        }
        // Acknowledging this means every snapshot row is durable: the lease keeper then marks
        // the first start done.
        outlet.send_checkpoint(Checkpoint::Lsn(start)).await?;
    }
    let mut outlet = Some(outlet);
    let mut mapper = RowMapper::for_tables(cfg.tables.clone(), cfg.columns.clone());
    // Highest commit LSN forwarded to the relay: after a reconnect, transactions up to it are
    // repeated by the server and skipped here.
    let mut forwarded_commit: u64 = 0;
    // The transaction being forwarded when the stream broke: (commit LSN, events handed over).
    // The server sends it again from its start; those events are skipped, the rest follow.
    let mut partial: Option<(u64, u32)> = None;
    let mut acked: u64 = start;
    // The highest position ever confirmed to the server by this process.
    let mut reported: u64 = start;
    let mut stored_open = true;
    let mut stopping_open = true;
    let mut backoff = Backoff::standard();

    'connect: loop {
        let mut client = match connect_replication(&cfg, acked, reported).await {
            Ok(c) => c,
            Err(err) => {
                if !err.is_retryable() {
                    return Err(err);
                }
                let d = backoff.next_delay();
                tracing::warn!(error = %err, retry_in = ?d, "replication connect failed");
                tokio::time::sleep(d).await;
                continue;
            }
        };
        let started = tokio::select! {
            r = client.wait_started() => r,
            _ = shutdown.cancelled() => {
                client.abort();
                return Ok(());
            }
        };
        if let Err(e) = started {
            let err = wire_error(e, &cfg.slot, &cfg.name);
            if !err.is_retryable() {
                return Err(err);
            }
            let d = backoff.next_delay();
            tracing::warn!(error = %err, retry_in = ?d, "replication start refused; retrying");
            tokio::time::sleep(d).await;
            continue;
        }
        // Now that our walsender holds the slot nobody can swap it: check that it is still
        // the one we confirmed to (it may have been dropped and created again meanwhile).
        if let Err(err) = slot_is_ours(&cfg, reported).await {
            client.abort();
            if !err.is_retryable() {
                return Err(err);
            }
            let d = backoff.next_delay();
            tracing::warn!(error = %err, retry_in = ?d, "could not check the slot; reconnecting");
            tokio::time::sleep(d).await;
            continue;
        }
        let streaming_since = Instant::now();
        PgStreaming {
            slot: &cfg.slot,
            from: &format_lsn(acked),
        }
        .emit();
        let mut in_txn: Option<Txn> = None;
        let mut last_idle_checkpoint: u64 = 0;

        loop {
            let Some(out) = outlet.as_ref() else {
                break 'connect;
            };
            let mut stop = false;
            tokio::select! {
                biased;
                changed = acks.changed() => {
                    if changed.is_err() {
                        // The relay ended before we stopped: it failed, and says why.
                        client.abort();
                        return Ok(());
                    }
                    if let Some(Checkpoint::Lsn(l)) = acks.borrow_and_update().clone() {
                        if l > acked {
                            acked = l;
                            commits.durable_up_to(l, &durable_commits);
                            confirm(&client, acked.min(*stored.borrow()), &mut reported);
                        }
                    }
                }
                changed = stored.changed(), if stored_open => {
                    stored_open = changed.is_ok();
                    let s = *stored.borrow_and_update();
                    confirm(&client, acked.min(s), &mut reported);
                }
                changed = server_stopping.changed(), if stopping_open => {
                    stopping_open = changed.is_ok();
                    let seen = *server_stopping.borrow_and_update();
                    // Only a shutdown seen while this stream ran: an older one is over.
                    if seen.is_some_and(|at| at > streaming_since) {
                        // The server's walsender keeps it from stopping until the slot is
                        // confirmed up to its shutdown checkpoint; that position cannot be
                        // stored any more, so it is never confirmed. Closing the stream lets
                        // the server stop; the slot keeps the last stored position.
                        client.abort();
                        let d = backoff.next_delay();
                        SourceReconnecting {
                            source: SourceKind::Postgres,
                            message: "the server is shutting down: closed the replication stream so that it can; resuming from the slot",
                            error: None,
                            timeout: None,
                            retry_in: Some(d),
                        }
                        .emit();
                        tokio::time::sleep(d).await;
                        continue 'connect;
                    }
                }
                _ = shutdown.cancelled(), if in_txn.is_none() => stop = true,
                ev = client.recv() => {
                    let ev = match ev {
                        Ok(Some(ev)) => ev,
                        Ok(None) => {
                            let err = Error::source("replication stream ended", true);
                            SourceReconnecting {
                                source: SourceKind::Postgres,
                                message: "reconnecting",
                                error: Some(&err),
                                timeout: None,
                                retry_in: None,
                            }
                            .emit();
                            continue 'connect;
                        }
                        Err(e) => {
                            let err = wire_error(e, &cfg.slot, &cfg.name);
                            if !err.is_retryable() {
                                return Err(err);
                            }
                            let d = backoff.next_delay();
                            SourceReconnecting {
                                source: SourceKind::Postgres,
                                message: "replication stream broke; resuming from the slot",
                                error: Some(&err),
                                timeout: None,
                                retry_in: Some(d),
                            }
                            .emit();
                            tokio::time::sleep(d).await;
                            continue 'connect;
                        }
                    };
                    backoff.reset();
                    match ev {
                        ReplicationEvent::Begin { final_lsn, commit_time_micros, .. } => {
                            let commit_lsn = final_lsn.as_u64();
                            in_txn = Some(Txn {
                                commit_lsn,
                                commit_time_micros,
                                index: 0,
                                skip: commit_lsn <= forwarded_commit,
                                already_sent: resent_prefix(partial, commit_lsn),
                            });
                        }
                        ReplicationEvent::XLogData { data, .. } => {
                            let msg = pgoutput::decode(data).map_err(|e| Error::Decode(e.to_string()))?;
                            match msg {
                                pgoutput::Message::Relation(rel) => mapper.relation(rel)?,
                                pgoutput::Message::Insert { relation_id, tuple } => {
                                    let Some(txn) = in_txn.as_mut() else {
                                        return Err(Error::Decode("insert outside a transaction".into()));
                                    };
                                    if let Some(event) = mapper.insert(relation_id, &tuple, txn.commit_lsn, txn.index, txn.commit_time_micros)? {
                                        let index = txn.index;
                                        txn.index += 1;
                                        if let Some(committed) = event.committed_at {
                                            commits.observe(committed, event.created_at);
                                        }
                                        // The server decodes a transaction the same way each
                                        // time, so (commit LSN, index) names the same event.
                                        if !txn.skip && index >= txn.already_sent {
                                            out.send_event(event).await?;
                                            partial = Some((txn.commit_lsn, txn.index));
                                        }
                                    }
                                }
                                // publish = 'insert' keeps these away; other messages are
                                // not ours.
                                _ => {}
                            }
                        }
                        ReplicationEvent::Commit { end_lsn, .. } => {
                            if let Some(txn) = in_txn.take() {
                                if !txn.skip {
                                    partial = None;
                                    commits.forwarded(end_lsn.as_u64(), rows::pg_time(txn.commit_time_micros));
                                    out.send_checkpoint(Checkpoint::Lsn(end_lsn.as_u64())).await?;
                                    forwarded_commit = txn.commit_lsn;
                                }
                            }
                        }
                        ReplicationEvent::KeepAlive { wal_end, .. } => {
                            let w = wal_end.as_u64();
                            SourceLag { bytes: w.saturating_sub(acked) }.emit();
                            // Everything before a keepalive has been sent to us, so once the
                            // events before it are durable the slot may move here: an idle
                            // outbox beside busy tables keeps the slot near the head.
                            if in_txn.is_none() && w > last_idle_checkpoint && w > acked {
                                last_idle_checkpoint = w;
                                out.send_checkpoint(Checkpoint::Lsn(w)).await?;
                            }
                        }
                        ReplicationEvent::Message { .. } | ReplicationEvent::StoppedAt { .. } => {}
                    }
                }
            }
            if stop {
                tracing::info!("stopping at a transaction boundary");
                // Closing the channel tells the relay that no more events come.
                drop(outlet.take());
                drain_and_confirm(
                    &mut client,
                    &mut acks,
                    &mut stored,
                    &mut acked,
                    &mut reported,
                )
                .await;
                return Ok(());
            }
        }
    }
    Ok(())
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

struct Txn {
    commit_lsn: u64,
    commit_time_micros: i64,
    index: u32,
    /// Forwarded whole before a reconnect: every event is skipped.
    skip: bool,
    /// Events of this transaction forwarded before the stream broke mid-way: skipped.
    already_sent: u32,
}

/// How many leading events of the transaction committing at `commit_lsn` were forwarded
/// before the stream broke inside it.
fn resent_prefix(partial: Option<(u64, u32)>, commit_lsn: u64) -> u32 {
    match partial {
        Some((lsn, sent)) if lsn == commit_lsn => sent,
        _ => 0,
    }
}

/// After the last event was handed over: take every acknowledgement until the relay ends, then
/// make sure the final one reached the server before the stream closes (the library sends no
/// final status update on stop).
async fn drain_and_confirm(
    client: &mut ReplicationClient,
    acks: &mut tokio::sync::watch::Receiver<Option<Checkpoint>>,
    stored: &mut tokio::sync::watch::Receiver<u64>,
    acked: &mut u64,
    reported: &mut u64,
) {
    loop {
        let changed = acks.changed().await;
        if let Some(Checkpoint::Lsn(l)) = acks.borrow_and_update().clone() {
            if l > *acked {
                *acked = l;
                confirm(client, (*acked).min(*stored.borrow()), reported);
            }
        }
        if changed.is_err() {
            break;
        }
    }
    let metrics = client.metrics();
    let deadline = Instant::now() + Duration::from_secs(10);
    while metrics.last_applied_lsn().as_u64() < *acked && Instant::now() < deadline {
        // The lease keeper stores the final position on its next renewal; only then may the
        // slot have it.
        confirm(client, (*acked).min(*stored.borrow()), reported);
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
