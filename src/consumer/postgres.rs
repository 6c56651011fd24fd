//! The inbox on Postgres (`tokio-postgres`): claim, stale gate and "claim, then effect" inside
//! the caller's transaction, and [`PgProcessor`], which gives the runner one transaction per
//! message on its own connection.
//!
//! Statements go out with `query_typed`/`execute_typed` (parameter types given): one round trip
//! each, no prepared-statement cache to keep per connection.

use super::{Claim, ConsumerError, Inbox, Message};
use crate::dsn::DbDsn;
use std::future::Future;
use tokio_postgres::types::Type;
use tokio_postgres::{IsolationLevel, Transaction};
use uuid::Uuid;

/// Maps a client error: conflicts (serialization failure 40001, deadlock 40P01, lock not
/// available 55P03) are [`ConsumerError::Conflict`]; lost connections and server shutdowns are
/// retryable; a missing inbox table says which migration creates it.
pub fn classify(e: &tokio_postgres::Error) -> ConsumerError {
    let message = crate::db::postgres::describe_pg_error(e);
    match e.code().map(|c| c.code()) {
        Some("40001" | "40P01" | "55P03") => ConsumerError::Conflict(message),
        Some("42P01") => ConsumerError::config(
            message,
            "create the inbox tables: psql -f migrations/postgres/003_processed_messages.sql",
        ),
        _ => ConsumerError::Database {
            message,
            retryable: crate::db::postgres::is_retryable_pg(e),
        },
    }
}

impl Inbox {
    /// Claims `id` for this consumer inside `tx`: `true` when this transaction inserted the
    /// row (run the effect), `false` when it was already there (a repeat: run nothing).
    ///
    /// A concurrent transaction holding the same id makes this wait until it ends; then the
    /// answer is `false` if it committed and `true` if it rolled back. Under REPEATABLE READ or
    /// SERIALIZABLE a row committed after this transaction's snapshot is a serialization
    /// failure instead ([`ConsumerError::Conflict`]): run the transaction again and it is a
    /// plain duplicate.
    pub async fn claim_pg(&self, tx: &Transaction<'_>, id: Uuid) -> Result<bool, ConsumerError> {
        let sql = format!(
            "INSERT INTO {} (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            self.processed.pg_quoted()
        );
        let n = tx
            .execute_typed(&sql, &[(&self.consumer, Type::TEXT), (&id, Type::UUID)])
            .await?;
        Ok(n == 1)
    }

    /// The stale gate: records `version` as the last applied one of `aggregate_id` when it is
    /// newer than what is stored, and returns `None` (apply); returns `Some(stored)` when the
    /// stored version is the same or newer (drop). The upsert locks the aggregate's row, so
    /// concurrent messages of one aggregate are decided one after the other.
    pub async fn gate_pg(
        &self,
        tx: &Transaction<'_>,
        aggregate_id: &str,
        version: i64,
    ) -> Result<Option<i64>, ConsumerError> {
        let Some(versions) = &self.versions else {
            return Ok(None);
        };
        let t = versions.pg_quoted();
        let advanced = tx
            .execute_typed(
                &format!(
                    "INSERT INTO {t} AS v (consumer, aggregate_id, version) VALUES ($1, $2, $3)
                     ON CONFLICT (consumer, aggregate_id)
                     DO UPDATE SET version = EXCLUDED.version, updated_at = now()
                     WHERE v.version < EXCLUDED.version"
                ),
                &[
                    (&self.consumer, Type::TEXT),
                    (&aggregate_id, Type::TEXT),
                    (&version, Type::INT8),
                ],
            )
            .await?;
        if advanced == 1 {
            return Ok(None);
        }
        let row = tx
            .query_typed_one(
                &format!("SELECT version FROM {t} WHERE consumer = $1 AND aggregate_id = $2"),
                &[(&self.consumer, Type::TEXT), (&aggregate_id, Type::TEXT)],
            )
            .await?;
        Ok(Some(row.get(0)))
    }

    /// Claim first, then the stale gate (when on and the message has an aggregate and a
    /// version), then `effect` — all in `tx`, which the caller commits (and only then acks).
    /// A repeat returns [`Claim::Duplicate`] and `effect` never runs; an error from `effect`
    /// comes back as is, and the caller rolls back, which also releases the claim.
    ///
    /// ```no_run
    /// # async fn f(client: &mut tokio_postgres::Client, msg: &outboxd::consumer::Message) -> Result<(), outboxd::consumer::ConsumerError> {
    /// let inbox = outboxd::consumer::Inbox::new("billing")?;
    /// let tx = client.transaction().await?;
    /// let claim = inbox
    ///     .run_pg(&tx, msg, |tx| async move {
    ///         tx.execute("UPDATE totals SET n = n + 1", &[]).await?;
    ///         Ok(())
    ///     })
    ///     .await?;
    /// tx.commit().await?; // then ack
    /// # let _ = claim; Ok(()) }
    /// ```
    pub async fn run_pg<'a, T, F, Fut>(
        &self,
        tx: &'a Transaction<'a>,
        msg: &Message,
        effect: F,
    ) -> Result<Claim<T>, ConsumerError>
    where
        F: FnOnce(&'a Transaction<'a>) -> Fut,
        Fut: Future<Output = Result<T, ConsumerError>> + 'a,
    {
        if !self.claim_pg(tx, msg.id).await? {
            return Ok(Claim::Duplicate);
        }
        if let (true, Some(agg), Some(version)) =
            (self.stale_gate(), msg.aggregate_id.as_deref(), msg.version)
        {
            if let Some(applied) = self.gate_pg(tx, agg, version).await? {
                return Ok(Claim::Stale { version, applied });
            }
        }
        effect(tx).await.map(Claim::Applied)
    }
}

/// The business effect of a Postgres consumer, run inside the inbox's transaction. Use `tx` for
/// every write that belongs to the effect; return [`ConsumerError::transient`] for failures
/// that may pass and [`ConsumerError::permanent`] (or any non-retryable error) for the rest.
pub trait PgHandler: Send + Sync + 'static {
    fn handle(
        &self,
        tx: &Transaction<'_>,
        msg: &Message,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send;
}

/// One connection and one transaction per message: begin, [`Inbox::run_pg`] with the handler,
/// commit. The runner acks after `process` returns. Reconnects lazily after a lost session.
pub struct PgProcessor<H> {
    dsn: DbDsn,
    application: String,
    client: Option<tokio_postgres::Client>,
    inbox: Inbox,
    handler: H,
    isolation: Option<IsolationLevel>,
    /// Without the inbox: the effect alone in a transaction (for measuring what the inbox
    /// costs; never for production, where repeats would run twice).
    bare: bool,
}

impl<H: PgHandler> PgProcessor<H> {
    pub fn new(dsn: DbDsn, inbox: Inbox, handler: H) -> Self {
        PgProcessor {
            application: format!("outboxd_consumer_{}", inbox.consumer()),
            dsn,
            client: None,
            inbox,
            handler,
            isolation: None,
            bare: false,
        }
    }

    /// Runs each transaction at this isolation level (default: the server's, normally READ
    /// COMMITTED). Under REPEATABLE READ and SERIALIZABLE, conflicts are retried by the runner.
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

impl<H: PgHandler> PgProcessor<H> {
    /// `msgs` in one transaction: all committed, or nothing and the index of the message that
    /// failed (0 when begin or commit failed: a failed commit's outcome is unknown, and the
    /// claims sort it out on the retry).
    async fn transaction(
        &mut self,
        msgs: &[Message],
    ) -> Result<Vec<Claim<()>>, (usize, ConsumerError)> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            let c = crate::db::postgres::connect_sql(&self.dsn, &self.application)
                .await
                .map_err(|e| (0, e.into()))?;
            self.client = Some(c);
        }
        let Some(client) = self.client.as_mut() else {
            unreachable!("connected above")
        };
        let result = async {
            let mut b = client.build_transaction();
            if let Some(level) = self.isolation {
                b = b.isolation_level(level);
            }
            let tx = b.start().await.map_err(|e| (0, e.into()))?;
            let mut claims = Vec::with_capacity(msgs.len());
            for (i, msg) in msgs.iter().enumerate() {
                let claim = if self.bare {
                    self.handler.handle(&tx, msg).await.map(Claim::Applied)
                } else {
                    let handler = &self.handler;
                    self.inbox
                        .run_pg(&tx, msg, |tx| handler.handle(tx, msg))
                        .await
                };
                claims.push(claim.map_err(|e| (i, e))?);
            }
            // A failed commit leaves the outcome unknown to us; the messages are not acked, so
            // they come again, and the claims (if it did commit) make them duplicates.
            tx.commit().await.map_err(|e| (0, e.into()))?;
            Ok(claims)
        }
        .await;
        if let Err((_, e)) = &result {
            if e.session_lost() {
                self.client = None;
            }
        }
        result
    }
}

impl<H: PgHandler> super::Processor for PgProcessor<H> {
    async fn process(&mut self, msg: &Message) -> Result<Claim<()>, ConsumerError> {
        self.transaction(std::slice::from_ref(msg))
            .await
            .map(|mut c| c.remove(0))
            .map_err(|(_, e)| e)
    }

    /// One transaction for the batch; when message `i` fails, the first `i` are committed in a
    /// new transaction (a failed statement aborts a Postgres transaction) and `i` is reported.
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
    #[test]
    fn migration_matches_the_inbox_statements() {
        let ddl = include_str!("../../migrations/postgres/003_processed_messages.sql");
        for needle in [
            "processed_messages",
            "PRIMARY KEY (consumer, message_id)",
            "(processed_at)",
            "consumer_aggregate_versions",
            "PRIMARY KEY (consumer, aggregate_id)",
        ] {
            assert!(ddl.contains(needle), "{needle}");
        }
    }
}
