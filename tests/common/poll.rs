//! Poll-mode scenarios shared by the Postgres and MariaDB tests (`pg_poll.rs`,
//! `mysql_poll.rs`): the same faults and assertions over either database.

use super::amqp::Topology;
use super::proxy::FaultProxy;
use super::*;
use std::collections::{HashMap, HashSet};
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// What a scenario needs of a test database.
#[allow(async_fn_in_trait)]
pub trait PollDb {
    fn dsn(&self) -> String;
    /// The DSN through a proxy listening on `port`.
    fn dsn_via(&self, port: u16) -> String;
    /// The server's port on 127.0.0.1 (what a proxy forwards to).
    fn server_port(&self) -> u16;
    /// Rows not yet marked published.
    async fn pending_ids(&self) -> HashSet<Uuid>;
    /// Writes `n_tx` transactions of `per_tx` events; returns their ids.
    async fn write(&self, n_tx: usize, per_tx: usize, topic: &str) -> Vec<Uuid>;
    /// Ends every other session on this test's database from the server side
    /// (`pg_terminate_backend`, MariaDB `KILL`); returns how many it ended.
    async fn kill_sessions(&self) -> usize;
}

impl PollDb for PgDb {
    fn dsn(&self) -> String {
        PgDb::dsn(self)
    }

    fn dsn_via(&self, port: u16) -> String {
        PgDb::dsn_via(self, port)
    }

    fn server_port(&self) -> u16 {
        self.port
    }

    async fn pending_ids(&self) -> HashSet<Uuid> {
        self.client()
            .await
            .query(
                "SELECT id FROM outbox WHERE status = 'pending' OR published_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    async fn write(&self, n_tx: usize, per_tx: usize, topic: &str) -> Vec<Uuid> {
        write_events(&mut self.client().await, n_tx, per_tx, topic).await
    }

    async fn kill_sessions(&self) -> usize {
        pg_admin_connect(self.port)
            .await
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                &[&self.name],
            )
            .await
            .unwrap()
            .len()
    }
}

impl PollDb for MyDb {
    fn dsn(&self) -> String {
        MyDb::dsn(self)
    }

    fn dsn_via(&self, port: u16) -> String {
        MyDb::dsn_via(self, port)
    }

    fn server_port(&self) -> u16 {
        MY_PORT
    }

    async fn pending_ids(&self) -> HashSet<Uuid> {
        use mysql_async::prelude::Queryable;
        let mut c = self.conn().await;
        let rows: Vec<Vec<u8>> = c
            .query("SELECT id FROM outbox WHERE status = 'pending' OR published_at IS NULL")
            .await
            .unwrap();
        let _ = c.disconnect().await;
        rows.into_iter()
            .map(|b| Uuid::from_slice(&b).unwrap())
            .collect()
    }

    async fn write(&self, n_tx: usize, per_tx: usize, topic: &str) -> Vec<Uuid> {
        my_write_events(&mut self.conn().await, n_tx, per_tx, topic).await
    }

    async fn kill_sessions(&self) -> usize {
        use mysql_async::prelude::Queryable;
        let mut c = my_connect(None).await;
        let ids: Vec<u64> = c
            .exec(
                "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = ? AND ID <> CONNECTION_ID()",
                (self.name.clone(),),
            )
            .await
            .unwrap();
        for id in &ids {
            // A session that ended meanwhile is no error for the test.
            let _ = c.query_drop(format!("KILL {id}")).await;
        }
        let _ = c.disconnect().await;
        ids.len()
    }
}

pub fn ids(relay: &Relay) -> Vec<Uuid> {
    parse_lines(&relay.lines())
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// `run --mode poll` to stdout with `--commit-offsets`.
pub fn stdout_args<'a>(
    dsn: &'a str,
    name: &'a str,
    interval: &'a str,
    batch: &'a str,
) -> Vec<&'a str> {
    vec![
        "run",
        "--mode",
        "poll",
        "--source",
        dsn,
        "--name",
        name,
        "--commit-offsets",
        "--poll-interval",
        interval,
        "--poll-batch",
        batch,
    ]
}

async fn all_marked(db: &impl PollDb) -> bool {
    db.pending_ids().await.is_empty()
}

/// Three relays on one table while 10,000 events are written: every event published exactly
/// once, every row marked, all three progressed.
pub async fn three_relays_each_event_once(db: &(impl PollDb + Sync)) {
    let dsn = db.dsn();
    let relays: Vec<Relay> = ["p0", "p1", "p2"]
        .iter()
        .map(|n| Relay::start(&stdout_args(&dsn, n, "50ms", "100")))
        .collect();
    let expected = db.write(100, 100, "poll.three").await;
    wait_for("every row marked published", T, || all_marked(db)).await;
    let mut counts: HashMap<Uuid, usize> = HashMap::new();
    let mut per_relay = Vec::new();
    for r in &relays {
        let got = ids(r);
        per_relay.push(got.len());
        for i in got {
            *counts.entry(i).or_default() += 1;
        }
    }
    let twice = counts.values().filter(|&&n| n != 1).count();
    assert_eq!(twice, 0, "every event exactly once across the relays");
    assert!(
        expected.iter().all(|i| counts.get(i) == Some(&1)),
        "every event published"
    );
    assert_eq!(counts.len(), expected.len(), "nothing else");
    assert!(
        per_relay.iter().all(|&n| n > 0),
        "all three progressed: {per_relay:?}"
    );
}

/// SIGKILL in the middle of a batch: what the killed relay published but had not marked is
/// published again by the next one; nothing is lost. The kill is forced mid-batch: the relay's
/// database connection (through the proxy) is stalled, so a batch it has claimed and published
/// cannot be marked; the kill comes once such rows exist. A stall that caught the relay while
/// claiming (nothing published) is resumed and tried again.
pub async fn sigkill_between_publish_and_mark(db: &(impl PollDb + Sync)) {
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", db.server_port()).parse().unwrap())
        .await
        .unwrap();
    let dsn = db.dsn_via(proxy.port());
    let args = stdout_args(&dsn, "k", "20ms", "50");
    let mut first = Relay::start(&args);
    let writer = db.write(60, 100, "poll.kill");
    let kill = async {
        wait_for("some published", T, || {
            let n = first.line_count();
            async move { n >= 1500 }
        })
        .await;
        // Published but not marked: a plain read (straight to the server, not through the
        // proxy) does not wait for the relay's row locks and sees those rows pending.
        let unmarked_now = |first: &Relay| {
            let before: Vec<Uuid> = ids(first);
            async move {
                let pending = db.pending_ids().await;
                before
                    .into_iter()
                    .filter(|i| pending.contains(i))
                    .collect::<HashSet<Uuid>>()
            }
        };
        let mut attempts = 0;
        loop {
            attempts += 1;
            assert!(
                attempts <= 20,
                "no stall caught a published batch in 20 attempts"
            );
            proxy.stall();
            let caught = tokio::time::timeout(Duration::from_secs(3), async {
                loop {
                    if !unmarked_now(&first).await.is_empty() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await;
            if caught.is_ok() {
                break;
            }
            proxy.resume();
            let n = first.line_count();
            wait_for("the relay publishes again", T, || {
                let m = first.line_count();
                async move { m > n }
            })
            .await;
        }
        first.sigkill();
        // Reset the stalled connections before resuming: the relay may have sent its mark
        // (or COMMIT) into the stalled proxy just before the kill, and a plain resume would
        // still deliver it to the server. Reset, the server rolls the batch back.
        proxy.cut();
        proxy.resume();
        let unmarked = unmarked_now(&first).await;
        (ids(&first), unmarked)
    };
    let (expected, (before, unmarked)) = tokio::join!(writer, kill);
    assert!(
        !unmarked.is_empty(),
        "the kill came in the middle of a batch: published rows were not yet marked"
    );
    let second = Relay::start(&args);
    wait_for("every row marked", T, || all_marked(db)).await;
    let again: HashSet<Uuid> = ids(&second).into_iter().collect();
    let mut got: HashSet<Uuid> = before.iter().copied().collect();
    got.extend(&again);
    let lost: Vec<_> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(lost.is_empty(), "{} of {} lost", lost.len(), expected.len());
    let missing: Vec<_> = unmarked.iter().filter(|i| !again.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} published-but-unmarked rows not republished",
        missing.len(),
        unmarked.len()
    );
    eprintln!(
        "killed mid-batch with {} published-but-unmarked rows; all republished",
        unmarked.len()
    );
}

/// One of three relays loses its broker connection (through the fault proxy): the others
/// publish everything meanwhile; its rows are published later; nothing is lost.
pub async fn one_relays_broker_cut(db: &(impl PollDb + Sync), prefix: &str) {
    let mut topo = Topology::new(prefix).await;
    let dsn = db.dsn();
    let proxy = FaultProxy::start(
        format!("127.0.0.1:{}", super::amqp::HOST_PORT)
            .parse()
            .unwrap(),
    )
    .await
    .unwrap();
    let url_cut = super::amqp::url_via(proxy.port());
    let url = super::amqp::url();
    let mk = |name: &str, sink: &str| {
        Relay::start(&[
            "run",
            "--mode",
            "poll",
            "--source",
            &dsn,
            "--name",
            name,
            "--sink",
            sink,
            "--exchange",
            &topo.exchange,
            "--poll-interval",
            "20ms",
            "--poll-batch",
            "50",
            "--confirm-timeout",
            "2s",
        ])
    };
    let _a = mk("a", &url_cut);
    let _b = mk("b", &url);
    let _c = mk("c", &url);
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "#").await;
    let mut expected = db.write(10, 50, "cut.before").await;
    proxy.block();
    proxy.cut();
    expected.extend(db.write(20, 50, "cut.during").await);
    wait_for(
        "the others publish everything while one is cut off",
        T,
        || all_marked(db),
    )
    .await;
    proxy.unblock();
    expected.extend(db.write(10, 50, "cut.after").await);
    wait_for("everything marked after the cut", T, || all_marked(db)).await;
    // Duplicates are allowed (a batch released by the cut relay is published by another), so
    // take everything there is once all rows are marked.
    wait_for("at least every event in the queue", T, || async {
        topo.queue_len(&q).await as usize >= expected.len()
    })
    .await;
    let got: HashSet<Uuid> = topo
        .take_all(&q)
        .await
        .iter()
        .map(super::amqp::message_id)
        .collect();
    let lost: Vec<_> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(lost.is_empty(), "{} of {} lost", lost.len(), expected.len());
}

/// How a scenario takes the relay's database sessions away.
#[derive(Clone, Copy, Debug)]
pub enum SessionLoss {
    /// Every connection through the proxy reset, and new ones refused while rows are written.
    ProxyCut,
    /// The server ends the sessions (`pg_terminate_backend`, MariaDB `KILL`).
    ServerKill,
}

/// The relay's database sessions are lost in the middle of its work: it reconnects with
/// backoff (the reconnect logged and counted in `outboxd_reconnects_total{cause="source"}`)
/// instead of exiting, and every row written before, during and after is published and marked.
pub async fn session_loss_reconnects(db: &(impl PollDb + Sync), loss: SessionLoss, name: &str) {
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", db.server_port()).parse().unwrap())
        .await
        .unwrap();
    let dsn = db.dsn_via(proxy.port());
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = stdout_args(&dsn, name, "20ms", "50");
    args.extend(["--metrics-addr", &addr]);
    let relay = Relay::start(&args);
    let reconnects = || async {
        metric_value(
            &scrape_metrics(port).await,
            "outboxd_reconnects_total{cause=\"source\"}",
        )
        .unwrap_or(0.0)
    };
    let mut expected = db.write(5, 20, "loss.before").await;
    wait_for("every row marked before the loss", T, || all_marked(db)).await;
    let before = reconnects().await;
    match loss {
        SessionLoss::ProxyCut => {
            proxy.block();
            proxy.cut();
        }
        SessionLoss::ServerKill => {
            assert!(
                db.kill_sessions().await > 0,
                "the relay had sessions to end"
            );
        }
    }
    // An exiting relay fails here: its metrics endpoint goes away with it.
    wait_for("the reconnect counted", Duration::from_secs(30), || async {
        reconnects().await >= before + 1.0
    })
    .await;
    expected.extend(db.write(5, 20, "loss.during").await);
    proxy.unblock();
    expected.extend(db.write(5, 20, "loss.after").await);
    wait_for(
        "every row marked after the reconnect",
        Duration::from_secs(60),
        || all_marked(db),
    )
    .await;
    let got: HashSet<Uuid> = ids(&relay).into_iter().collect();
    let lost: Vec<_> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(lost.is_empty(), "{} of {} lost", lost.len(), expected.len());
    assert!(
        relay.stderr().contains("reconnecting"),
        "the reconnect is logged: {}",
        relay.stderr()
    );
}

/// A broker too slow to confirm a full batch within the deadline (every chunk through the
/// proxy delayed): the relay still marks rows while it stays slow — a batch released at the
/// deadline is not claimed again at the same size forever — and once the broker is freed every
/// row is marked and every event is in the queue.
pub async fn slow_broker_still_progresses(db: &(impl PollDb + Sync), prefix: &str) {
    let mut topo = Topology::new(prefix).await;
    let dsn = db.dsn();
    let proxy = FaultProxy::start(
        format!("127.0.0.1:{}", super::amqp::HOST_PORT)
            .parse()
            .unwrap(),
    )
    .await
    .unwrap();
    let url = super::amqp::url_via(proxy.port());
    let relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--source",
        &dsn,
        "--name",
        "slow",
        "--sink",
        &url,
        "--exchange",
        &topo.exchange,
        "--poll-interval",
        "20ms",
        "--poll-batch",
        "1000",
        "--confirm-timeout",
        "2s",
        // A small window keeps each event's own confirm well inside the timeout (the sink
        // never gives up on the broker); what is slow is the queue of a batch's events.
        "--window",
        "100",
    ]);
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "#").await;
    // At most 100 events per round trip of 2 x 150 ms: a full batch of 1,000 needs more than
    // the deadline, three of them one behind the other far more.
    proxy.set_delay(Duration::from_millis(150));
    let expected = db.write(1, 3000, "slow").await;
    let total = expected.len();
    wait_for(
        "a third of the rows marked while the broker is slow",
        Duration::from_secs(90),
        || async { db.pending_ids().await.len() <= total * 2 / 3 },
    )
    .await;
    assert!(
        proxy.delayed_chunks() > 0,
        "the slowdown hit the broker's traffic"
    );
    assert!(
        relay.stderr().contains("not confirmed in time"),
        "the first batches timed out: {}",
        relay.stderr()
    );
    proxy.set_delay(Duration::ZERO);
    wait_for("every row marked once the broker is freed", T, || {
        all_marked(db)
    })
    .await;
    wait_for("at least every event in the queue", T, || async {
        topo.queue_len(&q).await as usize >= total
    })
    .await;
    let got: HashSet<Uuid> = topo
        .take_all(&q)
        .await
        .iter()
        .map(super::amqp::message_id)
        .collect();
    let lost: Vec<_> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(lost.is_empty(), "{} of {} lost", lost.len(), expected.len());
}
