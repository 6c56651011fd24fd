//! `drive` in one process: a scripted source, the relay, `MemorySink` and `MemoryStore` on
//! tokio's paused clock. What a start leaves in the store and hands to `drive` (a first
//! start's position, the resumed one, a lost position's replay), what a lease taken over does
//! to the run, and the order of a graceful stop.

use super::*;
use crate::event::{OutboxEvent, SourcePosition};
use crate::sink::memory::MemorySink;
use crate::state::memory::{MemoryStore, MemoryStoreHandle};
use crate::state::StateStore;

const NAME: &str = "drive_test";

fn event(lsn: u64) -> OutboxEvent {
    let mut e = crate::sink::test_event();
    e.id = uuid::Uuid::now_v7();
    e.position = SourcePosition::Pg {
        commit_lsn: lsn,
        index: 0,
    };
    e
}

/// The checkpoint after the one-event transaction committed at `lsn`.
fn end(lsn: u64) -> Checkpoint {
    Checkpoint::Lsn(lsn + 8)
}

/// Sends one one-event transaction committed at `lsn`; its event's id.
async fn send(link: &SourceLink, lsn: u64) -> Result<uuid::Uuid, Error> {
    let e = event(lsn);
    let id = e.id;
    link.outlet.send_event(e).await?;
    link.outlet.send_checkpoint(end(lsn)).await?;
    Ok(id)
}

/// A source that sends one-event transactions committed at `lsns`, then ends when `stop` is
/// cancelled (a log source stops at a transaction boundary).
async fn scripted(link: SourceLink, lsns: Vec<u64>, stop: CancellationToken) -> Result<(), Error> {
    for lsn in lsns {
        send(&link, lsn).await?;
    }
    stop.cancelled().await;
    Ok(())
}

fn commits() -> Checkpointer {
    Checkpointer::new(0)
}

fn opts() -> DriveOptions {
    DriveOptions {
        max_inflight_bytes: 1 << 20,
        ..DriveOptions::default()
    }
}

fn stopped() -> CancellationToken {
    let t = CancellationToken::new();
    t.cancel();
    t
}

/// What a startup does on a first start at `start` before it hands over: stores the position
/// (`done`: there is no snapshot, so the first start is over with it).
async fn start_first(store: &mut MemoryStore, lease: &mut state::Lease, start: u64, done: bool) {
    store
        .store_start(lease, &Checkpoint::Lsn(start), done)
        .await
        .unwrap();
    lease.first_start &= !done;
}

/// `drive` on a first start at 0x100 without a snapshot (over once its position is stored).
async fn drive_fresh<F, Fut>(
    sink: MemorySink,
    mut store: MemoryStore,
    mut lease: state::Lease,
    source: F,
) -> Result<Arc<RelayStats>, Error>
where
    F: FnOnce(SourceLink) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    start_first(&mut store, &mut lease, 0x100, true).await;
    drive(&opts(), sink, store, lease, None, commits(), source).await
}

/// Polls `cond` on the paused clock (each poll advances it a little).
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..100_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never happened: {what}");
}

/// Positions were stored in order, never backwards (MemoryStore also panics on one).
fn assert_forward(st: &MemoryStoreHandle) {
    let stored = st.positions();
    for w in stored.windows(2) {
        assert!(
            matches!(
                w[0].compare(&w[1]),
                Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
            ),
            "{stored:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_first_start_stores_its_position_before_the_first_publish_and_is_then_marked_done() {
    let (mut store, st) = MemoryStore::new();
    let (mut lease, stored) = store.acquire(NAME, "h1").await.unwrap();
    assert!(lease.first_start && stored.is_none());
    let (sink, sk) = MemorySink::new();
    let start = Checkpoint::Lsn(0x100);
    let (st2, sk2) = (st.clone(), sk.clone());
    start_first(&mut store, &mut lease, 0x100, false).await;
    assert!(lease.first_start, "a snapshot is still to come");
    drive(
        &opts(),
        sink,
        store,
        lease,
        None,
        commits(),
        |link| async move {
            assert_eq!(st2.position(), Some(Checkpoint::Lsn(0x100)), "stored first");
            assert!(!st2.initialized(), "a snapshot is still to come");
            assert!(sk2.published_ids().is_empty());
            scripted(link, vec![0x200, 0x300], stopped()).await
        },
    )
    .await
    .unwrap();
    assert_eq!(st.positions().first(), Some(&start));
    assert_eq!(st.position(), Some(end(0x300)));
    assert!(
        st.initialized(),
        "the first start's end is durable: marked done"
    );
    assert_eq!(st.holder(), None, "released");
    assert_eq!(sk.confirmed_ids().len(), 2);
    assert_forward(&st);
}

#[tokio::test(start_paused = true)]
async fn a_restart_resumes_after_what_the_last_run_stored() {
    let (mut store, st) = MemoryStore::new();
    let (lease, _) = store.acquire(NAME, "h1").await.unwrap();
    let (sink, _) = MemorySink::new();
    drive_fresh(sink, store, lease, |link| {
        scripted(link, vec![0x200], stopped())
    })
    .await
    .unwrap();
    assert!(
        st.initialized(),
        "a first start without a snapshot is done at once"
    );

    let mut store = MemoryStore::reopen(&st);
    let (lease, stored) = store.acquire(NAME, "h2").await.unwrap();
    assert_eq!((lease.epoch, lease.first_start), (2, false));
    assert_eq!(stored, Some(end(0x200)));
    let (sink, sk) = MemorySink::new();
    drive(&opts(), sink, store, lease, stored, commits(), |link| {
        scripted(link, vec![0x400, 0x500], stopped())
    })
    .await
    .unwrap();
    assert_eq!(st.position(), Some(end(0x500)));
    assert_eq!(sk.confirmed_ids().len(), 2);
    assert_eq!((st.holder(), st.releases()), (None, 2));
    assert_forward(&st);
}

/// Another relay takes the lease over while this one cannot renew it: this run publishes
/// nothing more, stores nothing more, and ends with the leadership error.
#[tokio::test(start_paused = true)]
async fn a_lease_taken_over_ends_the_run_without_another_publish() {
    let (mut store, st) = MemoryStore::new();
    let (lease, _) = store.acquire(NAME, "h1").await.unwrap();
    let (sink, sk) = MemorySink::new();
    let (st2, sk2) = (st.clone(), sk.clone());
    let late = event(0x300).id;
    let result = drive_fresh(sink, store, lease, |link| {
        async move {
            send(&link, 0x200).await?;
            wait_until("the first event's position stored", || {
                st2.position() == Some(end(0x200))
            })
            .await;
            // The renewals fail past the lease's lifetime; another relay takes it over.
            st2.fail_renewals(true);
            tokio::time::sleep(state::LEASE_TTL + Duration::from_secs(1)).await;
            let mut other = MemoryStore::reopen(&st2);
            let (taken, _) = other.acquire(NAME, "h2").await.unwrap();
            assert_eq!(taken.epoch, 2);
            st2.fail_renewals(false);
            let mut e = event(0x300);
            e.id = late;
            link.outlet.send_event(e).await?;
            link.outlet.send_checkpoint(end(0x300)).await?;
            // A source streams until told to stop: the lease keeper ends the run.
            std::future::pending::<()>().await;
            Ok(())
        }
    })
    .await;
    assert!(
        matches!(result, Err(Error::Leadership(_))),
        "{:?}",
        result.err()
    );
    let (renewals, failed) = st.renewals();
    assert!(failed > 0 && renewals > failed, "the failure was injected");
    assert!(
        !sk2.published_ids().contains(&late),
        "published after the takeover"
    );
    assert_eq!(st.position(), Some(end(0x200)));
    assert_eq!(st.holder().as_deref(), Some("h2"));
}

/// A stop: the source ends, the relay waits for every confirmation, then the last position is
/// stored and only then the lease released.
#[tokio::test(start_paused = true)]
async fn a_stop_drains_every_confirmation_then_stores_the_last_position_then_releases() {
    let (mut store, st) = MemoryStore::new();
    let (lease, _) = store.acquire(NAME, "h1").await.unwrap();
    let (sink, sk) = MemorySink::new();
    sk.hold_confirms();
    let stop = CancellationToken::new();
    let source_stop = stop.clone();
    let run = tokio::spawn(async move {
        drive_fresh(sink, store, lease, |link| {
            scripted(link, vec![0x200, 0x300, 0x400], source_stop)
        })
        .await
    });
    wait_until("three publishes awaiting confirmation", || {
        sk.held().len() == 3
    })
    .await;
    stop.cancel();
    // However long the confirmations take (below the confirm timeout), the run waits.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(!run.is_finished());
    assert_eq!(st.position(), Some(Checkpoint::Lsn(0x100)));
    assert_eq!(st.holder().as_deref(), Some("h1"));
    for id in sk.held() {
        assert!(sk.confirm(id));
    }
    run.await.unwrap().unwrap();
    assert_eq!(st.position(), Some(end(0x400)));
    assert_eq!((st.holder(), st.releases()), (None, 1));
    assert_eq!(sk.confirmed_ids().len(), 3);
    assert_forward(&st);
}

/// The return path in one run: the commit time (and gap) a source notes for a forwarded
/// transaction reaches the store with the position that covers it, and a transaction the
/// relay never acknowledged leaves what is stored alone.
#[tokio::test(start_paused = true)]
async fn commit_times_reach_the_store_with_the_position_that_covers_them() {
    let (mut store, st) = MemoryStore::new();
    let (mut lease, _) = store.acquire(NAME, "h1").await.unwrap();
    let (sink, _sk) = MemorySink::new();
    let checkpoints = Checkpointer::new(0);
    let noted = checkpoints.clone();
    let at = chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap();
    let later = at + chrono::Duration::seconds(60);
    start_first(&mut store, &mut lease, 0x100, true).await;
    drive(
        &opts(),
        sink,
        store,
        lease,
        None,
        checkpoints,
        move |link| async move {
            noted.observe(at, at - chrono::Duration::seconds(2));
            noted.forwarded(&end(0x200), Some(at));
            send(&link, 0x200).await?;
            // Noted, but never sent: no acknowledgement covers it.
            noted.forwarded(&end(0x300), Some(later));
            Ok(())
        },
    )
    .await
    .unwrap();
    let stored = MemoryStore::reopen(&st).load(NAME).await.unwrap().unwrap();
    assert_eq!(stored.position, Some(end(0x200)));
    assert_eq!(stored.commit.commit_at, Some(at));
    assert_eq!(stored.commit.max_gap_ms, Some(2000));
}

/// A lost position with `--on-position-lost poll`, as a start leaves it: the lost position
/// forgotten and the replay recorded, the source publishing the replayed rows (snapshot marks)
/// and then streaming from a fresh position far below the lost one. Every replayed row is
/// confirmed, the fresh positions replace the lost one (none is refused as backwards), and
/// the replay is marked done only once the stream's first position is durable.
#[tokio::test(start_paused = true)]
async fn a_lost_position_replays_then_stores_the_fresh_stream_below_it() {
    let (mut store, st) = MemoryStore::new();
    let (mut lease, _) = store.acquire(NAME, "h1").await.unwrap();
    // An earlier run got far on a stream that is gone (a slot dropped, a binlog purged).
    start_first(&mut store, &mut lease, 0x9000, true).await;
    store
        .renew(&lease, Some(&end(0x9100)), &state::DurableCommit::default())
        .await
        .unwrap();
    store.release(&lease).await.unwrap();

    let mut store = MemoryStore::reopen(&st);
    let (mut lease, stored) = store.acquire(NAME, "h2").await.unwrap();
    assert_eq!((lease.first_start, stored), (false, Some(end(0x9100))));
    // The start's recovery: the replay recorded before anything is published.
    let since = chrono::Utc::now() - chrono::Duration::minutes(5);
    store.restart(&lease, Some(since)).await.unwrap();
    lease.replay_since = Some(since);
    lease.first_start = true;
    assert_eq!((st.position(), st.replay_since()), (None, Some(since)));

    let (sink, sk) = MemorySink::new();
    let st2 = st.clone();
    let refused = crate::telemetry::get().position_backwards_refused.get();
    let replayed = [event(0x10), event(0x20)];
    let ids: Vec<uuid::Uuid> = replayed.iter().map(|e| e.id).collect();
    drive(
        &opts(),
        sink,
        store,
        lease,
        None,
        commits(),
        |link| async move {
            for (seq, e) in replayed.into_iter().enumerate() {
                let key = format!("row-{seq}");
                link.outlet.send_event(e).await?;
                link.outlet
                    .send_checkpoint(Checkpoint::Snapshot {
                        seq: seq as u64,
                        key,
                    })
                    .await?;
            }
            wait_until("the replay's progress stored", || {
                st2.snapshot_key().as_deref() == Some("row-1")
            })
            .await;
            // Not durable before its end: a crash now replays again.
            assert!(st2.replay_since().is_some(), "the replay marked done early");
            scripted(link, vec![0x200, 0x300], stopped()).await
        },
    )
    .await
    .unwrap();
    let confirmed = sk.confirmed_ids();
    assert!(
        ids.iter().all(|id| confirmed.contains(id)),
        "every replayed row confirmed"
    );
    assert_eq!(confirmed.len(), 4);
    assert_eq!(
        st.position(),
        Some(end(0x300)),
        "the fresh stream replaced the lost position"
    );
    assert!(
        st.initialized() && st.replay_since().is_none(),
        "the replay is marked done"
    );
    assert_eq!(st.snapshot_key(), None);
    assert_eq!(
        crate::telemetry::get().position_backwards_refused.get(),
        refused,
        "no position refused as backwards"
    );
    assert_eq!((st.holder(), st.releases()), (None, 2));
}
