//! The inbox flow, written once: [`Inbox::claim`], [`Inbox::gate`] and [`Inbox::run`] (claim,
//! then the stale gate, then the effect) inside the caller's transaction, generic over
//! [`InboxBackend`]. The backend supplies only its two statements — inserting the claim row and
//! advancing an aggregate's version — because those are where the databases differ (`ON
//! CONFLICT` on Postgres, `INSERT IGNORE` and its warnings on MySQL/MariaDB); the order of the
//! steps and what each answer means are the same on both, so they live here.
//!
//! It is implemented for `tokio_postgres::Transaction` ([`super::postgres`]) and
//! `mysql_async::Transaction` ([`super::mysql`]); implement it for another store's transaction
//! to reuse the flow.

use super::{Claim, ConsumerError, Inbox, Message};
use crate::outbox::TableName;
use std::future::Future;
use uuid::Uuid;

/// The inbox statements of one database, run inside an open transaction (`self`).
pub trait InboxBackend: Send {
    /// Inserts `(consumer, id)` into `table`: `true` when this transaction inserted the row,
    /// `false` when it was already there. A concurrent transaction holding the same key must
    /// make this wait for it (the unique-key lock), so that exactly one claim commits.
    fn insert_claim(
        &mut self,
        table: &TableName,
        consumer: &str,
        id: Uuid,
    ) -> impl Future<Output = Result<bool, ConsumerError>> + Send;

    /// Records `version` as the last applied one of `(consumer, aggregate)` in `table` when
    /// it is newer than the stored one (`None`); otherwise returns the stored version
    /// (`Some(stored)`) and changes nothing. The key compares exactly (byte for byte: `ORD-a`
    /// is not `ord-A`). The statement must lock the aggregate's row, so that concurrent
    /// messages of one aggregate are decided one after the other.
    fn advance_version(
        &mut self,
        table: &TableName,
        consumer: &str,
        aggregate: Aggregate<'_>,
        version: i64,
    ) -> impl Future<Output = Result<Option<i64>, ConsumerError>> + Send;
}

/// One aggregate, as the stale gate keys it: the outbox table its events come from
/// (`x-outbox-table`, `""` when the relay reads one table), its type (`x-aggregate-type`, `""`
/// when not sent) and its id. Order 42 and invoice 42 are two aggregates, and so are aggregate
/// 7 of one outbox table and aggregate 7 of another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Aggregate<'a> {
    pub table: &'a str,
    pub kind: &'a str,
    pub id: &'a str,
}

impl Inbox {
    /// Claims `id` for this consumer inside `tx`: `true` when this transaction inserted the
    /// row (run the effect), `false` when it was already there (a repeat: run nothing).
    ///
    /// A concurrent transaction holding the same id makes this wait until it ends; then the
    /// answer is `false` if it committed and `true` if it rolled back. Under REPEATABLE READ or
    /// SERIALIZABLE on Postgres a row committed after this transaction's snapshot is a
    /// serialization failure instead ([`ConsumerError::Conflict`]): run the transaction again
    /// and it is a plain duplicate.
    pub async fn claim<B: InboxBackend>(
        &self,
        tx: &mut B,
        id: Uuid,
    ) -> Result<bool, ConsumerError> {
        tx.insert_claim(&self.processed, &self.consumer, id).await
    }

    /// The stale gate: records `version` as the last applied one of `aggregate` when it is
    /// newer than what is stored, and returns `None` (apply); returns `Some(stored)` when the
    /// stored version is the same or newer (drop). With the gate off it is always `None`.
    pub async fn gate<B: InboxBackend>(
        &self,
        tx: &mut B,
        aggregate: Aggregate<'_>,
        version: i64,
    ) -> Result<Option<i64>, ConsumerError> {
        let Some(versions) = &self.versions else {
            return Ok(None);
        };
        tx.advance_version(versions, &self.consumer, aggregate, version)
            .await
    }

    /// Claim first, then the stale gate (when on and the message has an aggregate and a
    /// version), then `effect` — all in `tx`, which the caller commits (and only then acks).
    /// A repeat returns [`Claim::Duplicate`] and `effect` never runs; an error from `effect`
    /// comes back as is, and the caller rolls back, which also releases the claim.
    ///
    /// ```no_run
    /// # async fn f(client: &mut tokio_postgres::Client, msg: &outboxd::consumer::Message) -> Result<(), outboxd::consumer::ConsumerError> {
    /// let inbox = outboxd::consumer::Inbox::new("billing")?;
    /// let mut tx = client.transaction().await?;
    /// let claim = inbox
    ///     .run(&mut tx, msg, |tx| async move {
    ///         tx.execute("UPDATE totals SET n = n + 1", &[]).await?;
    ///         Ok(())
    ///     })
    ///     .await?;
    /// tx.commit().await?; // then ack
    /// # let _ = claim; Ok(()) }
    /// ```
    pub async fn run<'a, B, T, F, Fut>(
        &self,
        tx: &'a mut B,
        msg: &Message,
        effect: F,
    ) -> Result<Claim<T>, ConsumerError>
    where
        B: InboxBackend,
        F: FnOnce(&'a mut B) -> Fut,
        Fut: Future<Output = Result<T, ConsumerError>> + 'a,
    {
        if !self.claim(tx, msg.id).await? {
            return Ok(Claim::Duplicate);
        }
        if let (true, Some(agg), Some(version)) =
            (self.stale_gate(), msg.aggregate_id.as_deref(), msg.version)
        {
            let aggregate = Aggregate {
                table: msg.table.as_deref().unwrap_or(""),
                kind: msg.aggregate_type.as_deref().unwrap_or(""),
                id: agg,
            };
            if let Some(applied) = self.gate(tx, aggregate, version).await? {
                return Ok(Claim::Stale { version, applied });
            }
        }
        effect(tx).await.map(Claim::Applied)
    }
}
