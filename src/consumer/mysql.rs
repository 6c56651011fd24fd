//! The inbox on MySQL 8 / MariaDB (`mysql_async`): the claim and stale-gate statements
//! ([`InboxBackend`] for `Transaction`), error classification, and [`Mysql`], which lets
//! [`super::processor::InboxProcessor`] run one transaction per message on its own connection.
//!
//! The claim is `INSERT IGNORE`, which reports a repeat as 0 affected rows plus warning 1062
//! (duplicate key). `IGNORE` also turns other errors into warnings — a consumer name too long
//! for the column is silently cut, a NULL becomes a default — so every warning other than
//! 1062 fails the claim, and 0 rows count as a duplicate only when warning 1062 says so.
//! Whose fault such a warning is decides what follows: an `x-aggregate-id` or
//! `x-aggregate-type` longer than its gate column is the message's data (it goes to
//! `--on-poison`, like error 1406 would); anything else stops the consumer with the fix.

use super::inbox::{Aggregate, InboxBackend};
use super::processor::Database;
use super::ConsumerError;
use crate::dsn::DbDsn;
use crate::outbox::TableName;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, Transaction, TxOpts};
use uuid::Uuid;

/// MySQL's "duplicate entry" error, which `INSERT IGNORE` reports as a warning.
const ER_DUP_ENTRY: u32 = 1062;

/// Maps a client error. A server error goes by its error number and SQLSTATE
/// ([`super::fault::classify_sql`], shared with Postgres); a missing table says which
/// migration creates the inbox tables; connection trouble is retryable.
pub fn classify(e: mysql_async::Error) -> ConsumerError {
    use mysql_async::{DriverError, Error as E};
    match e {
        E::Server(s) => {
            let message = format!("{} (error {}, SQLSTATE {})", s.message, s.code, s.state);
            match s.code {
                1146 => ConsumerError::config(
                    message,
                    "create the inbox tables: mysql < migrations/mysql/003_processed_messages.sql (and the handler's own tables)",
                ),
                code => super::fault::to_error(message, &s.state, Some(code)),
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
pub(crate) fn quoted(t: &TableName) -> String {
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

/// What an `INSERT IGNORE` did.
enum Ignored {
    Inserted,
    /// Duplicate key (warning 1062 alone).
    Duplicate,
    /// Another warning, as (code, message): `IGNORE` turned an error into it, and the row (if
    /// any) is not what was asked for.
    Warned(u32, String),
}

/// Warnings of a value cut to its column's width: "data truncated", "data too long".
const TRUNCATED: &[u32] = &[1265, 1406];

/// `INSERT IGNORE` and its verdict; an error when the row count and warnings disagree.
async fn insert_ignore(
    tx: &mut Transaction<'_>,
    sql: &str,
    params: mysql_async::Params,
    what: &str,
) -> Result<Ignored, ConsumerError> {
    tx.exec_drop(sql, params).await?;
    let affected = tx.affected_rows();
    let mut duplicate = false;
    if tx.get_warnings() > 0 {
        let list = warnings(tx).await?;
        duplicate = list.iter().any(|(c, _)| *c == ER_DUP_ENTRY);
        if let Some((code, text)) = list.into_iter().find(|(c, _)| *c != ER_DUP_ENTRY) {
            return Ok(Ignored::Warned(code, text));
        }
    }
    match (affected, duplicate) {
        (1, _) => Ok(Ignored::Inserted),
        (0, true) => Ok(Ignored::Duplicate),
        _ => Err(ConsumerError::config(
            format!("INSERT IGNORE into {what} affected {affected} rows without a duplicate-key warning: cannot tell a repeat from a failure"),
            "make sure warnings are reported (max_error_count > 0) and the table's primary key is (consumer, …) as in migrations/mysql/003_processed_messages.sql",
        )),
    }
}

/// The stop for a warning no message causes (the transaction is not committed).
fn untrusted(what: &str, code: u32, text: &str) -> ConsumerError {
    ConsumerError::config(
        format!("INSERT IGNORE into {what} reported warning {code}: {text} (IGNORE turned an error into a warning; the claim is not trusted)"),
        "check the consumer name (at most 100 bytes) and that the table matches migrations/mysql/003_processed_messages.sql",
    )
}

/// After a truncation warning from the stale gate's insert: which value is longer than its
/// column, from the catalog's widths (bytes for `VARBINARY`, characters for a `VARCHAR` an
/// older release created) — never from the warning's wording. The consumer name is
/// configuration, so its overflow stops the consumer; the aggregate's type or id come with the
/// message, so theirs is the message's data (classified as error 1406, SQLSTATE 22001), and
/// the message goes to `--on-poison` while the others go on.
async fn gate_overflow(
    tx: &mut Transaction<'_>,
    table: &TableName,
    values: [(&str, &str, &str); 4],
) -> Result<Option<ConsumerError>, ConsumerError> {
    let cols: Vec<(String, String, Option<u64>)> = tx
        .exec(
            "SELECT COLUMN_NAME, DATA_TYPE, CHARACTER_MAXIMUM_LENGTH FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
            (table.schema.as_deref(), table.name.as_str()),
        )
        .await?;
    let t = quoted(table);
    for (column, header, value) in values {
        let Some((_, ty, Some(max))) = cols.iter().find(|(c, _, _)| c.eq_ignore_ascii_case(column))
        else {
            continue;
        };
        let (len, unit) = if ty.to_ascii_lowercase().contains("binary") {
            (value.len() as u64, "bytes")
        } else {
            (value.chars().count() as u64, "characters")
        };
        if len <= *max {
            continue;
        }
        let problem = format!(
            "{header} is {len} {unit}, longer than column {column} of {t} holds ({max} {unit}); the stale gate cannot record it"
        );
        return Ok(Some(if column == "consumer" {
            ConsumerError::config(
                problem,
                format!("give the consumer a name of at most {max} {unit}, or widen {t}.consumer as in migrations/mysql/003_processed_messages.sql"),
            )
        } else {
            super::fault::to_error(problem, "22001", Some(1406))
        }));
    }
    Ok(None)
}

impl InboxBackend for Transaction<'_> {
    /// `INSERT IGNORE`, trusted only as far as its warnings allow (see the module comment).
    /// InnoDB's duplicate check locks the key, so a concurrent claim of the same id waits.
    async fn insert_claim(
        &mut self,
        table: &TableName,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, ConsumerError> {
        let t = quoted(table);
        match insert_ignore(
            self,
            &format!("INSERT IGNORE INTO {t} (consumer, message_id) VALUES (?, ?)"),
            (consumer, id.as_bytes().to_vec()).into(),
            &t,
        )
        .await?
        {
            Ignored::Inserted => Ok(true),
            Ignored::Duplicate => Ok(false),
            Ignored::Warned(code, text) => Err(untrusted(&t, code, &text)),
        }
    }

    /// The first message of an aggregate inserts its row; later ones update it only upwards
    /// (`version < ?`, which also makes the affected row count mean "advanced" whatever
    /// `CLIENT_FOUND_ROWS` says). The key columns are `VARBINARY`: compared byte for byte, not
    /// by a collation that would merge `ORD-a` with `ord-A` or `café` with `cafe `.
    async fn advance_version(
        &mut self,
        table: &TableName,
        consumer: &str,
        aggregate: Aggregate<'_>,
        version: i64,
    ) -> Result<Option<i64>, ConsumerError> {
        let t = quoted(table);
        let Aggregate {
            table: outbox_table,
            kind: aggregate_type,
            id: aggregate_id,
        } = aggregate;
        match insert_ignore(
            self,
            &format!("INSERT IGNORE INTO {t} (consumer, outbox_table, aggregate_type, aggregate_id, version) VALUES (?, ?, ?, ?, ?)"),
            (consumer, outbox_table, aggregate_type, aggregate_id, version).into(),
            &t,
        )
        .await?
        {
            Ignored::Inserted => return Ok(None),
            Ignored::Duplicate => {}
            Ignored::Warned(code, text) => {
                let values = [
                    ("consumer", "the consumer name", consumer),
                    ("outbox_table", "x-outbox-table", outbox_table),
                    ("aggregate_type", "x-aggregate-type", aggregate_type),
                    ("aggregate_id", "x-aggregate-id", aggregate_id),
                ];
                if TRUNCATED.contains(&code) {
                    if let Some(e) = gate_overflow(self, table, values).await? {
                        return Err(e);
                    }
                }
                return Err(untrusted(&t, code, &text));
            }
        }
        self.exec_drop(
            format!("UPDATE {t} SET version = ?, updated_at = NOW(6) WHERE consumer = ? AND outbox_table = ? AND aggregate_type = ? AND aggregate_id = ? AND version < ?"),
            (version, consumer, outbox_table, aggregate_type, aggregate_id, version),
        )
        .await?;
        if self.affected_rows() == 1 {
            return Ok(None);
        }
        let stored: Option<i64> = self
            .exec_first(
                format!("SELECT version FROM {t} WHERE consumer = ? AND outbox_table = ? AND aggregate_type = ? AND aggregate_id = ?"),
                (consumer, outbox_table, aggregate_type, aggregate_id),
            )
            .await?;
        Ok(Some(stored.unwrap_or(version)))
    }
}

/// Connects a session the way the relay does (TLS per the DSN's `ssl-mode`, bounded).
pub async fn connect(dsn: &DbDsn) -> Result<Conn, ConsumerError> {
    Ok(crate::db::mysql::connect_sql(dsn).await?)
}

/// MySQL/MariaDB for [`super::processor::InboxProcessor`]: a `mysql_async::Conn` per processor.
#[derive(Debug, Clone, Copy)]
pub enum Mysql {}

impl Database for Mysql {
    type Session = Conn;
    type Tx<'s> = Transaction<'s>;
    type Isolation = IsolationLevel;

    /// MySQL has no application name to set here; the session is named by its user and host.
    async fn connect(dsn: &DbDsn, _application: &str) -> Result<Conn, ConsumerError> {
        connect(dsn).await
    }

    /// A `Conn` cannot tell a dead connection without a round trip; the first statement on it
    /// fails as a lost session instead, and the processor drops it then.
    fn usable(_session: &Conn) -> bool {
        true
    }

    async fn begin(
        session: &mut Conn,
        isolation: Option<IsolationLevel>,
    ) -> Result<Transaction<'_>, ConsumerError> {
        let mut opts = TxOpts::default();
        if let Some(level) = isolation {
            opts.with_isolation_level(level);
        }
        Ok(session.start_transaction(opts).await?)
    }

    async fn commit(tx: Self::Tx<'_>) -> Result<(), ConsumerError> {
        Ok(tx.commit().await?)
    }
}

/// [`super::processor::InboxProcessor`] on MySQL/MariaDB.
pub type MyProcessor<H> = super::processor::InboxProcessor<Mysql, H>;

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
        assert!(
            server(1290).is_retryable(),
            "--read-only is retried, as on Postgres"
        );
        assert!(matches!(server(1064), ConsumerError::Config { .. }));
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
            "PRIMARY KEY (consumer, outbox_table, aggregate_type, aggregate_id)",
            "consumer      VARBINARY(100)",
        ] {
            assert!(ddl.contains(needle), "{needle}");
        }
    }
}
