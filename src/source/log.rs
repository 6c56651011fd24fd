//! The interface a log source implements for `outboxd run` ([`LogSource`]), and the shape of
//! its positions ([`LogPosition`]). The run wiring (`pipeline::run`) is one function generic
//! over it: it asks the source where to start ([`LogSource::start_plan`], which takes the lease
//! and decides resume, first start or recovery through the relay's `StateStore`), creates the
//! run's return path from the start position, hands it to the store, and runs the source
//! ([`LogSource::run`]) beside the relay and the lease keeper. A source knows nothing of the
//! wiring, the relay or the sink; what it needs of them arrives as the parameters of `run`.
//!
//! Adding a log source is one implementation of this trait in its own folder under `source/`
//! (its position newtype, its start, its run loop; docs/architecture.md, "Adding a source"),
//! plus its arm in the command layer.

use super::startup::{StartOptions, StartPlan};
use super::SourceLink;
use crate::event::Checkpoint;
use crate::identity::SourceIdentity;
use crate::state::checkpoint::Checkpointer;
use crate::state::StateStore;
use crate::Error;
use std::fmt;
use std::future::Future;
use tokio_util::sync::CancellationToken;

/// A position in one log: typed per source (an LSN, a binlog coordinate) and carrying the
/// identity of the log it belongs to, so that a number is never read as another server's.
pub trait LogPosition: Clone + fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// The log this position is in; unknown (`SourceIdentity::default`) where the server would
    /// not say.
    fn source(&self) -> &SourceIdentity;

    /// The position as the relay and the state store carry it.
    fn checkpoint(&self) -> Checkpoint;

    /// How far the server already knows the relay got, when the run starts here: the return
    /// path confirms nothing at or below it (Postgres: the slot's position, which the state row
    /// holds). 0 for a log whose server keeps nothing for the relay (the binlog).
    fn confirmed_upstream(&self) -> u64;
}

/// Where a log source begins, as its start decided.
pub struct Begin<S: LogSource> {
    /// The position streaming starts at.
    pub at: S::Position,
    /// Everything else the start hands the run (what it publishes before streaming).
    pub start: S::Start,
    /// Held by the run wiring until the run has stopped and released its lease.
    pub held: S::Held,
}

/// A database log that `outboxd run` streams from. One value per run: built by the command
/// layer from its flags, consumed by [`LogSource::run`].
pub trait LogSource: Send + Sized {
    /// A position in this source's log.
    type Position: LogPosition;
    /// What [`LogSource::start_plan`] hands [`LogSource::run`] besides the position.
    type Start: Send;
    /// What the run wiring holds until the run is over (Postgres: the start's SQL session, so
    /// that the sessions the server lists for the relay are the same from its start to its
    /// stop); `()` for nothing.
    type Held: Send;

    /// Takes the lease through `store` (under `--ha` as a standby while another relay holds
    /// it), checks the server and the tables, and decides where streaming starts: the stored
    /// position, a first start (its position stored before its first event), or a recovery
    /// under `--on-position-lost`. `None` when a standby was asked to stop before it got the
    /// lease.
    fn start_plan<St: StateStore>(
        &self,
        store: St,
        opts: &StartOptions,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<Option<StartPlan<St, Begin<Self>>>, Error>> + Send;

    /// Streams from `at` (with what the start decided, `start`) until `shutdown`, then stops
    /// at a transaction boundary once the relay acknowledged what it sent. Each transaction
    /// forwarded is noted on `returns`, and what the store holds comes back through it (what
    /// the source may confirm upstream).
    fn run(
        self,
        at: Self::Position,
        start: Self::Start,
        link: SourceLink,
        returns: Checkpointer,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<(), Error>> + Send;
}
