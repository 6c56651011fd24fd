//! Poll mode on MySQL/MariaDB: the MySQL side of the shared poll loop
//! ([`crate::source::poll`]). The reference table and statements: `SELECT … WHERE status =
//! 'pending' ORDER BY created_at, id LIMIT n FOR UPDATE SKIP LOCKED` (`seq` instead of `id`
//! when the table has it) on `idx_dispatch (status, created_at)` in a READ COMMITTED
//! transaction (no gap locks, so producers' INSERTs never wait for it), then `UPDATE … SET
//! status = 'published', published_at = …` for the claimed ids. Rows are read with a prepared
//! statement (binary protocol) and mapped by the same column rules as binlog rows and the
//! first-start snapshot.

use super::rows::{Mapping, OutboxTable, RowContext};
use super::{connect_sql, snapshot};
use crate::dsn::DbDsn;
use crate::event::OutboxEvent;
use crate::outbox::{my_ident, Column};
use crate::source::poll::{LoopConfig, PollTable};
use crate::telemetry::events::SourceKind;
use crate::Error;
use mysql_async::binlog::value::BinlogValue;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Params, Row, Value};
use std::time::Duration;

/// The MySQL side of the loop: one session, one transaction per batch.
pub(crate) struct MyPoll {
    conn: Conn,
    table: OutboxTable,
    mapping: Mapping,
    claim: String,
    mark_prefix: String,
    id_index: usize,
}

/// The fix for a table without the poll columns.
pub(crate) fn status_fix(table: &OutboxTable) -> String {
    format!(
        "ALTER TABLE {} ADD COLUMN status ENUM('pending','published') NOT NULL DEFAULT 'pending', ADD COLUMN published_at DATETIME(6) NULL, ADD KEY idx_dispatch (status, created_at);",
        table.quoted()
    )
}

/// The server's `innodb_lock_wait_timeout` (what producers wait for a row lock).
pub(crate) async fn lock_wait_timeout(conn: &mut Conn) -> Result<Duration, Error> {
    let secs: Option<u64> = conn
        .query_first("SELECT @@GLOBAL.innodb_lock_wait_timeout")
        .await?;
    Ok(Duration::from_secs(secs.unwrap_or(50)))
}

/// The batch deadline: the confirm timeout, but always shorter than the server's lock wait
/// timeout, so a producer that does wait for a claimed row gives up later than the relay.
pub(crate) fn deadline(confirm_timeout: Duration, lock_wait: Duration) -> Duration {
    let below_lock_wait = lock_wait.saturating_sub(Duration::from_secs(1));
    confirm_timeout
        .min(below_lock_wait)
        .max(Duration::from_secs(1))
}

impl MyPoll {
    pub(crate) async fn open(
        dsn: &DbDsn,
        table: &OutboxTable,
        run: &LoopConfig,
    ) -> Result<MyPoll, Error> {
        let mut conn = connect_sql(dsn).await?;
        let infos = snapshot::table_columns(&mut conn, table).await?;
        let mapping = table.map_columns(&infos)?;
        let has = |logical: Column| {
            let actual = table.columns.get(logical);
            infos
                .iter()
                .position(|c| c.name.eq_ignore_ascii_case(actual))
        };
        if has(Column::Status).is_none() || has(Column::PublishedAt).is_none() {
            return Err(Error::config(
                format!(
                    "poll mode needs the columns {} and {} on {}",
                    table.columns.get(Column::Status),
                    table.columns.get(Column::PublishedAt),
                    table.quoted()
                ),
                status_fix(table),
            ));
        }
        let id_index = has(Column::Id).expect("mapped above");
        let select: Vec<String> = infos.iter().map(|c| my_ident(&c.name)).collect();
        // Rows with one `created_at` (a multi-row INSERT shares one `NOW(6)`; a clock's
        // microsecond can hold two statements) need a tie-break that rises with insert order,
        // or they come back in whatever order the index or a sort leaves them: a `seq` column
        // (AUTO_INCREMENT) when the table has one, else the id, which `Outbox::write` draws as
        // a UUID v7 rising within the producer process. The id costs nothing: InnoDB's
        // `idx_dispatch (status, created_at)` ends with the primary key, so the index walk
        // already yields that order.
        let tie_break = if has(Column::Seq).is_some() {
            Column::Seq
        } else {
            Column::Id
        };
        let claim = format!(
            "SELECT {} FROM {} WHERE {} = 'pending' ORDER BY {}, {} LIMIT ? FOR UPDATE SKIP LOCKED",
            select.join(", "),
            table.quoted(),
            my_ident(table.columns.get(Column::Status)),
            my_ident(table.columns.get(Column::CreatedAt)),
            my_ident(table.columns.get(tie_break)),
        );
        let mark_prefix = format!(
            "UPDATE {} SET {} = 'published', {} = ? WHERE {} IN ",
            table.quoted(),
            my_ident(table.columns.get(Column::Status)),
            my_ident(table.columns.get(Column::PublishedAt)),
            my_ident(table.columns.get(Column::Id)),
        );
        let secs = run.deadline.as_secs().max(1);
        conn.query_drop("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .await?;
        // TIMESTAMP values in UTC, as the stream and the snapshot read them.
        conn.query_drop("SET time_zone = '+00:00'").await?;
        conn.query_drop(format!("SET SESSION innodb_lock_wait_timeout = {secs}"))
            .await?;
        // MariaDB: if this process stalls inside a batch, the server ends the transaction and
        // frees the rows. (MySQL has no such setting; the deadline alone bounds it there.)
        match conn
            .query_drop(format!(
                "SET SESSION idle_transaction_timeout = {}",
                secs * 2
            ))
            .await
        {
            Err(e) if super::server_code(&e) == Some(1193) => {}
            other => other?,
        }
        Ok(MyPoll {
            conn,
            table: table.clone(),
            mapping,
            claim,
            mark_prefix,
            id_index,
        })
    }
}

/// The loop's [`SESSIONS`](crate::source::poll::SESSIONS) sessions.
pub(crate) async fn open_sessions(
    dsn: &DbDsn,
    table: &OutboxTable,
    run: &LoopConfig,
) -> Result<Vec<MyPoll>, Error> {
    let mut dbs = Vec::with_capacity(crate::source::poll::SESSIONS);
    for _ in 0..crate::source::poll::SESSIONS {
        dbs.push(MyPoll::open(dsn, table, run).await?);
    }
    Ok(dbs)
}

impl PollTable for MyPoll {
    type Id = Value;
    const SOURCE: SourceKind = SourceKind::MySql;

    async fn begin(&mut self) -> Result<(), Error> {
        Ok(self.conn.query_drop("START TRANSACTION").await?)
    }

    async fn claim(&mut self, limit: i64) -> Result<Vec<(Value, OutboxEvent)>, Error> {
        let rows: Vec<Row> = self.conn.exec(&self.claim, (limit,)).await?;
        let mut out = Vec::with_capacity(rows.len());
        for (i, row) in rows.into_iter().enumerate() {
            let values: Vec<BinlogValue<'static>> =
                row.unwrap().into_iter().map(BinlogValue::Value).collect();
            // The id as the server sent it: the mark names the row by the same value.
            let Some(BinlogValue::Value(id)) = values.get(self.id_index).cloned() else {
                return Err(Error::Decode(format!(
                    "a claimed row of {} has no id column value",
                    self.table.quoted()
                )));
            };
            let event = self.mapping.event_from(
                |c| values.get(c),
                RowContext {
                    file: "",
                    index: i as u32,
                    gtid: None,
                    committed_at: None,
                },
                self.table.tz,
            );
            out.push((id, event));
        }
        Ok(out)
    }

    async fn mark(&mut self, ids: &[Value]) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let marks = vec!["?"; ids.len()].join(", ");
        let now = self
            .table
            .tz
            .from_utc(chrono::Utc::now())
            .format("%Y-%m-%d %H:%M:%S%.6f")
            .to_string();
        let mut params = Vec::with_capacity(ids.len() + 1);
        params.push(Value::from(now));
        params.extend(ids.iter().cloned());
        self.conn
            .exec_drop(
                format!("{}({marks})", self.mark_prefix),
                Params::Positional(params),
            )
            .await?;
        Ok(())
    }

    async fn commit(&mut self) -> Result<(), Error> {
        Ok(self.conn.query_drop("COMMIT").await?)
    }

    async fn rollback(&mut self) -> Result<(), Error> {
        Ok(self.conn.query_drop("ROLLBACK").await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_stays_below_the_lock_wait_timeout() {
        let s = Duration::from_secs;
        assert_eq!(deadline(s(30), s(50)), s(30));
        assert_eq!(deadline(s(30), s(10)), s(9));
        assert_eq!(deadline(s(30), s(1)), s(1));
    }
}
