//! The inbox on Postgres (`tokio-postgres`): the claim and stale-gate statements
//! ([`InboxBackend`] for `Transaction`), error classification, and [`Postgres`], which lets
//! [`super::processor::InboxProcessor`] run one transaction per message on its own connection.
//!
//! Statements go out with `query_typed`/`execute_typed` (parameter types given): one round trip
//! each, no prepared-statement cache to keep per connection.

use super::inbox::{Aggregate, InboxBackend};
use super::processor::Database;
use super::ConsumerError;
use crate::dsn::DbDsn;
use crate::outbox::TableName;
use tokio_postgres::types::Type;
use tokio_postgres::{IsolationLevel, Transaction};
use uuid::Uuid;

/// Maps a client error. A server error goes by its SQLSTATE ([`super::fault::classify_sql`],
/// shared with MySQL); a missing table says which migration creates the inbox tables; an
/// error without a SQLSTATE (the connection is gone, an I/O error) is retryable when the
/// connection is the problem.
pub fn classify(e: &tokio_postgres::Error) -> ConsumerError {
    let message = crate::db::postgres::describe_pg_error(e);
    match e.code().map(|c| c.code()) {
        Some("42P01") => ConsumerError::config(
            message,
            "create the inbox tables: psql -f migrations/postgres/003_processed_messages.sql (and the handler's own tables)",
        ),
        Some(state) => super::fault::to_error(message, state, None),
        None => ConsumerError::Database {
            message,
            retryable: crate::db::postgres::is_retryable_pg(e),
        },
    }
}

impl InboxBackend for Transaction<'_> {
    /// `ON CONFLICT DO NOTHING`: 1 row inserted is the claim, 0 a repeat. The unique index
    /// makes a concurrent insert of the same key wait for the other transaction to end.
    async fn insert_claim(
        &mut self,
        table: &TableName,
        consumer: &str,
        id: Uuid,
    ) -> Result<bool, ConsumerError> {
        let sql = format!(
            "INSERT INTO {} (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            table.pg_quoted()
        );
        let n = self
            .execute_typed(&sql, &[(&consumer, Type::TEXT), (&id, Type::UUID)])
            .await?;
        Ok(n == 1)
    }

    /// One upsert that only moves the version upwards (its `WHERE` makes "1 row" mean
    /// "advanced"); when it did not, the stored version is read back for the caller. Text
    /// equality is exact on Postgres (a deterministic collation, "C" in the migration).
    async fn advance_version(
        &mut self,
        table: &TableName,
        consumer: &str,
        aggregate: Aggregate<'_>,
        version: i64,
    ) -> Result<Option<i64>, ConsumerError> {
        let t = table.pg_quoted();
        let Aggregate {
            table: outbox_table,
            kind: aggregate_type,
            id: aggregate_id,
        } = aggregate;
        let advanced = self
            .execute_typed(
                &format!(
                    "INSERT INTO {t} AS v (consumer, outbox_table, aggregate_type, aggregate_id, version)
                     VALUES ($1, $5, $2, $3, $4)
                     ON CONFLICT (consumer, outbox_table, aggregate_type, aggregate_id)
                     DO UPDATE SET version = EXCLUDED.version, updated_at = now()
                     WHERE v.version < EXCLUDED.version"
                ),
                &[
                    (&consumer, Type::TEXT),
                    (&aggregate_type, Type::TEXT),
                    (&aggregate_id, Type::TEXT),
                    (&version, Type::INT8),
                    (&outbox_table, Type::TEXT),
                ],
            )
            .await?;
        if advanced == 1 {
            return Ok(None);
        }
        let row = self
            .query_typed_one(
                &format!("SELECT version FROM {t} WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 AND outbox_table = $4"),
                &[
                    (&consumer, Type::TEXT),
                    (&aggregate_type, Type::TEXT),
                    (&aggregate_id, Type::TEXT),
                    (&outbox_table, Type::TEXT),
                ],
            )
            .await?;
        Ok(Some(row.get(0)))
    }
}

/// Postgres for [`super::processor::InboxProcessor`]: a `tokio_postgres::Client` per
/// processor, named `outboxd_consumer_<consumer>` in `pg_stat_activity`.
#[derive(Debug, Clone, Copy)]
pub enum Postgres {}

impl Database for Postgres {
    type Session = tokio_postgres::Client;
    type Tx<'s> = Transaction<'s>;
    type Isolation = IsolationLevel;

    async fn connect(dsn: &DbDsn, application: &str) -> Result<Self::Session, ConsumerError> {
        Ok(crate::db::postgres::connect_sql(dsn, application).await?)
    }

    /// The client knows when its connection task ended (server gone, network cut).
    fn usable(session: &Self::Session) -> bool {
        !session.is_closed()
    }

    async fn begin(
        session: &mut Self::Session,
        isolation: Option<IsolationLevel>,
    ) -> Result<Transaction<'_>, ConsumerError> {
        let mut b = session.build_transaction();
        if let Some(level) = isolation {
            b = b.isolation_level(level);
        }
        Ok(b.start().await?)
    }

    async fn commit(tx: Self::Tx<'_>) -> Result<(), ConsumerError> {
        Ok(tx.commit().await?)
    }
}

/// [`super::processor::InboxProcessor`] on Postgres.
pub type PgProcessor<H> = super::processor::InboxProcessor<Postgres, H>;

#[cfg(test)]
mod tests {
    #[test]
    fn migration_matches_the_inbox_statements() {
        let ddl = include_str!("../../migrations/postgres/003_processed_messages.sql");
        for needle in [
            "processed_messages",
            "PRIMARY KEY (consumer, message_id)",
            "(processed_at)",
            "consumer_aggregate_versions",
            "PRIMARY KEY (consumer, outbox_table, aggregate_type, aggregate_id)",
        ] {
            assert!(ddl.contains(needle), "{needle}");
        }
    }
}
