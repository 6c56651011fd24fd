//! Poll mode (the seed's first relay), for databases where the log cannot be read: one short
//! READ COMMITTED transaction per batch — claim pending rows with `FOR UPDATE SKIP LOCKED`,
//! hand them to the sink, wait until every one is confirmed, mark them published, commit.
//! Publish first, mark second: a crash between the two gives a duplicate, never a loss.
//! Several relays on one table take disjoint batches; they need no lease.

use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::outbox::{pg_ident, ColumnMap, TableName};
use crate::source::postgres::pgoutput::Value;
use crate::source::postgres::rows::RowMapper;
use crate::source::postgres::{connect_sql, snapshot};
use crate::source::SourceLink;
use crate::Error;
use futures::StreamExt;
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

#[derive(Debug, Clone)]
pub struct PollConfig {
    pub dsn: DbDsn,
    pub name: String,
    pub table: TableName,
    pub columns: ColumnMap,
    pub batch: i64,
    pub interval: Duration,
    /// Longest a batch's transaction may stay open waiting for confirms; shorter than the
    /// server's lock timeouts, so a slow broker never holds rows (or producers) for long.
    pub deadline: Duration,
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

/// Opens a LISTEN session whose notifications tick `wake`.
async fn listen(dsn: &DbDsn, channel: &str, wake: watch::Sender<u64>) -> Result<(), Error> {
    let mut cfg = tokio_postgres::Config::new();
    cfg.host(&dsn.host)
        .port(dsn.port)
        .user(&dsn.user)
        .dbname(&dsn.database)
        .application_name("outboxd_listen");
    if let Some(p) = &dsn.password {
        cfg.password(p);
    }
    let (client, mut conn) = cfg.connect(tokio_postgres::NoTls).await?;
    let mut messages = futures::stream::poll_fn(move |cx| conn.poll_message(cx));
    let driver = tokio::spawn(async move {
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
    });
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

/// Runs the poll loop until `shutdown`; the batch in flight is finished first.
pub async fn run(
    cfg: PollConfig,
    link: SourceLink,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let SourceLink { outlet, mut acks } = link;
    let mut client = connect_sql(&cfg.dsn, &format!("outboxd_{}_poll", cfg.name)).await?;
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
    let (wake_tx, mut wake) = watch::channel(0u64);
    if let Some(channel) = &cfg.notify_channel {
        listen(&cfg.dsn, channel, wake_tx).await?;
    }
    let id_index = rel
        .columns
        .iter()
        .position(|c| c.name == cfg.columns.get("id"))
        .expect("mapped above");
    let deadline_ms = cfg.deadline.as_millis().max(1000);
    let mut batch_no: u64 = 0;
    loop {
        if shutdown.is_cancelled() {
            return Ok(());
        }
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await?;
        // If this process stalls, the server ends the transaction and frees the rows.
        tx.batch_execute(&format!(
            "SET LOCAL datestyle = ISO; SET LOCAL timezone = 'UTC';
             SET LOCAL idle_in_transaction_session_timeout = '{}ms'; SET LOCAL lock_timeout = '{}ms'",
            deadline_ms * 2,
            deadline_ms
        ))
        .await?;
        let rows = tx.query(&claim, &[&cfg.batch]).await?;
        if rows.is_empty() {
            tx.commit().await?;
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(cfg.interval) => {}
                _ = wake.changed() => {}
            }
            continue;
        }
        batch_no += 1;
        let mut ids: Vec<Uuid> = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let tuple = crate::source::postgres::rows::text_tuple(row);
            if let Some(Value::Text(raw)) = tuple.get(id_index) {
                if let Ok(u) = std::str::from_utf8(raw).unwrap_or("").parse::<Uuid>() {
                    ids.push(u);
                }
            }
            if let Some(mut event) = mapper.insert(0, &tuple, 0, i as u32, 0)? {
                event.position = crate::event::SourcePosition::Poll {
                    batch: batch_no,
                    index: i as u32,
                };
                outlet.send_event(event).await?;
            }
        }
        outlet.send_checkpoint(Checkpoint::Batch(batch_no)).await?;
        let confirmed = tokio::time::timeout(cfg.deadline, async {
            loop {
                if let Some(Checkpoint::Batch(b)) = &*acks.borrow_and_update() {
                    if *b >= batch_no {
                        return true;
                    }
                }
                if acks.changed().await.is_err() {
                    return false;
                }
            }
        })
        .await;
        match confirmed {
            Ok(true) => {
                tx.execute(&mark, &[&ids]).await?;
                tx.commit().await?;
                tracing::debug!(
                    batch = batch_no,
                    rows = ids.len(),
                    "batch published and marked"
                );
            }
            Ok(false) => return Ok(()),
            Err(_) => {
                // Not confirmed in time: let the rows go; this or another relay publishes
                // them again (a duplicate, never a loss).
                tracing::warn!(batch = batch_no, rows = ids.len(), deadline = ?cfg.deadline, "batch not confirmed in time; releasing its rows");
                let _ = tx.rollback().await;
            }
        }
        if (rows.len() as i64) < cfg.batch {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(cfg.interval) => {}
                _ = wake.changed() => {}
            }
        }
    }
}
