//! [`InboxProcessor`]: the runner's [`Processor`] for a database, written once over
//! [`Database`]. It owns one session, runs each message (or each batch) in one transaction —
//! begin, [`Inbox::run`] with the [`Handler`], commit — reconnects lazily after a lost
//! session, and splits a failed batch so that the messages before the failing one still
//! commit. The databases differ only in how a session is opened and a transaction begun and
//! committed, which is what [`Database`] says ([`super::postgres::Postgres`],
//! [`super::mysql::Mysql`]).

use super::inbox::InboxBackend;
use super::runner::{BatchResult, Processor};
use super::{Claim, ConsumerError, Inbox, Message};
use crate::dsn::DbDsn;
use std::future::Future;

/// A database the processor can run inbox transactions on: how to open a session, and begin
/// and commit a transaction on it. Implemented by the marker types
/// [`super::postgres::Postgres`] and [`super::mysql::Mysql`].
pub trait Database: Send + Sync + 'static {
    /// One connection.
    type Session: Send;
    /// A transaction on a session; the inbox statements run in it.
    type Tx<'s>: InboxBackend;
    /// The driver's isolation levels.
    type Isolation: Copy + Send + Sync;

    /// Opens a session; `application` names it to the server where the database shows that.
    fn connect(
        dsn: &DbDsn,
        application: &str,
    ) -> impl Future<Output = Result<Self::Session, ConsumerError>> + Send;

    /// Whether a session kept from an earlier message can still be used (a closed one is
    /// replaced before the next transaction).
    fn usable(session: &Self::Session) -> bool;

    /// Begins a transaction, at `isolation` when given (else the server's default).
    fn begin(
        session: &mut Self::Session,
        isolation: Option<Self::Isolation>,
    ) -> impl Future<Output = Result<Self::Tx<'_>, ConsumerError>> + Send;

    fn commit(tx: Self::Tx<'_>) -> impl Future<Output = Result<(), ConsumerError>> + Send;
}

/// The business effect of a consumer, run inside the inbox's transaction `Tx` (a
/// `tokio_postgres::Transaction<'_>` or a `mysql_async::Transaction<'_>`). Use `tx` for every
/// write that belongs to the effect; return [`ConsumerError::transient`] for failures that may
/// pass and [`ConsumerError::permanent`] (or any non-retryable error) for the rest.
///
/// Generic over the transaction type rather than over [`Database`], so that an implementation
/// names the driver's own type in its signature.
pub trait Handler<Tx>: Send + Sync + 'static {
    fn handle(
        &self,
        tx: &mut Tx,
        msg: &Message,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send;
}

/// One connection and one transaction per message (or per batch) on database `D`: begin,
/// [`Inbox::run`] with the handler, commit. The runner acks after `process` returns.
pub struct InboxProcessor<D: Database, H> {
    dsn: DbDsn,
    application: String,
    session: Option<D::Session>,
    inbox: Inbox,
    handler: H,
    isolation: Option<D::Isolation>,
    /// Without the inbox: the effect alone in a transaction (for measuring what the inbox
    /// costs; never for production, where repeats would run twice).
    bare: bool,
}

impl<D: Database, H: for<'s> Handler<D::Tx<'s>>> InboxProcessor<D, H> {
    pub fn new(dsn: DbDsn, inbox: Inbox, handler: H) -> Self {
        InboxProcessor {
            application: format!("outboxd_consumer_{}", inbox.consumer()),
            dsn,
            session: None,
            inbox,
            handler,
            isolation: None,
            bare: false,
        }
    }

    /// Runs each transaction at this isolation level (default: the server's, normally READ
    /// COMMITTED on Postgres and REPEATABLE READ on MySQL/MariaDB). Conflicts the stricter
    /// levels raise are retried by the runner.
    pub fn isolation(mut self, level: D::Isolation) -> Self {
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

    /// `msgs` in one transaction: all committed, or nothing and the index of the message that
    /// failed (0 when begin or commit failed: a failed commit's outcome is unknown, and the
    /// claims sort it out on the retry).
    async fn transaction(
        &mut self,
        msgs: &[Message],
    ) -> Result<Vec<Claim<()>>, (usize, ConsumerError)> {
        if self.session.as_ref().is_none_or(|s| !D::usable(s)) {
            let s = D::connect(&self.dsn, &self.application)
                .await
                .map_err(|e| (0, e))?;
            self.session = Some(s);
        }
        let Some(session) = self.session.as_mut() else {
            unreachable!("connected above")
        };
        let result = async {
            let mut tx = D::begin(session, self.isolation)
                .await
                .map_err(|e| (0, e))?;
            let mut claims = Vec::with_capacity(msgs.len());
            for (i, msg) in msgs.iter().enumerate() {
                let claim = if self.bare {
                    self.handler.handle(&mut tx, msg).await.map(Claim::Applied)
                } else {
                    let handler = &self.handler;
                    self.inbox
                        .run(&mut tx, msg, |tx| handler.handle(tx, msg))
                        .await
                };
                claims.push(claim.map_err(|e| (i, e))?);
            }
            // A failed commit leaves the outcome unknown to us; the messages are not acked, so
            // they come again, and the claims (if it did commit) make them duplicates.
            D::commit(tx).await.map_err(|e| (0, e))?;
            Ok(claims)
        }
        .await;
        if let Err((_, e)) = &result {
            if e.session_lost() {
                // Dropping the session also ends a transaction left open by the error.
                self.session = None;
            }
        }
        result
    }
}

impl<D: Database, H: for<'s> Handler<D::Tx<'s>>> Processor for InboxProcessor<D, H> {
    async fn process(&mut self, msg: &Message) -> Result<Claim<()>, ConsumerError> {
        self.transaction(std::slice::from_ref(msg))
            .await
            .map(|mut c| c.remove(0))
            .map_err(|(_, e)| e)
    }

    /// One transaction for the batch; when message `i` fails, the first `i` are committed in a
    /// new transaction (a failed statement aborts a Postgres transaction, and on MySQL the
    /// failed message's partial effect must not commit either) and `i` is reported.
    async fn process_batch(&mut self, msgs: &[Message]) -> BatchResult {
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
