//! The inbox on MySQL 8 / MariaDB (`mysql_async`): claim, stale gate and "claim, then effect"
//! inside the caller's transaction, and [`MyProcessor`] for the runner.
//!
//! The claim is `INSERT IGNORE`, which reports a repeat as 0 affected rows plus warning 1062
//! (duplicate key). `IGNORE` also turns other errors into warnings — a consumer name too long
//! for the column is silently cut, a NULL becomes a default — so every warning other than
//! 1062 fails the claim, and 0 rows count as a duplicate only when warning 1062 says so.

use super::{Claim, ConsumerError, Inbox, Message};
use crate::dsn::DbDsn;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, Transaction, TxOpts};
use std::future::Future;
use uuid::Uuid;

/// MySQL's "duplicate entry" error, which `INSERT IGNORE` reports as a warning.
const ER_DUP_ENTRY: u32 = 1062;

/// Maps a client error. Deadlock (1213), lock wait timeout (1205) and MariaDB's "record has
/// changed since last read" (1020, snapshot isolation) are conflicts; connection trouble is
/// retryable; a missing table says which migration creates it.
pub fn classify(e: mysql_async::Error) -> ConsumerError {
    use mysql_async::{DriverError, Error as E};
    match e {
        E::Server(s) => {
            let message = format!("{} (error {}, SQLSTATE {})", s.message, s.code, s.state);
            match s.code {
                1205 | 1213 | 1020 => ConsumerError::Conflict(message),
                1146 => ConsumerError::config(
                    message,
                    "create the inbox tables: mysql < migrations/mysql/003_processed_messages.sql",
                ),
                // The relay's own list (lock waits and deadlocks are conflicts, above).
                code if crate::db::mysql::is_retryable_code(code) => ConsumerError::Database {
                    message,
                    retryable: true,
                },
                _ => ConsumerError::Database {
                    message,
                    retryable: false,
                },
            }
        }
        E::Io(io) => ConsumerError::Database {
            message: format!("MySQL connection: {io}"),
            retryable: true,
        },
        E::Driver(
            d @ (DriverError::ConnectionClosed
            | DriverError::PacketOutOfOrder
            | DriverError::UnexpectedPacket { .. }
            | DriverError::PoolDisconnected),
        ) => ConsumerError::Database {
            message: format!("MySQL connection: {d}"),
            retryable: true,
        },
        other => ConsumerError::Database {
            message: format!("MySQL: {other}"),
            retryable: false,
        },
    }
}

/// Quotes `db`.`table` (or `table`, the session's database).
pub(crate) fn quoted(t: &crate::outbox::TableName) -> String {
    use crate::outbox::my_ident;
    match &t.schema {
        Some(db) => format!("{}.{}", my_ident(db), my_ident(&t.name)),
        None => my_ident(&t.name),
    }
}

/// The warnings of the last statement as (code, message); only called when the OK packet
/// counted some.
async fn warnings(tx: &mut Transaction<'_>) -> Result<Vec<(u32, String)>, ConsumerError> {
    let rows: Vec<(String, u32, String)> = tx.query("SHOW WARNINGS").await?;
    Ok(rows.into_iter().map(|(_, c, m)| (c, m)).collect())
}

/// `INSERT IGNORE` and its verdict: `Ok(true)` inserted, `Ok(false)` duplicate key, an error
/// for anything else `IGNORE` swallowed.
async fn insert_ignore(
    tx: &mut Transaction<'_>,
    sql: &str,
    params: mysql_async::Params,
    what: &str,
) -> Result<bool, ConsumerError> {
    tx.exec_drop(sql, params).await?;
    let affected = tx.affected_rows();
    let mut duplicate = false;
    if tx.get_warnings() > 0 {
        let list = warnings(tx).await?;
        duplicate = list.iter().any(|(c, _)| *c == ER_DUP_ENTRY);
        if let Some((code, text)) = list.iter().find(|(c, _)| *c != ER_DUP_ENTRY) {
            return Err(ConsumerError::config(
                format!("INSERT IGNORE into {what} reported warning {code}: {text} (IGNORE turned an error into a warning; the claim is not trusted)"),
                "check the consumer name (at most 100 bytes) and that the table matches migrations/mysql/003_processed_messages.sql",
            ));
        }
    }
    match (affected, duplicate) {
        (1, _) => Ok(true),
        (0, true) => Ok(false),
        _ => Err(ConsumerError::config(
            format!("INSERT IGNORE into {what} affected {affected} rows without a duplicate-key warning: cannot tell a repeat from a failure"),
            "make sure warnings are reported (max_error_count > 0) and the table's primary key is (consumer, …) as in migrations/mysql/003_processed_messages.sql",
        )),
    }
}

impl Inbox {
    /// Claims `id` for this consumer inside `tx`: `true` when this transaction inserted the
    /// row (run the effect), `false` when it was already there (a repeat: run nothing). A
    /// concurrent transaction holding the same id makes this wait for it (InnoDB's duplicate
    /// check locks the key): `false` if it committed, `true` if it rolled back.
    pub async fn claim_mysql(
        &self,
        tx: &mut Transaction<'_>,
        id: Uuid,
    ) -> Result<bool, ConsumerError> {
        let t = quoted(&self.processed);
        insert_ignore(
            tx,
            &format!("INSERT IGNORE INTO {t} (consumer, message_id) VALUES (?, ?)"),
            (self.consumer.as_str(), id.as_bytes().to_vec()).into(),
            &t,
        )
        .await
    }

    /// The stale gate (see [`Inbox::gate_pg`]): `None` = newer, recorded, apply; `Some(stored)`
    /// = not newer than the stored version, drop. The first message of an aggregate inserts
    /// its row; later ones update it only upwards (`version < ?`, which also makes the affected
    /// row count mean "advanced" whatever `CLIENT_FOUND_ROWS` says).
    pub async fn gate_mysql(
        &self,
        tx: &mut Transaction<'_>,
        aggregate_id: &str,
        version: i64,
    ) -> Result<Option<i64>, ConsumerError> {
        let Some(versions) = &self.versions else {
            return Ok(None);
        };
        let t = quoted(versions);
        let consumer = self.consumer.as_str();
        if insert_ignore(
            tx,
            &format!("INSERT IGNORE INTO {t} (consumer, aggregate_id, version) VALUES (?, ?, ?)"),
            (consumer, aggregate_id, version).into(),
            &t,
        )
        .await?
        {
            return Ok(None);
        }
        tx.exec_drop(
            format!("UPDATE {t} SET version = ?, updated_at = NOW(6) WHERE consumer = ? AND aggregate_id = ? AND version < ?"),
            (version, consumer, aggregate_id, version),
        )
        .await?;
        if tx.affected_rows() == 1 {
            return Ok(None);
        }
        let stored: Option<i64> = tx
            .exec_first(
                format!("SELECT version FROM {t} WHERE consumer = ? AND aggregate_id = ?"),
                (consumer, aggregate_id),
            )
            .await?;
        Ok(Some(stored.unwrap_or(version)))
    }

    /// Claim first, then the stale gate, then `effect`, all in `tx` (see [`Inbox::run_pg`]).
    pub async fn run_mysql<'a, 't, T, F, Fut>(
        &self,
        tx: &'a mut Transaction<'t>,
        msg: &Message,
        effect: F,
    ) -> Result<Claim<T>, ConsumerError>
    where
        F: FnOnce(&'a mut Transaction<'t>) -> Fut,
        Fut: Future<Output = Result<T, ConsumerError>> + 'a,
    {
        if !self.claim_mysql(tx, msg.id).await? {
            return Ok(Claim::Duplicate);
        }
        if let (true, Some(agg), Some(version)) =
            (self.stale_gate(), msg.aggregate_id.as_deref(), msg.version)
        {
            if let Some(applied) = self.gate_mysql(tx, agg, version).await? {
                return Ok(Claim::Stale { version, applied });
            }
        }
        effect(tx).await.map(Claim::Applied)
    }
}

/// The business effect of a MySQL/MariaDB consumer, run inside the inbox's transaction.
pub trait MyHandler: Send + Sync + 'static {
    fn handle(
        &self,
        tx: &mut Transaction<'_>,
        msg: &Message,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send;
}

/// Connects a session the way the relay does (TLS per the DSN's `ssl-mode`, bounded).
pub async fn connect(dsn: &DbDsn) -> Result<Conn, ConsumerError> {
    Ok(crate::db::mysql::connect_sql(dsn).await?)
}

/// One connection and one transaction per message on MySQL/MariaDB (see
/// [`super::postgres::PgProcessor`]).
pub struct MyProcessor<H> {
    dsn: DbDsn,
    conn: Option<Conn>,
    inbox: Inbox,
    handler: H,
    isolation: Option<IsolationLevel>,
    bare: bool,
}

impl<H: MyHandler> MyProcessor<H> {
    pub fn new(dsn: DbDsn, inbox: Inbox, handler: H) -> Self {
        MyProcessor {
            dsn,
            conn: None,
            inbox,
            handler,
            isolation: None,
            bare: false,
        }
    }

    /// Runs each transaction at this isolation level (default: the server's, REPEATABLE READ).
    pub fn isolation(mut self, level: IsolationLevel) -> Self {
        self.isolation = Some(level);
        self
    }

    /// Skips the claim (benchmarks only: a repeat runs its effect again).
    pub fn without_inbox(mut self) -> Self {
        self.bare = true;
        self
    }

    pub fn handler(&self) -> &H {
        &self.handler
    }
}

impl<H: MyHandler> MyProcessor<H> {
    /// `msgs` in one transaction (see `PgProcessor`).
    async fn transaction(
        &mut self,
        msgs: &[Message],
    ) -> Result<Vec<Claim<()>>, (usize, ConsumerError)> {
        if self.conn.is_none() {
            self.conn = Some(connect(&self.dsn).await.map_err(|e| (0, e))?);
        }
        let Some(conn) = self.conn.as_mut() else {
            unreachable!("connected above")
        };
        let result = async {
            let mut opts = TxOpts::default();
            if let Some(level) = self.isolation {
                opts.with_isolation_level(level);
            }
            let mut tx = conn
                .start_transaction(opts)
                .await
                .map_err(|e| (0, e.into()))?;
            let mut claims = Vec::with_capacity(msgs.len());
            for (i, msg) in msgs.iter().enumerate() {
                let claim = if self.bare {
                    self.handler.handle(&mut tx, msg).await.map(Claim::Applied)
                } else {
                    let handler = &self.handler;
                    self.inbox
                        .run_mysql(&mut tx, msg, |tx| handler.handle(tx, msg))
                        .await
                };
                claims.push(claim.map_err(|e| (i, e))?);
            }
            tx.commit().await.map_err(|e| (0, e.into()))?;
            Ok(claims)
        }
        .await;
        if let Err((_, e)) = &result {
            if e.session_lost() {
                // Dropping the connection also ends a transaction left open by the error.
                self.conn = None;
            }
        }
        result
    }
}

impl<H: MyHandler> super::Processor for MyProcessor<H> {
    async fn process(&mut self, msg: &Message) -> Result<Claim<()>, ConsumerError> {
        self.transaction(std::slice::from_ref(msg))
            .await
            .map(|mut c| c.remove(0))
            .map_err(|(_, e)| e)
    }

    /// One transaction for the batch; when message `i` fails, the first `i` are committed in a
    /// new transaction and `i` is reported.
    async fn process_batch(&mut self, msgs: &[Message]) -> super::runner::BatchResult {
        use super::runner::BatchResult;
        match self.transaction(msgs).await {
            Ok(committed) => BatchResult {
                committed,
                failed: None,
            },
            Err((i, e)) if i > 0 => match self.transaction(&msgs[..i]).await {
                Ok(committed) => BatchResult {
                    committed,
                    failed: Some(e),
                },
                Err((_, e)) => BatchResult {
                    committed: Vec::new(),
                    failed: Some(e),
                },
            },
            Err((_, e)) => BatchResult {
                committed: Vec::new(),
                failed: Some(e),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_server_errors() {
        let server = |code| {
            classify(mysql_async::Error::Server(mysql_async::ServerError {
                code,
                message: "m".into(),
                state: "HY000".into(),
            }))
        };
        assert!(matches!(server(1213), ConsumerError::Conflict(_)));
        assert!(matches!(server(1205), ConsumerError::Conflict(_)));
        assert!(matches!(server(1146), ConsumerError::Config { .. }));
        assert!(server(4031).is_retryable());
        assert!(!server(1064).is_retryable());
        let t = crate::outbox::TableName::parse("app.processed_messages").unwrap();
        assert_eq!(quoted(&t), "`app`.`processed_messages`");
    }

    #[test]
    fn migration_matches_the_inbox_statements() {
        let ddl = include_str!("../../migrations/mysql/003_processed_messages.sql");
        for needle in [
            "PRIMARY KEY (consumer, message_id)",
            "message_id    BINARY(16)",
            "(processed_at)",
            "PRIMARY KEY (consumer, aggregate_id)",
        ] {
            assert!(ddl.contains(needle), "{needle}");
        }
    }
}
