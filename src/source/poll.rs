//! Poll mode (the classic polling relay), for databases where the log cannot be read: one short
//! READ COMMITTED transaction per batch — claim pending rows with `FOR UPDATE SKIP LOCKED`,
//! hand them to the sink, wait until every one is confirmed, mark them published, commit.
//! Publish first, mark second: a crash between the two gives a duplicate, never a loss.
//! Several relays on one table take disjoint batches; they need no lease. The loop is one for
//! both databases ([`run`]); each database supplies its statements through [`PollTable`]
//! (Postgres here, MySQL/MariaDB in `source::mysql::poll`).

use crate::dsn::DbDsn;
use crate::event::{Checkpoint, OutboxEvent};
use crate::outbox::{pg_ident, ColumnMap, TableName};
use crate::source::postgres::pgoutput::Value;
use crate::source::postgres::rows::RowMapper;
use crate::source::postgres::{connect_sql, snapshot, sql_config, tls_connect_error};
use crate::source::SourceLink;
use crate::Error;
use futures::StreamExt;
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The command line's poll settings.
#[derive(Debug, Clone)]
pub struct PollOptions {
    pub batch: i64,
    pub interval: Duration,
    pub notify: bool,
}

impl PollOptions {
    pub fn loop_config(&self, deadline: Duration) -> LoopConfig {
        LoopConfig {
            batch: self.batch,
            interval: self.interval,
            deadline,
        }
    }
}

/// What the loop needs to know, whatever the database.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    pub batch: i64,
    pub interval: Duration,
    /// Longest a batch's transaction may stay open (handing rows over and waiting for their
    /// confirms); shorter than the server's lock timeouts, so a slow broker never holds rows
    /// (or producers) for long.
    pub deadline: Duration,
}

/// One database's side of the poll loop: a session that runs one short transaction per batch.
/// A failed call leaves the session unusable; the loop then stops with the error.
pub trait PollTable: Send {
    /// How a claimed row is named again when it is marked.
    type Id: Send;

    /// Opens a READ COMMITTED transaction whose locks and idleness the server bounds.
    fn begin(&mut self) -> impl Future<Output = Result<(), Error>> + Send;
    /// Claims up to `limit` pending rows, oldest first, skipping rows other relays hold; each
    /// mapped to the event it publishes.
    fn claim(
        &mut self,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<(Self::Id, OutboxEvent)>, Error>> + Send;
    /// Marks the claimed rows published.
    fn mark(&mut self, ids: &[Self::Id]) -> impl Future<Output = Result<(), Error>> + Send;
    fn commit(&mut self) -> impl Future<Output = Result<(), Error>> + Send;
    fn rollback(&mut self) -> impl Future<Output = Result<(), Error>> + Send;
}

/// Runs the poll loop until `shutdown`; the batch in flight is finished first. `wake` ticks
/// when rows may have arrived before the interval is over (Postgres NOTIFY).
pub async fn run<D: PollTable>(
    mut db: D,
    cfg: LoopConfig,
    mut wake: watch::Receiver<u64>,
    link: SourceLink,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let SourceLink { outlet, mut acks } = link;
    let mut batch_no: u64 = 0;
    let mut waking = true;
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        db.begin().await?;
        let claimed = db.claim(cfg.batch).await?;
        let n = claimed.len();
        if n == 0 {
            db.commit().await?;
        } else {
            batch_no += 1;
            let mut ids = Vec::with_capacity(n);
            let hand_over = async {
                for (i, (id, mut event)) in claimed.into_iter().enumerate() {
                    event.position = crate::event::SourcePosition::Poll {
                        batch: batch_no,
                        index: i as u32,
                    };
                    ids.push(id);
                    outlet.send_event(event).await?;
                }
                outlet.send_checkpoint(Checkpoint::Batch(batch_no)).await?;
                loop {
                    if let Some(Checkpoint::Batch(b)) = &*acks.borrow_and_update() {
                        if *b >= batch_no {
                            return Ok(true);
                        }
                    }
                    if acks.changed().await.is_err() {
                        return Ok::<_, Error>(false);
                    }
                }
            };
            // The whole batch, handing over included: a sink that takes nothing must not
            // keep the transaction open either.
            match tokio::time::timeout(cfg.deadline, hand_over).await {
                Ok(Ok(true)) => {
                    db.mark(&ids).await?;
                    db.commit().await?;
                    tracing::debug!(batch = batch_no, rows = n, "batch published and marked");
                }
                // The relay ended (it failed, and says why): the rows stay pending.
                Ok(Ok(false)) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Err(_) => {
                    // Not confirmed in time: let the rows go; this or another relay publishes
                    // them again (a duplicate, never a loss).
                    tracing::warn!(batch = batch_no, rows = n, deadline = ?cfg.deadline, "batch not confirmed in time; releasing its rows");
                    db.rollback().await?;
                }
            }
        }
        // A full batch polls again at once.
        if (n as i64) < cfg.batch {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(cfg.interval) => {}
                // A closed wake channel (no NOTIFY, or its session ended) leaves the interval.
                r = wake.changed(), if waking => waking = r.is_ok(),
            }
        }
    }
}

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
/// other SQL session of `dsn` ([`sql_config`]).
async fn listen(dsn: &DbDsn, channel: &str, wake: watch::Sender<u64>) -> Result<(), Error> {
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
    tokio::spawn(async move {
        let _keep = client;
        let _ = driver.await;
    });
    Ok(())
}

/// Drives a LISTEN session's connection in the background, ticking `wake` per notification.
fn drive_listen<S, T>(
    mut conn: tokio_postgres::Connection<S, T>,
    wake: watch::Sender<u64>,
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
                    tracing::warn!(error = %e, "LISTEN session ended; polling on the interval only");
                    break;
                }
            }
        }
    })
}

/// The Postgres side of the loop: one session, the table's columns read as text and mapped
/// exactly as the stream maps them.
pub struct PgPoll {
    client: tokio_postgres::Client,
    mapper: RowMapper,
    claim: String,
    mark: String,
    id_index: usize,
    begin: String,
}

impl PgPoll {
    pub async fn open(cfg: &PollConfig) -> Result<PgPoll, Error> {
        let client = connect_sql(&cfg.dsn, &format!("outboxd_{}_poll", cfg.name)).await?;
        let rel = snapshot::table_relation(&client, &cfg.table).await?;
        let mut mapper = RowMapper::new(cfg.table.clone(), cfg.columns.clone());
        mapper.relation(rel.clone())?;
        let status = pg_ident(cfg.columns.get("status"));
        let published_at = pg_ident(cfg.columns.get("published_at"));
        let id = pg_ident(cfg.columns.get("id"));
        if !rel
            .columns
            .iter()
            .any(|c| c.name == cfg.columns.get("status"))
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
        let claim = format!(
            "SELECT {} FROM {} WHERE {status}::text = 'pending' ORDER BY {} LIMIT $1 FOR UPDATE SKIP LOCKED",
            select_cols.join(", "),
            cfg.table.pg_quoted(),
            pg_ident(cfg.columns.get("created_at")),
        );
        let mark = format!(
            "UPDATE {} SET {status} = 'published', {published_at} = now() WHERE {id} = ANY($1)",
            cfg.table.pg_quoted()
        );
        let id_index = rel
            .columns
            .iter()
            .position(|c| c.name == cfg.columns.get("id"))
            .expect("mapped above");
        let deadline_ms = cfg.run.deadline.as_millis().max(1000);
        // If this process stalls, the server ends the transaction and frees the rows.
        let begin = format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL datestyle = ISO; SET LOCAL timezone = 'UTC';
             SET LOCAL idle_in_transaction_session_timeout = '{}ms'; SET LOCAL lock_timeout = '{}ms'",
            deadline_ms * 2,
            deadline_ms
        );
        Ok(PgPoll {
            client,
            mapper,
            claim,
            mark,
            id_index,
            begin,
        })
    }
}

impl PollTable for PgPoll {
    type Id = Uuid;

    async fn begin(&mut self) -> Result<(), Error> {
        Ok(self.client.batch_execute(&self.begin).await?)
    }

    async fn claim(&mut self, limit: i64) -> Result<Vec<(Uuid, OutboxEvent)>, Error> {
        let rows = self.client.query(&self.claim, &[&limit]).await?;
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
}

/// Runs poll mode on a Postgres table until `shutdown`.
pub async fn run_postgres(
    cfg: PollConfig,
    link: SourceLink,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let db = PgPoll::open(&cfg).await?;
    let (wake_tx, wake) = watch::channel(0u64);
    if let Some(channel) = &cfg.notify_channel {
        listen(&cfg.dsn, channel, wake_tx).await?;
    }
    run(db, cfg.run, wake, link, shutdown).await
}
