//! Tenants of one MariaDB server sharing one binlog dump connection (`MysqlHub`), each driven by
//! `pipeline::run` in the test's process with its own `MemorySink` and its own state row: each
//! gets exactly its own events in order, the server serves one dump thread, a restart resumes
//! each at its own position, a tenant added behind the others catches up on its own stream and
//! then joins, and a stalled tenant is detached instead of holding the others back.

use crate::common::inproc::{ids, run_config, DEADLINE};
use crate::common::{binlog_ge, my_connect, my_value, my_write_events, unique, MyDb};
use outboxd::names::{ColumnMap, TableName};
use outboxd::pipeline;
use outboxd::source::mysql::hub::{HubOptions, MysqlHub};
use outboxd::source::mysql::log::{outbox_tables, MyLog, MySqlOptions};
use outboxd::state::mysql::MyStateStore;
use outboxd::{MemoryHandle, MemorySink};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

fn dsn_of(db: &MyDb) -> outboxd::dsn::DbDsn {
    let outboxd::dsn::SourceDsn::Mysql(dsn) = outboxd::dsn::SourceDsn::parse(&db.dsn()).unwrap()
    else {
        unreachable!("a mysql:// DSN")
    };
    dsn
}

/// A hub whose dump connection names `db` (so the server's process list tells it apart).
async fn hub(db: &MyDb, queue_bytes: usize) -> MysqlHub {
    let mut opts = HubOptions::new(&unique("hub"));
    opts.queue_bytes = queue_bytes;
    MysqlHub::connect(dsn_of(db), opts).await.unwrap()
}

/// One tenant's run on `hub`: relay `name` over `db`'s outbox table.
struct Tenant {
    name: String,
    handle: MemoryHandle,
    stop: CancellationToken,
    run: JoinHandle<Result<Arc<outboxd::relay::RelayStats>, outboxd::Error>>,
}

impl Tenant {
    /// `max_inflight_bytes`: the relay's bound; `hold`: its sink holds every confirmation
    /// until [`Tenant::release`].
    fn start(
        hub: &MysqlHub,
        db: &MyDb,
        name: &str,
        max_inflight_bytes: Option<usize>,
        hold: bool,
    ) -> Tenant {
        let dsn = dsn_of(db);
        let options = MySqlOptions::default();
        let tables = outbox_tables(
            &dsn,
            &[TableName::parse("outbox").unwrap()],
            &ColumnMap::default(),
            options.time_zone,
        )
        .unwrap();
        let store = MyStateStore::new(dsn.clone());
        let source = hub.subscribe(MyLog {
            dsn,
            name: name.to_string(),
            tables,
            options,
        });
        let (sink, handle) = MemorySink::new();
        if hold {
            handle.hold_confirms();
        }
        let stop = CancellationToken::new();
        let mut cfg = run_config(name, &stop);
        if let Some(b) = max_inflight_bytes {
            cfg.max_inflight_bytes = b;
        }
        let token = stop.clone();
        let run = tokio::spawn(async move {
            pipeline::run(source, store, move || Ok(sink), &cfg, token).await
        });
        Tenant {
            name: name.to_string(),
            handle,
            stop,
            run,
        }
    }

    /// Waits for `n` confirmed events (at most [`DEADLINE`]); the run must not have ended.
    async fn confirmed(&self, n: usize) -> Vec<uuid::Uuid> {
        let got = tokio::time::timeout(DEADLINE, self.handle.wait_confirmed(n))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "tenant {}: {} of {n} events confirmed within {DEADLINE:?} (run ended: {})",
                    self.name,
                    self.handle.confirmed().len(),
                    self.run.is_finished()
                )
            });
        ids(&got)
    }

    /// Confirms what the sink holds until `n` events are confirmed (at most [`DEADLINE`]).
    async fn release(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while self.handle.confirmed().len() < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "tenant {}: {} of {n} confirmed after its sink answered again",
                self.name,
                self.handle.confirmed().len(),
            );
            for id in self.handle.held() {
                self.handle.confirm(id);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the run and checks that it stopped cleanly; its sink's handle.
    async fn stop(self) -> MemoryHandle {
        self.stop.cancel();
        let r = tokio::time::timeout(DEADLINE, self.run)
            .await
            .expect("the run stops in time")
            .expect("the run's task");
        if let Err(e) = r {
            panic!("tenant {} stopped with an error: {e}", self.name);
        }
        self.handle
    }
}

/// Binlog dump threads the server runs for connections to these databases.
async fn dumps(dbs: &[&MyDb]) -> usize {
    let names: Vec<String> = dbs.iter().map(|d| format!("'{}'", d.name)).collect();
    let mut c = my_connect(None).await;
    my_value(
        &mut c,
        &format!(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND DB IN ({})",
            names.join(",")
        ),
    )
    .await
    .and_then(|s| s.parse().ok())
    .unwrap_or(0)
}

/// Polls `cond` until it holds; panics naming `what` after [`DEADLINE`].
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {DEADLINE:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes `n_tx` transactions of two events into each of `dbs` at once, one producer each.
async fn produce(dbs: &[&MyDb], n_tx: usize, topic: &str) -> Vec<Vec<uuid::Uuid>> {
    let writers = dbs.iter().map(|db| async move {
        let mut conn = db.conn().await;
        my_write_events(&mut conn, n_tx, 2, topic).await
    });
    futures::future::join_all(writers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_share_one_dump_thread_get_exactly_their_own_events_and_resume_at_their_own_positions(
) {
    let hub_db = MyDb::create("hubsrv").await;
    let dbs = [
        MyDb::create("hub_a").await,
        MyDb::create("hub_b").await,
        MyDb::create("hub_c").await,
    ];
    let all: Vec<&MyDb> = dbs.iter().chain([&hub_db]).collect();
    let names: Vec<String> = (0..3).map(|i| unique(&format!("tenant{i}"))).collect();
    let h = hub(&hub_db, 8 * 1024 * 1024).await;
    let tenants: Vec<Tenant> = dbs
        .iter()
        .zip(&names)
        .map(|(db, n)| Tenant::start(&h, db, n, None, false))
        .collect();
    until("the three tenants read from the hub's stream", || async {
        h.stats().attached.load(Ordering::Relaxed) == 3
    })
    .await;
    let written = produce(&dbs.iter().collect::<Vec<_>>(), 15, "hub.first").await;
    for (t, w) in tenants.iter().zip(&written) {
        assert_eq!(
            &t.confirmed(w.len()).await,
            w,
            "tenant {} gets exactly its own events, in order",
            t.name
        );
    }
    until(
        "the server runs one dump thread for the three tenants",
        || async { dumps(&all).await == 1 },
    )
    .await;
    let stats = h.stats();
    assert_eq!(
        stats.dumps_opened.load(Ordering::Relaxed),
        1,
        "one dump connection"
    );
    assert_eq!(stats.detaches.load(Ordering::Relaxed), 0, "nobody detached");
    assert_eq!(dumps(&all).await, 1, "the server serves one dump thread");
    let mut stored = Vec::new();
    for (t, (db, w)) in tenants.into_iter().zip(dbs.iter().zip(&written)) {
        let name = t.name.clone();
        let handle = t.stop().await;
        assert_eq!(&ids(&handle.confirmed()), w, "nothing more after the stop");
        stored.push(db.stored(&name).await.expect("a stored position"));
    }
    drop(h);

    // Written while no tenant runs, to each at once: a new hub, each tenant resumes at its own
    // stored position and publishes exactly these, once.
    let later = produce(&dbs.iter().collect::<Vec<_>>(), 5, "hub.later").await;
    let h = hub(&hub_db, 8 * 1024 * 1024).await;
    let tenants: Vec<Tenant> = dbs
        .iter()
        .zip(&names)
        .map(|(db, n)| Tenant::start(&h, db, n, None, false))
        .collect();
    for (t, w) in tenants.iter().zip(&later) {
        assert_eq!(
            &t.confirmed(w.len()).await,
            w,
            "tenant {} resumes at its own position: no loss",
            t.name
        );
    }
    until(
        "the restarted tenants read from the hub's stream",
        || async { h.stats().attached.load(Ordering::Relaxed) == 3 },
    )
    .await;
    let more = produce(&dbs.iter().collect::<Vec<_>>(), 5, "hub.more").await;
    for (i, (t, db)) in tenants.into_iter().zip(&dbs).enumerate() {
        let want: Vec<_> = later[i].iter().chain(&more[i]).copied().collect();
        let name = t.name.clone();
        assert_eq!(t.confirmed(want.len()).await, want);
        let handle = t.stop().await;
        assert_eq!(
            ids(&handle.confirmed()),
            want,
            "no duplicate of the first run, nothing twice"
        );
        let (file, pos, _) = db.stored(&name).await.expect("a stored position");
        let before = (stored[i].0.clone(), stored[i].1);
        assert!(
            binlog_ge(&(file.clone(), pos), &before) && (file, pos) != before,
            "tenant {name}'s stored position moved forward"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_added_behind_the_others_catches_up_on_its_own_stream_then_joins() {
    let hub_db = MyDb::create("hubsrv").await;
    let a = MyDb::create("hub_ahead").await;
    let d = MyDb::create("hub_behind").await;
    let (na, nd) = (unique("ahead"), unique("behind"));
    let h = hub(&hub_db, 8 * 1024 * 1024).await;

    // D's first start stores its position; it stops.
    let td = Tenant::start(&h, &d, &nd, None, false);
    until("D reads from the hub's stream", || async {
        h.stats().attached.load(Ordering::Relaxed) == 1
    })
    .await;
    td.stop().await;

    // A runs on the hub while D's database gets events D has not read.
    let ta = Tenant::start(&h, &a, &na, None, false);
    let first = produce(&[&a, &d], 20, "hub.while").await;
    assert_eq!(ta.confirmed(first[0].len()).await, first[0]);

    // D comes back behind the hub: its own stream from its stored position. Its sink holds
    // its confirmations, so it is still behind when the hub answers its join; the hub moves on
    // (A's writes) before D reads on.
    let joins = h.stats().joins.load(Ordering::Relaxed);
    let td = Tenant::start(&h, &d, &nd, Some(4 * 1024), true);
    until("D's relay holds events it cannot get confirmed", || async {
        !td.handle.held().is_empty()
    })
    .await;
    until("the hub answered D's join", || async {
        h.stats().joins.load(Ordering::Relaxed) > joins
    })
    .await;
    let mid = produce(&[&a], 5, "hub.mid").await.remove(0);
    let want_a: Vec<_> = first[0].iter().chain(&mid).copied().collect();
    assert_eq!(ta.confirmed(want_a.len()).await, want_a);
    assert!(
        td.handle.confirmed().len() < first[1].len(),
        "D was still behind"
    );
    td.release(first[1].len()).await;
    assert_eq!(
        ids(&td.handle.confirmed()),
        first[1],
        "D publishes what was written while it was stopped"
    );
    until("D joins the hub's stream after catching up", || async {
        h.stats().joins.load(Ordering::Relaxed) > joins
            && h.stats().attached.load(Ordering::Relaxed) == 2
    })
    .await;
    let second = produce(&[&a, &d], 5, "hub.joined").await;
    let want_a: Vec<_> = want_a.iter().chain(&second[0]).copied().collect();
    let want_d: Vec<_> = first[1].iter().chain(&second[1]).copied().collect();
    assert_eq!(ta.confirmed(want_a.len()).await, want_a);
    td.release(want_d.len()).await;
    assert_eq!(td.confirmed(want_d.len()).await, want_d);
    until("one dump thread once D joined", || async {
        dumps(&[&a, &d, &hub_db]).await == 1
    })
    .await;
    assert_eq!(
        ids(&ta.stop().await.confirmed()),
        want_a,
        "A: nothing twice"
    );
    assert_eq!(
        ids(&td.stop().await.confirmed()),
        want_d,
        "D: nothing twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tenant_is_detached_and_the_others_go_on() {
    let hub_db = MyDb::create("hubsrv").await;
    let a = MyDb::create("hub_busy").await;
    let s = MyDb::create("hub_stalled").await;
    let (na, ns) = (unique("busy"), unique("stalled"));
    // A small queue bound, and the stalled tenant's relay holds few bytes in flight.
    let h = hub(&hub_db, 32 * 1024).await;
    let ta = Tenant::start(&h, &a, &na, None, false);
    let ts = Tenant::start(&h, &s, &ns, Some(4 * 1024), false);
    until("both tenants read from the hub's stream", || async {
        h.stats().attached.load(Ordering::Relaxed) == 2
    })
    .await;

    // S's sink stops confirming: its relay fills its in-flight bytes and its source waits.
    ts.handle.hold_confirms();
    let stalled = produce(&[&s], 20, "hub.stalled").await.remove(0);
    until("S's relay holds events it cannot get confirmed", || async {
        !ts.handle.held().is_empty()
    })
    .await;
    assert_eq!(h.stats().detaches.load(Ordering::Relaxed), 0);

    // A is busy: S's queue fills with A's transaction boundaries until the hub detaches S, and
    // A gets all of its events while S is still stalled.
    let busy = produce(&[&a], 300, "hub.busy").await.remove(0);
    assert_eq!(ta.confirmed(busy.len()).await, busy, "A is not held back");
    until("the hub detached the stalled tenant", || async {
        h.stats().detaches.load(Ordering::Relaxed) >= 1
    })
    .await;
    assert!(
        ts.handle.confirmed().len() < stalled.len(),
        "S was still stalled while A went on"
    );

    // S's sink confirms again: S publishes all of its events, once, in order.
    ts.release(stalled.len()).await;
    assert_eq!(ids(&ts.handle.confirmed()), stalled);
    assert_eq!(ids(&ta.stop().await.confirmed()), busy);
    for id in ts.handle.held() {
        ts.handle.confirm(id);
    }
    assert_eq!(
        ids(&ts.stop().await.confirmed()),
        stalled,
        "S: nothing twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_shared_stream_sends_its_tenants_to_their_own_until_it_is_back() {
    let hub_db = MyDb::create("hubsrv").await;
    let dbs = [MyDb::create("hub_k1").await, MyDb::create("hub_k2").await];
    let names = [unique("kill1"), unique("kill2")];
    let h = hub(&hub_db, 8 * 1024 * 1024).await;
    let tenants: Vec<Tenant> = dbs
        .iter()
        .zip(&names)
        .map(|(db, n)| Tenant::start(&h, db, n, None, false))
        .collect();
    until("both tenants read from the hub's stream", || async {
        h.stats().attached.load(Ordering::Relaxed) == 2
    })
    .await;
    let before = produce(&[&dbs[0], &dbs[1]], 5, "hub.before").await;
    for (t, w) in tenants.iter().zip(&before) {
        assert_eq!(&t.confirmed(w.len()).await, w);
    }

    // The server ends the hub's dump thread: the tenants read on their own, then join again.
    let id = hub_db.dump_thread().await.expect("the hub's dump thread");
    let mut admin = my_connect(None).await;
    crate::common::my_exec(&mut admin, &format!("KILL {id}")).await;
    let during = produce(&[&dbs[0], &dbs[1]], 5, "hub.during").await;
    until(
        "the hub detached its tenants and opened its stream again",
        || async {
            h.stats().detaches.load(Ordering::Relaxed) >= 2
                && h.stats().dumps_opened.load(Ordering::Relaxed) >= 2
                && h.stats().attached.load(Ordering::Relaxed) == 2
        },
    )
    .await;
    let after = produce(&[&dbs[0], &dbs[1]], 5, "hub.after").await;
    for (i, t) in tenants.into_iter().enumerate() {
        let want: Vec<_> = before[i]
            .iter()
            .chain(&during[i])
            .chain(&after[i])
            .copied()
            .collect();
        assert_eq!(t.confirmed(want.len()).await, want);
        assert_eq!(
            ids(&t.stop().await.confirmed()),
            want,
            "nothing lost or twice across the break"
        );
    }
}
