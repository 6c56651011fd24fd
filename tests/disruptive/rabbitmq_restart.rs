//! The broker goes away under a running relay: `rabbitmqctl stop_app` / `start_app` mid-stream,
//! an outage longer than Postgres' `wal_sender_timeout`, and a memory alarm that blocks
//! publishers, under a Postgres and a MariaDB relay. These tests disturb the shared broker, so
//! they live in the `disruptive` test binary (cargo runs test binaries one after another) and
//! run one at a time inside it ([`crate::ALONE`]); every one
//! restores the broker (and the server setting it changed) in a Drop guard, also on panic.

use crate::common;

use common::amqp::{self, message_id, Topology};
use common::*;
use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// One broker-disturbing test at a time (the binary's lock).
use crate::ALONE as SERIAL;

fn rabbitmqctl(args: &[&str]) -> Result<String, String> {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl {args:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "rabbitmqctl {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Retries a restoring command for up to a minute: a guard must not give up on a busy machine.
fn restore(what: &str, f: impl Fn() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match f() {
            Ok(()) => return,
            Err(e) if Instant::now() > deadline => {
                eprintln!("could not {what}: {e}; run scripts/services.sh");
                return;
            }
            Err(_) => std::thread::sleep(Duration::from_secs(1)),
        }
    }
}

fn start_broker() -> Result<(), String> {
    rabbitmqctl(&["start_app"])?;
    rabbitmqctl(&["await_startup", "--timeout", "120"]).map(|_| ())
}

/// The RabbitMQ application is stopped while this lives; dropping it starts it again.
struct BrokerStopped {
    running: bool,
}

impl BrokerStopped {
    fn stop() -> BrokerStopped {
        rabbitmqctl(&["stop_app"]).expect("stop RabbitMQ");
        BrokerStopped { running: false }
    }

    fn start(&mut self) {
        start_broker().expect("start RabbitMQ");
        self.running = true;
    }
}

impl Drop for BrokerStopped {
    fn drop(&mut self) {
        if !self.running {
            restore("restart RabbitMQ after the test", start_broker);
        }
    }
}

/// A memory alarm (high watermark 0) while this lives; dropping it restores the watermark.
struct MemoryAlarm {
    watermark: String,
}

impl MemoryAlarm {
    fn raise() -> MemoryAlarm {
        let watermark = rabbitmqctl(&["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."])
            .expect("read the memory watermark")
            .trim()
            .to_string();
        assert!(
            watermark.parse::<f64>().is_ok(),
            "unexpected watermark {watermark:?} (only relative watermarks are restored)"
        );
        rabbitmqctl(&["set_vm_memory_high_watermark", "0"]).expect("raise a memory alarm");
        MemoryAlarm { watermark }
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        restore("restore the memory watermark", || {
            rabbitmqctl(&["set_vm_memory_high_watermark", &self.watermark]).map(|_| ())
        });
    }
}

/// `wal_sender_timeout` set cluster-wide while this lives; restored (ALTER SYSTEM) on drop.
struct WalSenderTimeout {
    /// The value from postgresql.auto.conf, or None when it was not set there.
    previous: Option<String>,
}

impl WalSenderTimeout {
    async fn set(value: &str) -> WalSenderTimeout {
        let c = pg_connect(PG_ADMIN).await;
        let previous: Option<String> = c
            .query_opt(
                "SELECT setting FROM pg_file_settings WHERE name = 'wal_sender_timeout' AND sourcefile LIKE '%postgresql.auto.conf' ORDER BY seqno DESC LIMIT 1",
                &[],
            )
            .await
            .unwrap()
            .map(|r| r.get(0));
        // ALTER SYSTEM cannot run in a (multi-statement, implicit) transaction block.
        c.simple_query(&format!("ALTER SYSTEM SET wal_sender_timeout = '{value}'"))
            .await
            .unwrap();
        c.simple_query("SELECT pg_reload_conf()").await.unwrap();
        let guard = WalSenderTimeout { previous };
        let want = value.to_string();
        wait_for("the new wal_sender_timeout to be in effect", T, || {
            let want = want.clone();
            async move {
                let c = pg_connect(PG_ADMIN).await;
                let v: String = c
                    .query_one("SHOW wal_sender_timeout", &[])
                    .await
                    .unwrap()
                    .get(0);
                v == want
            }
        })
        .await;
        guard
    }
}

impl Drop for WalSenderTimeout {
    fn drop(&mut self) {
        let previous = self.previous.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let sql = match &previous {
                    Some(v) => format!("ALTER SYSTEM SET wal_sender_timeout = '{v}'"),
                    None => "ALTER SYSTEM RESET wal_sender_timeout".into(),
                };
                // Other tests on this machine may restart Postgres: keep trying for a minute
                // rather than leave a 5 s timeout behind for everyone.
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let done = async {
                        let (c, conn) =
                            tokio_postgres::connect(PG_ADMIN, tokio_postgres::NoTls).await?;
                        tokio::spawn(conn);
                        c.simple_query(&sql).await?;
                        c.simple_query("SELECT pg_reload_conf()").await?;
                        Ok::<_, tokio_postgres::Error>(())
                    }
                    .await;
                    match done {
                        Ok(()) => return,
                        Err(e) if Instant::now() > deadline => {
                            eprintln!("could not restore wal_sender_timeout ({sql}): {e}");
                            return;
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
                    }
                }
            });
        })
        .join();
    }
}

fn start_relay(db: &PgDb, name: &str, exchange: &str, extra: &[&str]) -> Relay {
    let dsn = db.dsn();
    let mut args = vec![
        "run",
        "--source",
        &dsn,
        "--name",
        name,
        "--exchange",
        exchange,
        "--log-level",
        "info,lapin=off",
    ];
    args.extend_from_slice(extra);
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", &amqp::url())])
}

async fn wal_end(client: &tokio_postgres::Client) -> u64 {
    let s: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    outboxd::event::parse_lsn(&s).unwrap()
}

async fn confirmed(db: &PgDb, slot: &str) -> Option<u64> {
    db.slot_confirmed(slot)
        .await
        .and_then(|s| outboxd::event::parse_lsn(&s))
}

async fn wait_confirmed_past(db: &PgDb, slot: &str, lsn: u64) {
    wait_for(
        &format!("slot {slot} confirmed past {lsn:X}"),
        T,
        || async { confirmed(db, slot).await.is_some_and(|c| c >= lsn) },
    )
    .await;
}

fn assert_none_lost(got: &[Uuid], expected: &[Uuid]) {
    let set: HashSet<&Uuid> = got.iter().collect();
    let missing = expected.iter().filter(|i| !set.contains(i)).count();
    assert_eq!(missing, 0, "{missing} of {} events lost", expected.len());
    let want: HashSet<&Uuid> = expected.iter().collect();
    let mut seen = HashSet::new();
    let first: Vec<&Uuid> = got
        .iter()
        .filter(|i| want.contains(i) && seen.insert(*i))
        .collect();
    assert!(
        first.iter().copied().eq(expected.iter()),
        "first deliveries are in commit order"
    );
}

async fn write(db: &PgDb, n_tx: usize, topic: &str) -> Vec<Uuid> {
    let mut c = db.client().await;
    write_events(&mut c, n_tx, 100, topic).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_stopped_and_started_mid_stream_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let db = PgDb::create("rmqrs").await;
    let mut topo = Topology::new("xrs").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(&db, &name, &topo.exchange, &["--confirm-timeout", "5s"]);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;

    let conninfo = db.conninfo();
    let writer = tokio::spawn(async move {
        let mut c = pg_connect(&conninfo).await;
        write_events(&mut c, 40, 100, "restart.stream").await
    });
    wait_for("1,000 events before the broker stops", T, || async {
        topo.queue_len(&all).await >= 1000
    })
    .await;
    let mut broker = BrokerStopped::stop();
    wait_for("the relay to fail over to reconnecting", T, || {
        let err = relay.stderr();
        async move { err.contains("sink still unavailable") }
    })
    .await;
    let expected = writer.await.unwrap();
    broker.start();
    // Before the stop: a relay that had nothing unconfirmed when the broker went away stops
    // at once on SIGTERM, without waiting for the broker (relay::RelayOptions::stop).
    relay.wait_for_stderr(&["sink recovered"], T).await;
    let client = db.client().await;
    let end = wal_end(&client).await;
    wait_confirmed_past(&db, &slot, end).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert!(relay.stderr().contains("sink recovered"));

    let got: Vec<Uuid> = topo.take_all(&all).await.iter().map(message_id).collect();
    assert_none_lost(&got, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_away_longer_than_wal_sender_timeout_keeps_the_slot() {
    let _serial = SERIAL.lock().await;
    let _timeout = WalSenderTimeout::set("5s").await;
    let db = PgDb::create("rmqrw").await;
    let mut topo = Topology::new("xrw").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(&db, &name, &topo.exchange, &["--confirm-timeout", "5s"]);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;

    let mut expected = write(&db, 10, "before.outage").await;
    wait_for("the first 1,000 events", T, || async {
        topo.queue_len(&all).await >= 1000
    })
    .await;
    let mut broker = BrokerStopped::stop();
    let down_at = Instant::now();
    expected.extend(write(&db, 10, "during.outage").await);
    // The condition is the outage itself: three wal_sender_timeouts with the broker away,
    // the relay alive and its slot intact all along.
    let outage = Duration::from_secs(15);
    wait_for("the broker to be away for 3 × wal_sender_timeout", T, || {
        let alive = relay.child.try_wait().unwrap().is_none();
        let elapsed = down_at.elapsed();
        let slot = slot.clone();
        async move {
            assert!(alive, "the relay exited during the outage");
            let c = pg_connect(PG_ADMIN).await;
            let status: Option<String> = c
                .query_opt(
                    "SELECT coalesce(wal_status, '') FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .unwrap()
                .map(|r| r.get(0));
            assert!(
                status.as_deref().is_some_and(|s| s != "lost"),
                "slot {slot} is gone or lost: {status:?}"
            );
            elapsed >= outage
        }
    })
    .await;
    let before_restart = confirmed(&db, &slot).await.unwrap();
    broker.start();
    expected.extend(write(&db, 10, "after.outage").await);
    let client = db.client().await;
    let end = wal_end(&client).await;
    assert!(before_restart < end);
    wait_confirmed_past(&db, &slot, end).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());

    let got: Vec<Uuid> = topo.take_all(&all).await.iter().map(message_id).collect();
    assert_none_lost(&got, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_alarm_blocks_publishing_and_holds_the_position() {
    let _serial = SERIAL.lock().await;
    let db = PgDb::create("rmqra").await;
    let mut topo = Topology::new("xra").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    // The alarm outlasts the confirm timeout: flow control, not a failure to reconnect from.
    let confirm_timeout = Duration::from_secs(2);
    let mut relay = start_relay(&db, &name, &topo.exchange, &["--confirm-timeout", "2s"]);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;

    let mut expected = write(&db, 1, "before.alarm").await;
    wait_for("the first 100 events", T, || async {
        topo.queue_len(&all).await >= 100
    })
    .await;
    let alarm = MemoryAlarm::raise();
    expected.extend(write(&db, 2, "during.alarm").await);
    let client = db.client().await;
    let end = wal_end(&client).await;
    wait_for("the relay to report the blocked connection", T, || {
        let err = relay.stderr();
        async move { err.contains("RabbitMQ blocked the connection") }
    })
    .await;
    // The publish that meets the alarm may still be routed; the rest waits.
    assert!(
        topo.queue_len(&all).await < 300,
        "publishing is held during the alarm"
    );
    assert!(
        confirmed(&db, &slot).await.unwrap() < end,
        "the position stays while publishing is blocked"
    );
    // The scenario: the alarm lasts more than twice the confirm timeout.
    tokio::time::sleep(confirm_timeout * 2 + Duration::from_millis(500)).await;
    assert!(
        !relay.stderr().contains("sink failed"),
        "an alarm longer than --confirm-timeout made the relay reconnect:\n{}",
        relay.stderr()
    );
    drop(alarm);
    wait_confirmed_past(&db, &slot, end).await;
    assert!(relay.stderr().contains("RabbitMQ unblocked the connection"));
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert!(
        !relay.stderr().contains("sink failed"),
        "no reconnect, so no republish:\n{}",
        relay.stderr()
    );

    let got: Vec<Uuid> = topo.take_all(&all).await.iter().map(message_id).collect();
    assert_none_lost(&got, &expected);
    assert_eq!(
        got.len(),
        expected.len(),
        "no duplicates without a reconnect"
    );
}

/// `--partitions 4` across a broker restart: the partition comes from the aggregate id alone,
/// so no aggregate changes queue; nothing is lost; per aggregate the first deliveries keep
/// commit order (a republished duplicate may follow a later event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_keep_every_aggregate_in_its_queue_across_a_broker_restart() {
    use common::partitions::{
        by_aggregate, check_layout, write_interleaved, write_interleaved_paced,
    };
    let _serial = SERIAL.lock().await;
    let db = PgDb::create("rmqrp").await;
    let mut topo = Topology::new("xrp").await;
    let x = topo.exchange.clone();
    let queues = topo.adopt_partitions(&x, 4, false);
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(
        &db,
        &name,
        &x,
        &["--partitions", "4", "--confirm-timeout", "5s"],
    );
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;

    // 200 aggregates × 50 events: the first 25 of each streamed over several seconds (the
    // broker stops while they stream), the other 25 while it is away.
    let conninfo = db.conninfo();
    let writer = tokio::spawn(async move {
        let mut c = pg_connect(&conninfo).await;
        let pause = Some(Duration::from_millis(100));
        write_interleaved_paced(
            &mut c,
            200,
            25,
            31,
            |_, _| "restart.partitioned".into(),
            pause,
        )
        .await
    });
    let in_queues = || async {
        let mut n = 0;
        for q in &queues {
            n += topo.queue_len(q).await;
        }
        n
    };
    wait_for("1,000 events in the partition queues", T, || async {
        in_queues().await >= 1000
    })
    .await;
    let mut broker = BrokerStopped::stop();
    wait_for("the relay to fail over to reconnecting", T, || {
        let err = relay.stderr();
        async move { err.contains("sink still unavailable") }
    })
    .await;
    let mut written = writer.await.unwrap();
    let mut c = db.client().await;
    written
        .extend(write_interleaved(&mut c, 200, 25, 32, |_, _| "restart.partitioned".into()).await);
    broker.start();
    relay.wait_for_stderr(&["sink recovered"], T).await;
    let end = wal_end(&c).await;
    wait_confirmed_past(&db, &slot, end).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert!(relay.stderr().contains("sink recovered"));

    let mut got = Vec::new();
    for q in &queues {
        got.push(topo.take_all(q).await);
    }
    let report = check_layout(
        "--partitions 4 across a broker restart",
        &got,
        Some("x-partition"),
        true,
        &by_aggregate(&written),
    );
    assert!(
        report.per_queue.iter().all(|&n| n > 0),
        "{:?}",
        report.per_queue
    );
    eprintln!(
        "per queue {:?}, {} duplicates after the restart",
        report.per_queue, report.duplicates
    );
}

// ---------------------------------------------------------------------------------------------
// The same broker faults under a MariaDB relay.
// ---------------------------------------------------------------------------------------------

fn start_my_relay(db: &MyDb, name: &str, exchange: &str, extra: &[&str]) -> Relay {
    let dsn = db.dsn();
    let mut args = vec![
        "run",
        "--source",
        &dsn,
        "--name",
        name,
        "--exchange",
        exchange,
        "--log-level",
        "info,lapin=off",
    ];
    args.extend_from_slice(extra);
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", &amqp::url())])
}

/// Waits until relay `name` stored a position at or past `head`.
async fn wait_stored_past(db: &MyDb, name: &str, head: &(String, u64)) {
    wait_for(
        &format!("{name}'s position stored past {head:?}"),
        T,
        || async {
            db.stored(name)
                .await
                .is_some_and(|(f, p, _)| binlog_ge(&(f, p), head))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_broker_stopped_and_started_mid_stream_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let db = MyDb::create("my_rmqrs").await;
    let mut topo = Topology::new("xmrs").await;
    let name = unique("r");
    let mut relay = start_my_relay(&db, &name, &topo.exchange, &["--confirm-timeout", "5s"]);
    wait_for("the relay's binlog stream", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;

    let mut c = db.conn().await;
    let writer =
        tokio::spawn(async move { my_write_events(&mut c, 40, 100, "restart.stream").await });
    wait_for("1,000 events before the broker stops", T, || async {
        topo.queue_len(&all).await >= 1000
    })
    .await;
    let mut broker = BrokerStopped::stop();
    wait_for("the relay to fail over to reconnecting", T, || {
        let err = relay.stderr();
        async move { err.contains("sink still unavailable") }
    })
    .await;
    let expected = writer.await.unwrap();
    broker.start();
    // Before the stop: the writer can finish before the broker goes away, and a relay with
    // nothing unconfirmed stops at once on SIGTERM without reconnecting (RelayOptions::stop).
    relay.wait_for_stderr(&["sink recovered"], T).await;
    let head = db.head_past_writes().await;
    wait_stored_past(&db, &name, &head).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert!(relay.stderr().contains("sink recovered"));

    let got: Vec<Uuid> = topo.take_all(&all).await.iter().map(message_id).collect();
    assert_none_lost(&got, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_memory_alarm_blocks_publishing_and_holds_the_position() {
    let _serial = SERIAL.lock().await;
    let db = MyDb::create("my_rmqra").await;
    let mut topo = Topology::new("xmra").await;
    let name = unique("r");
    let confirm_timeout = Duration::from_secs(2);
    let mut relay = start_my_relay(&db, &name, &topo.exchange, &["--confirm-timeout", "2s"]);
    wait_for("the relay's binlog stream", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;

    let mut c = db.conn().await;
    let mut expected = my_write_events(&mut c, 1, 100, "before.alarm").await;
    wait_for("the first 100 events", T, || async {
        topo.queue_len(&all).await >= 100
    })
    .await;
    let before_alarm = db.head_past_writes().await;
    wait_stored_past(&db, &name, &before_alarm).await;
    let alarm = MemoryAlarm::raise();
    expected.extend(my_write_events(&mut c, 2, 100, "during.alarm").await);
    let head = db.head_past_writes().await;
    wait_for("the relay to report the blocked connection", T, || {
        let err = relay.stderr();
        async move { err.contains("RabbitMQ blocked the connection") }
    })
    .await;
    assert!(
        topo.queue_len(&all).await < 300,
        "publishing is held during the alarm"
    );
    let stored = db.stored(&name).await.map(|(f, p, _)| (f, p)).unwrap();
    assert!(
        !binlog_ge(&stored, &head),
        "the position stays while publishing is blocked: {stored:?} vs head {head:?}"
    );
    // The scenario: the alarm lasts more than twice the confirm timeout.
    tokio::time::sleep(confirm_timeout * 2 + Duration::from_millis(500)).await;
    assert!(
        !relay.stderr().contains("sink failed"),
        "an alarm longer than --confirm-timeout made the relay reconnect:\n{}",
        relay.stderr()
    );
    drop(alarm);
    wait_stored_past(&db, &name, &head).await;
    assert!(relay.stderr().contains("RabbitMQ unblocked the connection"));
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let got: Vec<Uuid> = topo.take_all(&all).await.iter().map(message_id).collect();
    assert_none_lost(&got, &expected);
    assert_eq!(
        got.len(),
        expected.len(),
        "no duplicates without a reconnect"
    );
}

/// The RabbitMQ stream sink (docs/rabbitmq-stream.md) with the broker stopped and started
/// under it while a producer writes all along: afterwards every committed event is in the
/// stream exactly once, in commit order per aggregate (the producer's publishing ids carry
/// over the restart: the broker kept its deduplication state with the stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_sink_broker_restarted_mid_stream_exactly_once() {
    use common::rmq_stream::{assert_ordered, TestStream};
    use common::source_db::SourceDb;
    let _serial = SERIAL.lock().await;
    let db = PgDb::create("rmqss").await;
    let s = TestStream::new("rss");
    let name = unique("rs");
    let dsn = db.dsn();
    let args = s.run_args(&dsn, &name, &["--confirm-timeout", "5s"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    db.wait_streaming(&name).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = db.write_until(stop.clone(), 5, Duration::from_millis(20), "rss.stream");
    wait_for(
        "200 events in the stream before the broker stops",
        T,
        || async { s.holds_at_least(200, Duration::from_secs(5)).await },
    )
    .await;
    let t0 = Instant::now();
    let mut broker = BrokerStopped::stop();
    eprintln!("broker stopped in {:?}", t0.elapsed());
    relay.wait_for_stderr(&["sink still unavailable"], T).await;
    eprintln!("relay reconnecting after {:?}", t0.elapsed());
    broker.start();
    eprintln!("broker started after {:?}", t0.elapsed());
    relay.wait_for_stderr(&["sink recovered"], T).await;
    eprintln!("relay recovered after {:?}", t0.elapsed());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let expected = writer.await.unwrap();
    let msgs = s.read(expected.len(), T).await;
    let got: Vec<Uuid> = msgs.iter().map(|m| m.id).collect();
    let unique_got: HashSet<&Uuid> = got.iter().collect();
    assert_eq!(unique_got.len(), got.len(), "duplicates in the stream");
    assert_eq!(
        unique_got,
        expected.iter().collect::<HashSet<_>>(),
        "the stream differs from what was committed ({} in it, {} committed)",
        got.len(),
        expected.len()
    );
    assert_ordered(&msgs);
    relay.sigkill();
    s.delete(0).await;
}
