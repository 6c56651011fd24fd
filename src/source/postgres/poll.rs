//! Poll mode on Postgres: the Postgres side of the shared poll loop ([`crate::source::poll`]).
//! The claim is `SELECT … WHERE status = 'pending' ORDER BY created_at, seq LIMIT n FOR UPDATE
//! SKIP LOCKED` (`id` instead of `seq` when the table has none) on the partial index of
//! pending rows, in a READ COMMITTED transaction whose idleness and lock waits the server
//! bounds; the mark is `UPDATE … SET status = 'published', published_at = now()` for the
//! claimed ids. Rows are read as text and mapped exactly as the logical-replication stream
//! maps them. Also here: the optional LISTEN session that wakes the loop early (the trigger
//! `setup --notify` installs) and `setup --mode poll`'s `seq` column and index.

use crate::backoff::Backoff;
use crate::dsn::DbDsn;
use crate::event::OutboxEvent;
use crate::outbox::{pg_ident, Column, ColumnMap, TableName};
use crate::source::poll::{run, LoopConfig, PollTable, SESSIONS};
use crate::source::postgres::pgoutput::Value;
use crate::source::postgres::rows::RowMapper;
use crate::source::postgres::{connect_sql, snapshot, sql_config, tls_connect_error};
use crate::source::SourceLink;
use crate::telemetry::events::SourceKind;
use crate::Error;
use futures::StreamExt;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Postgres poll settings.
#[derive(Debug, Clone)]
pub struct PollConfig {
    pub dsn: DbDsn,
    pub name: String,
    pub table: TableName,
    pub columns: ColumnMap,
    pub run: LoopConfig,
    /// LISTEN on this channel to wake early (the trigger `setup --notify` installs).
    pub notify_channel: Option<String>,
}

/// The channel the notify trigger signals for a table.
pub fn notify_channel(table: &TableName) -> String {
    format!("outboxd_{}_{}", table.pg_schema(), table.name)
}

/// SQL for the statement-level trigger that wakes pollers as soon as rows are committed.
pub fn notify_trigger_sql(table: &TableName) -> String {
    let channel = notify_channel(table);
    let func = pg_ident(&format!("{channel}_notify"));
    format!(
        "CREATE OR REPLACE FUNCTION {schema}.{func}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $$;
         DROP TRIGGER IF EXISTS outboxd_notify ON {table};
         CREATE TRIGGER outboxd_notify AFTER INSERT ON {table}
           FOR EACH STATEMENT EXECUTE FUNCTION {schema}.{func}();",
        schema = pg_ident(table.pg_schema()),
        table = table.pg_quoted(),
    )
}

/// Opens a LISTEN session whose notifications tick `wake`: TLS and verification as every
/// other SQL session of `dsn` ([`sql_config`]). When the session ends (a cut connection, the
/// server ending it or restarting), a background task opens it again with backoff, polling on
/// the interval meanwhile, and ticks `wake` once it is back: rows may have been committed while
/// no one listened. The task stops once the poll loop is gone (no receiver left).
async fn listen(dsn: &DbDsn, channel: &str, wake: watch::Sender<u64>) -> Result<(), Error> {
    let wake = std::sync::Arc::new(wake);
    let first = listen_once(dsn, channel, wake.clone()).await?;
    let (dsn, channel) = (dsn.clone(), channel.to_string());
    tokio::spawn(async move {
        let mut session = first;
        let mut backoff = Backoff::standard();
        loop {
            let opened = tokio::time::Instant::now();
            let _ = session.await;
            if wake.is_closed() {
                return;
            }
            // A session that lived a while ended on its own: the backoff starts afresh.
            if opened.elapsed() >= Duration::from_secs(60) {
                backoff.reset();
            }
            session = loop {
                let d = backoff.next_delay();
                tokio::time::sleep(d).await;
                if wake.is_closed() {
                    return;
                }
                match listen_once(&dsn, &channel, wake.clone()).await {
                    Ok(s) => {
                        tracing::info!("LISTEN session reopened");
                        wake.send_modify(|n| *n += 1);
                        break s;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in = ?d, "could not reopen the LISTEN session; polling on the interval meanwhile")
                    }
                }
            };
        }
    });
    Ok(())
}

/// One LISTEN session; the handle ends when the session does.
async fn listen_once(
    dsn: &DbDsn,
    channel: &str,
    wake: std::sync::Arc<watch::Sender<u64>>,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let (cfg, tls) = sql_config(dsn, "outboxd_listen")?;
    let (client, driver) = match tls {
        None => {
            let (client, conn) = cfg.connect(tokio_postgres::NoTls).await?;
            (client, drive_listen(conn, wake))
        }
        Some(tls) => {
            let (client, conn) = cfg
                .connect(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
                .await
                .map_err(|e| tls_connect_error(e, dsn))?;
            (client, drive_listen(conn, wake))
        }
    };
    client
        .batch_execute(&format!("LISTEN {}", pg_ident(channel)))
        .await?;
    // The client must live as long as the session; the driver task owns the connection.
    Ok(tokio::spawn(async move {
        let _keep = client;
        let _ = driver.await;
    }))
}

/// Drives a LISTEN session's connection in the background, ticking `wake` per notification.
fn drive_listen<S, T>(
    mut conn: tokio_postgres::Connection<S, T>,
    wake: std::sync::Arc<watch::Sender<u64>>,
) -> tokio::task::JoinHandle<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(m) = messages.next().await {
            match m {
                Ok(tokio_postgres::AsyncMessage::Notification(_)) => {
                    wake.send_modify(|n| *n += 1);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN session ended; reopening it (polling on the interval meanwhile)");
                    break;
                }
            }
        }
    })
}

/// The Postgres side of the loop: one session, the table's columns read as text and mapped
/// exactly as the stream maps them.
pub(crate) struct PgPoll {
    client: tokio_postgres::Client,
    mapper: RowMapper,
    /// The claim and the mark, prepared once per session: a statement given as text is parsed,
    /// described and planned again on every call, a round trip of its own each time.
    claim: tokio_postgres::Statement,
    mark: tokio_postgres::Statement,
    id_index: usize,
    begin: String,
    /// The logical column that orders rows with one `created_at` (see [`tie_break`]).
    tie_break: Column,
}

impl PgPoll {
    pub(crate) async fn open(cfg: &PollConfig) -> Result<PgPoll, Error> {
        let client = connect_sql(&cfg.dsn, &format!("outboxd_{}_poll", cfg.name)).await?;
        let rel = snapshot::table_relation(&client, &cfg.table).await?;
        let mut mapper = RowMapper::new(cfg.table.clone(), cfg.columns.clone());
        mapper.relation(rel.clone())?;
        let status = pg_ident(cfg.columns.get(Column::Status));
        let published_at = pg_ident(cfg.columns.get(Column::PublishedAt));
        let id = pg_ident(cfg.columns.get(Column::Id));
        if !rel
            .columns
            .iter()
            .any(|c| c.name == cfg.columns.get(Column::Status))
        {
            return Err(Error::config(
                format!("poll mode needs a status column on {}", cfg.table.pg_quoted()),
                format!(
                    "ALTER TABLE {} ADD COLUMN status text NOT NULL DEFAULT 'pending', ADD COLUMN published_at timestamptz;",
                    cfg.table.pg_quoted()
                ),
            ));
        }
        let select_cols: Vec<String> = rel
            .columns
            .iter()
            .map(|c| format!("{}::text", pg_ident(&c.name)))
            .collect();
        // `ORDER BY` names the columns through the table's alias: a bare name would resolve to
        // the select list's `created_at::text` (output names come first in `ORDER BY`), which
        // sorts by the text and so reads and sorts every pending row (a sequential scan, a sort
        // spilled to disk at 50,000 pending rows) instead of walking `outbox_pending` for the
        // first `limit`.
        //
        // A transaction's rows share `created_at` (`now()` is the transaction's start), and
        // without a tie-break they come back in heap order, which after deletes and VACUUM is
        // not insert order (a later row fills a hole on an earlier page): an aggregate's
        // version 2 would be published before its version 1. `seq` (an identity column) rises
        // with insert order; without it the id does for rows `Outbox::write` inserted (UUID
        // v7, rising within the producer process).
        let tie_break = tie_break(&rel, &cfg.columns);
        let claim = format!(
            "SELECT {} FROM {} AS o WHERE {status}::text = 'pending' ORDER BY o.{}, o.{} LIMIT $1 FOR UPDATE SKIP LOCKED",
            select_cols.join(", "),
            cfg.table.pg_quoted(),
            pg_ident(cfg.columns.get(Column::CreatedAt)),
            pg_ident(cfg.columns.get(tie_break)),
        );
        let mark = format!(
            "UPDATE {} SET {status} = 'published', {published_at} = now() WHERE {id} = ANY($1)",
            cfg.table.pg_quoted()
        );
        let id_index = rel
            .columns
            .iter()
            .position(|c| c.name == cfg.columns.get(Column::Id))
            .expect("mapped above");
        let deadline_ms = cfg.run.deadline.as_millis().max(1000);
        // If this process stalls, the server ends the transaction and frees the rows.
        let begin = format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL datestyle = ISO; SET LOCAL timezone = 'UTC';
             SET LOCAL idle_in_transaction_session_timeout = '{}ms'; SET LOCAL lock_timeout = '{}ms'",
            deadline_ms * 2,
            deadline_ms
        );
        let claim = client.prepare(&claim).await?;
        let mark = client.prepare(&mark).await?;
        Ok(PgPoll {
            client,
            mapper,
            claim,
            mark,
            id_index,
            begin,
            tie_break,
        })
    }
}

/// The logical column that orders rows with one `created_at`: `seq` when the table has it,
/// otherwise `id`.
fn tie_break(rel: &crate::source::postgres::pgoutput::Relation, columns: &ColumnMap) -> Column {
    if rel
        .columns
        .iter()
        .any(|c| c.name == columns.get(Column::Seq))
    {
        Column::Seq
    } else {
        Column::Id
    }
}

/// What [`ensure_seq`] did to a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqChange {
    pub column_added: bool,
    pub index_created: bool,
}

/// Gives an existing table the `seq` column and an index on `(created_at, seq)` for pending
/// rows, each only when missing (`outboxd setup --mode poll`; the table of
/// migrations/postgres/001_outbox.sql has both). Adding an identity column rewrites the table
/// under an exclusive lock, numbering the rows already there in heap order (their order among
/// themselves is what it was before); the index is built `CONCURRENTLY` on a plain table, so
/// producers keep writing meanwhile. An index such a build left invalid (the build was
/// interrupted) is dropped and built again.
pub async fn ensure_seq(
    client: &tokio_postgres::Client,
    table: &TableName,
    columns: &ColumnMap,
) -> Result<SeqChange, Error> {
    let quoted = table.pg_quoted();
    let (created_at, seq, status) = (
        columns.get(Column::CreatedAt),
        columns.get(Column::Seq),
        columns.get(Column::Status),
    );
    let has = |col: &str| {
        let (quoted, col) = (quoted.clone(), col.to_string());
        async move {
            client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = $2 AND attnum > 0 AND NOT attisdropped)",
                    &[&quoted, &col],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
        }
    };
    if !has(status).await? {
        return Err(Error::config(
            format!("poll mode needs a status column on {quoted}"),
            format!(
                "ALTER TABLE {quoted} ADD COLUMN status text NOT NULL DEFAULT 'pending', ADD COLUMN published_at timestamptz;"
            ),
        ));
    }
    let column_added = !has(seq).await?;
    if column_added {
        client
            .batch_execute(&format!(
                "ALTER TABLE {quoted} ADD COLUMN IF NOT EXISTS {} bigint GENERATED ALWAYS AS IDENTITY",
                pg_ident(seq)
            ))
            .await?;
    }
    // Any valid index that starts with (created_at, seq) serves the claim.
    let covered: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_index i
               JOIN pg_attribute a0 ON a0.attrelid = i.indrelid AND a0.attnum = i.indkey[0]
               JOIN pg_attribute a1 ON a1.attrelid = i.indrelid AND a1.attnum = i.indkey[1]
              WHERE i.indrelid = to_regclass($1) AND i.indisvalid AND i.indnkeyatts >= 2
                AND a0.attname = $2 AND a1.attname = $3)",
            &[&quoted, &created_at, &seq],
        )
        .await?
        .get(0);
    if covered {
        return Ok(SeqChange {
            column_added,
            index_created: false,
        });
    }
    let index = format!("{}_pending_seq", table.name);
    let index_quoted = format!("{}.{}", pg_ident(table.pg_schema()), pg_ident(&index));
    // A partitioned table's index cannot be built concurrently (its partitions' can, one by
    // one, by hand); the plain build blocks writes while it runs.
    let partitioned: bool = client
        .query_one(
            "SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)",
            &[&quoted],
        )
        .await?
        .get(0);
    let concurrently = if partitioned { "" } else { "CONCURRENTLY " };
    // Left invalid by an interrupted concurrent build: `IF NOT EXISTS` would keep it as it is.
    client
        .batch_execute(&format!(
            "DROP INDEX {concurrently}IF EXISTS {index_quoted}"
        ))
        .await?;
    client
        .batch_execute(&format!(
            "CREATE INDEX {concurrently}{} ON {quoted} ({}, {}) WHERE {} = 'pending'",
            pg_ident(&index),
            pg_ident(created_at),
            pg_ident(seq),
            pg_ident(status),
        ))
        .await?;
    Ok(SeqChange {
        column_added,
        index_created: true,
    })
}

impl PollTable for PgPoll {
    type Id = Uuid;
    const SOURCE: SourceKind = SourceKind::Postgres;

    async fn begin(&mut self) -> Result<(), Error> {
        Ok(self.client.batch_execute(&self.begin).await?)
    }

    async fn claim(&mut self, limit: i64) -> Result<Vec<(Uuid, OutboxEvent)>, Error> {
        let rows = self.client.query(&self.claim, &[&limit]).await?;
        self.map_claimed(rows)
    }

    async fn mark(&mut self, ids: &[Uuid]) -> Result<(), Error> {
        self.client.execute(&self.mark, &[&ids]).await?;
        Ok(())
    }

    async fn commit(&mut self) -> Result<(), Error> {
        Ok(self.client.batch_execute("COMMIT").await?)
    }

    async fn rollback(&mut self) -> Result<(), Error> {
        Ok(self.client.batch_execute("ROLLBACK").await?)
    }

    // tokio-postgres pipelines requests that are polled together: each request is queued on
    // the connection when first polled, in order, so the server receives BEGIN … and the claim
    // (or the mark and COMMIT) back to back and answers both in one round trip. A failure of
    // the first fails the second (an aborted transaction runs nothing, COMMIT rolls it back).
    async fn begin_and_claim(&mut self, limit: i64) -> Result<Vec<(Uuid, OutboxEvent)>, Error> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&limit];
        let (_, rows) = futures::try_join!(
            self.client.batch_execute(&self.begin),
            self.client.query(&self.claim, &params),
        )?;
        self.map_claimed(rows)
    }

    async fn mark_and_commit(&mut self, ids: &[Uuid]) -> Result<(), Error> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&ids];
        futures::try_join!(
            self.client.execute(&self.mark, &params),
            self.client.batch_execute("COMMIT"),
        )?;
        Ok(())
    }
}

impl PgPoll {
    /// The claimed rows, each mapped to the event it publishes.
    fn map_claimed(
        &mut self,
        rows: Vec<tokio_postgres::Row>,
    ) -> Result<Vec<(Uuid, OutboxEvent)>, Error> {
        let mut out = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let tuple = crate::source::postgres::rows::text_tuple(row);
            // Rows are marked by id (`= ANY($1::uuid[])`, on the primary key): a row whose id
            // is no UUID could never be marked, so it stops the relay instead of looping.
            let id = match tuple.get(self.id_index) {
                Some(Value::Text(raw)) => std::str::from_utf8(raw)
                    .ok()
                    .and_then(|s| s.parse::<Uuid>().ok()),
                _ => None,
            }
            .ok_or_else(|| {
                Error::config(
                    format!("poll mode: a pending row's id {:?} is not a UUID", tuple.get(self.id_index)),
                    "poll mode on Postgres needs a uuid id column (migrations/postgres/001_outbox.sql); publish or fix that row by hand",
                )
            })?;
            if let Some(event) = self.mapper.insert(0, &tuple, 0, i as u32, 0)? {
                out.push((id, event));
            }
        }
        Ok(out)
    }
}

/// Runs poll mode on a Postgres table until `shutdown`.
pub async fn run_postgres(
    cfg: PollConfig,
    link: SourceLink,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let dbs = open_sessions(&cfg).await?;
    if dbs[0].tie_break != Column::Seq {
        tracing::warn!(
            table = %cfg.table.pg_quoted(),
            column = cfg.columns.get(Column::Seq),
            fix = "outboxd setup --mode poll (adds the column and its index)",
            "no seq column: rows with one created_at are claimed in id order, which is insert order only for ids that rise with it (Outbox::write's UUID v7)"
        );
    }
    let (wake_tx, wake) = watch::channel(0u64);
    if let Some(channel) = &cfg.notify_channel {
        listen(&cfg.dsn, channel, wake_tx).await?;
    }
    run(
        dbs,
        || open_sessions(&cfg),
        cfg.run.clone(),
        wake,
        link,
        shutdown,
    )
    .await
}

/// The loop's [`SESSIONS`] sessions.
async fn open_sessions(cfg: &PollConfig) -> Result<Vec<PgPoll>, Error> {
    let mut dbs = Vec::with_capacity(SESSIONS);
    for _ in 0..SESSIONS {
        dbs.push(PgPoll::open(cfg).await?);
    }
    Ok(dbs)
}
