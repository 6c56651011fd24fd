//! A guard around any [`StateStore`] that refuses to store a position older than one it
//! already stored, and says so. The SQL stores refuse such a write inside their UPDATE too, but
//! silently: a relay that tried to move its position backwards would go unnoticed. Here the
//! attempt is logged as an error and counted (`outboxd_position_backwards_refused_total`), so
//! a regression in the relay's ordering shows up in tests and on dashboards instead of being
//! absorbed.

use super::{DurableCommit, Lease, StateStore, Stored};
use crate::event::Checkpoint;
use crate::telemetry::events::{InternalEvent, PositionBackwardsRefused};
use crate::Error;

/// Wraps a store; see the module doc.
pub(crate) struct ForwardOnly<S> {
    inner: S,
    stored: Option<Checkpoint>,
}

impl<S> ForwardOnly<S> {
    /// `resumed_from` is the position this run started at, when the store had one: nothing
    /// older may be stored by this run either.
    pub(crate) fn new(inner: S, resumed_from: Option<Checkpoint>) -> ForwardOnly<S> {
        ForwardOnly {
            inner,
            stored: resumed_from,
        }
    }

    /// Whether storing `p` would move the position backwards; logs and counts it if so.
    fn refuses(&self, p: &Checkpoint) -> bool {
        let Some(cur) = &self.stored else {
            return false;
        };
        if cur.compare(p) != Some(std::cmp::Ordering::Greater) {
            return false;
        }
        PositionBackwardsRefused {
            stored: cur,
            attempted: p,
        }
        .emit();
        true
    }
}

impl<S: StateStore> StateStore for ForwardOnly<S> {
    async fn acquire(
        &mut self,
        name: &str,
        holder: &str,
    ) -> Result<(Lease, Option<Checkpoint>), Error> {
        let (lease, at) = self.inner.acquire(name, holder).await?;
        // What the store holds is a floor for this run too.
        if let Some(p) = &at {
            if self.stored.as_ref().is_none_or(|cur| p.is_after(cur)) {
                self.stored = Some(p.clone());
            }
        }
        Ok((lease, at))
    }

    async fn load(&mut self, name: &str) -> Result<Option<Stored>, Error> {
        self.inner.load(name).await
    }

    async fn store_start(
        &mut self,
        lease: &Lease,
        start: &Checkpoint,
        done: bool,
    ) -> Result<(), Error> {
        self.inner.store_start(lease, start, done).await
    }

    async fn renew(
        &mut self,
        lease: &Lease,
        position: Option<&Checkpoint>,
        commit: &DurableCommit,
    ) -> Result<(), Error> {
        let position = position.filter(|p| !self.refuses(p));
        self.inner.renew(lease, position, commit).await?;
        if let Some(p) = position {
            self.stored = Some(p.clone());
        }
        Ok(())
    }

    async fn mark_initialized(&mut self, lease: &Lease) -> Result<(), Error> {
        self.inner.mark_initialized(lease).await
    }

    async fn report_progress(
        &mut self,
        lease: &Lease,
        progress: Option<&str>,
    ) -> Result<(), Error> {
        self.inner.report_progress(lease, progress).await
    }

    async fn record_stream_start(
        &mut self,
        lease: &Lease,
        at: &Checkpoint,
        created: bool,
    ) -> Result<(), Error> {
        self.inner.record_stream_start(lease, at, created).await
    }

    // The floor moves with the record: forgotten, or replaced by the marker.
    async fn restart(
        &mut self,
        lease: &Lease,
        replay_since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), Error> {
        self.inner.restart(lease, replay_since).await?;
        self.stored = None;
        Ok(())
    }

    async fn replace_position(&mut self, lease: &Lease, marker: &Checkpoint) -> Result<(), Error> {
        self.inner.replace_position(lease, marker).await?;
        self.stored = Some(marker.clone());
        Ok(())
    }

    async fn release(&mut self, lease: &Lease) -> Result<(), Error> {
        self.inner.release(lease).await
    }

    // Forwarded: the keeper calls it on this wrapper when a renewal timed out, and the store
    // inside must drop the session that stalled (the Postgres store keeps one otherwise).
    fn abandon(&mut self) {
        self.inner.abandon()
    }

    fn return_path(&mut self, returns: super::checkpoint::Checkpointer) {
        self.inner.return_path(returns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what reaches the wrapped store.
    #[derive(Default)]
    struct Recorder {
        stored: Vec<Checkpoint>,
    }

    impl StateStore for Recorder {
        async fn acquire(
            &mut self,
            _name: &str,
            _holder: &str,
        ) -> Result<(Lease, Option<Checkpoint>), Error> {
            Ok((lease(), None))
        }

        async fn load(&mut self, _name: &str) -> Result<Option<Stored>, Error> {
            Ok(None)
        }

        async fn renew(
            &mut self,
            _lease: &Lease,
            position: Option<&Checkpoint>,
            _commit: &DurableCommit,
        ) -> Result<(), Error> {
            self.stored.extend(position.cloned());
            Ok(())
        }

        async fn release(&mut self, _lease: &Lease) -> Result<(), Error> {
            Ok(())
        }

        async fn restart(
            &mut self,
            _lease: &Lease,
            _replay_since: Option<chrono::DateTime<chrono::Utc>>,
        ) -> Result<(), Error> {
            Ok(())
        }

        async fn replace_position(
            &mut self,
            _lease: &Lease,
            marker: &Checkpoint,
        ) -> Result<(), Error> {
            self.stored.push(marker.clone());
            Ok(())
        }
    }

    fn lease() -> Lease {
        Lease {
            name: "t".into(),
            holder: "h".into(),
            epoch: 1,
            first_start: false,
            replay_since: None,
        }
    }

    #[tokio::test]
    async fn an_older_position_is_refused_and_counted() {
        let mut s = ForwardOnly::new(Recorder::default(), Some(Checkpoint::Lsn(10)));
        let c = DurableCommit::default();
        let before = crate::telemetry::get().position_backwards_refused.get();
        s.renew(&lease(), Some(&Checkpoint::Lsn(5)), &c)
            .await
            .unwrap();
        s.renew(&lease(), Some(&Checkpoint::Lsn(10)), &c)
            .await
            .unwrap();
        s.renew(&lease(), Some(&Checkpoint::Lsn(20)), &c)
            .await
            .unwrap();
        s.renew(&lease(), Some(&Checkpoint::Lsn(15)), &c)
            .await
            .unwrap();
        assert_eq!(s.inner.stored, [Checkpoint::Lsn(10), Checkpoint::Lsn(20)]);
        assert_eq!(
            crate::telemetry::get().position_backwards_refused.get() - before,
            2
        );
    }
}
