//! Faults on the Postgres → stdout path that need no server restart: a cut or stalled
//! connection (through the TCP fault proxy), a slot dropped or created again, cuts inside a
//! large transaction, memory under large payloads, and an idle outbox beside busy tables.
//! SIGKILL mid-stream and a second relay with the same name run on both sources from
//! `tests/relay/faults.rs`; Postgres restarts live in `tests/disruptive/pg_restart.rs`.

use crate::common;

use common::inproc::{end_lease, InProc, Settings};
use common::proxy::FaultProxy;
use common::*;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_and_stalled_connections_lose_nothing() {
    let db = PgDb::create("proxy").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let proxy = FaultProxy::start("127.0.0.1:5432".parse().unwrap())
        .await
        .unwrap();
    let dsn = db.dsn_via(proxy.port());
    let relay = InProc::postgres(&dsn, &Settings::new(&name));
    relay
        .wait_running("slot active", || db.slot_active(&slot))
        .await;
    let mut client = db.client().await;

    let mut expected = write_events(&mut client, 20, 100, "before.cut").await;
    relay.wait_count("first batch", 1000).await;
    // Cut every connection while more events are written: the relay reconnects and resumes.
    proxy.cut();
    expected.extend(write_events(&mut client, 20, 100, "during.cut").await);
    proxy.cut();
    expected.extend(write_events(&mut client, 20, 100, "after.cut").await);
    relay
        .wait_published("everything after the cuts", &expected)
        .await;
    // The relay itself saw both cuts and resumed (its log, not only the proxy's count).
    let reconnects = relay.logs().matches("replication stream broke").count();
    assert!(
        reconnects >= 2 && proxy.accepted() > 2,
        "the relay reconnected after each cut: {reconnects} reconnects logged, {} connections",
        proxy.accepted()
    );

    // Stall: the server sends the new WAL into the stalled connection (its walsender's
    // sent_lsn passes the writes) while the relay gets none of it; after resume, everything
    // arrives on the same connection, with no reconnect.
    proxy.stall();
    let stalled = write_events(&mut client, 10, 10, "during.stall").await;
    let head: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    wait_for("the walsender sent the stalled writes", T, || {
        let c = &client;
        let (slot, head) = (slot.clone(), head.clone());
        async move {
            c.query_opt(
                "SELECT 1 FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid WHERE s.slot_name = $1 AND r.sent_lsn >= $2::text::pg_lsn",
                &[&slot, &head],
            )
            .await
            .unwrap()
            .is_some()
        }
    })
    .await;
    let got: HashSet<Uuid> = relay.sink.published_ids().into_iter().collect();
    assert!(
        stalled.iter().all(|i| !got.contains(i)),
        "sent by the server, held by the stall: none reached the relay yet"
    );
    let accepted_at_stall = proxy.accepted();
    proxy.resume();
    expected.extend(stalled);
    relay
        .wait_published("everything after the stall", &expected)
        .await;
    assert_eq!(
        proxy.accepted(),
        accepted_at_stall,
        "a stall shorter than the timeouts needs no reconnect"
    );
    assert_none_lost(&expected, &relay.ids());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_dropped_while_stopped_is_a_lost_position() {
    let db = PgDb::create("lost").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let relay = InProc::postgres(&dsn, &Settings::new(&name));
    relay
        .wait_running("slot active", || db.slot_active(&slot))
        .await;
    relay.stop().await;
    db.drop_released_slot(&slot).await;

    let again = InProc::postgres(&dsn, &Settings::new(&name));
    let (code, err) = again.exit().await;
    assert_eq!(code, 3, "exit 3 = stored position lost; error:\n{err}");
    assert!(
        err.contains("does not exist") && err.contains("fix:"),
        "{err}"
    );
    assert!(err.contains("teardown"), "the fix says what to do: {err}");
    assert!(
        db.slot_confirmed(&slot).await.is_none(),
        "no slot silently re-created"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_beside_busy_tables_keeps_the_slot_near_the_head() {
    let db = PgDb::create("idle").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let relay = InProc::postgres(&dsn, &Settings::new(&name));
    relay
        .wait_running("slot active", || db.slot_active(&slot))
        .await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE busy (id bigserial primary key, v text)")
        .await
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        let client = db.client().await;
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                client
                    .execute(
                        "INSERT INTO busy (v) SELECT repeat('x', 200) FROM generate_series(1, 50)",
                        &[],
                    )
                    .await
                    .unwrap();
            }
        })
    };
    // While the other table keeps the WAL moving, the slot catches up with a head position
    // taken mid-load, without any outbox event to acknowledge.
    tokio::task::yield_now().await;
    let head: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let head = outboxd::event::parse_lsn(&head).unwrap();
    wait_for(
        "the slot to pass the head taken under load",
        Duration::from_secs(15),
        || async {
            db.slot_confirmed(&slot)
                .await
                .and_then(|s| outboxd::event::parse_lsn(&s))
                .is_some_and(|c| c >= head)
        },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.await.unwrap();
    assert_eq!(
        relay.sink.published_ids().len(),
        0,
        "no outbox events were written"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgoutput_bytes_from_the_server_decode() {
    use outboxd::source::postgres::pgoutput::{decode, Message, Value};
    let db = PgDb::create("wire").await;
    let client = db.client().await;
    let slot = unique("cap");
    client
        .batch_execute("CREATE PUBLICATION cap FOR TABLE outbox WITH (publish = 'insert')")
        .await
        .unwrap();
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
    let mut c2 = db.client().await;
    let ids = write_events(&mut c2, 2, 3, "wire.test").await;
    let rows = client
        .query(
            &format!("SELECT data FROM pg_logical_slot_get_binary_changes('{slot}', NULL, NULL, 'proto_version', '1', 'publication_names', 'cap')"),
            &[],
        )
        .await
        .unwrap();
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .unwrap();
    let msgs: Vec<Message> = rows
        .iter()
        .map(|r| decode(bytes::Bytes::from(r.get::<_, Vec<u8>>(0))).expect("server bytes decode"))
        .collect();
    let begins = msgs
        .iter()
        .filter(|m| matches!(m, Message::Begin { .. }))
        .count();
    let commits = msgs
        .iter()
        .filter(|m| matches!(m, Message::Commit { .. }))
        .count();
    assert_eq!((begins, commits), (2, 2));
    let rel = msgs
        .iter()
        .find_map(|m| match m {
            Message::Relation(r) => Some(r.clone()),
            _ => None,
        })
        .expect("a Relation message");
    assert_eq!(
        (rel.namespace.as_str(), rel.name.as_str()),
        ("public", "outbox")
    );
    let id_col = rel.columns.iter().position(|c| c.name == "id").unwrap();
    let inserted: Vec<Uuid> = msgs
        .iter()
        .filter_map(|m| match m {
            Message::Insert { tuple, .. } => match &tuple[id_col] {
                Value::Text(b) => Some(std::str::from_utf8(b).unwrap().parse().unwrap()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    assert_eq!(inserted, ids);
    // Every truncation of every captured message is an error, not a panic.
    for r in &rows {
        let data: Vec<u8> = r.get(0);
        for n in 0..data.len() {
            assert!(decode(bytes::Bytes::copy_from_slice(&data[..n])).is_err());
        }
    }
}

/// A connection cut while one large transaction streams: the server sends the transaction
/// again from its start, and the relay skips the events it already handed over (same commit
/// LSN and index), so every cut costs at most the events in flight, not everything before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuts_inside_a_large_transaction_resend_nothing_already_forwarded() {
    const ROWS: usize = 50_000;
    const CUTS: usize = 4;
    const WINDOW: usize = 1000;
    let db = PgDb::create("bigcut").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let proxy = FaultProxy::start("127.0.0.1:5432".parse().unwrap())
        .await
        .unwrap();
    let dsn = db.dsn_via(proxy.port());
    let relay = InProc::postgres(&dsn, &Settings::new(&name).window(WINDOW));
    relay
        .wait_running("slot active", || db.slot_active(&slot))
        .await;
    let client = db.client().await;
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload)
             SELECT gen_random_uuid(), 'agg-' || (g % 97), 'big.txn', json_build_object('n', g, 'pad', repeat('x', 100))
               FROM generate_series(1, $1::int) g",
            &[&(ROWS as i32)],
        )
        .await
        .unwrap();
    let started = std::time::Instant::now();

    // Cut at fixed points of the transaction's progress, so every cut lands inside it however
    // fast this machine streams.
    let mut cut_at = Vec::new();
    for k in 1..=CUTS {
        let threshold = ROWS * k / (CUTS + 1);
        relay
            .wait_count("progress inside the transaction", threshold)
            .await;
        let printed = relay.sink.published_ids().len();
        proxy.cut();
        cut_at.push(printed);
        eprintln!("cut {k} at {printed} lines after {:?}", started.elapsed());
        // The next cut only once the stream is back.
        let breaks = k;
        relay
            .wait_running("the stream broke and resumed", || {
                let seen = relay.logs().matches("replication stream broke").count();
                let active = db.slot_active(&slot);
                async move { seen >= breaks && active.await }
            })
            .await;
    }
    let all: Vec<Uuid> = client
        .query("SELECT id FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    relay.wait_published("the whole transaction", &all).await;
    eprintln!("streamed in {:?}", started.elapsed());
    relay.stop().await;
    let (logs, ids) = (relay.logs(), relay.ids());

    // Every cut landed inside the transaction and broke the replication stream.
    assert!(
        cut_at.iter().all(|&c| c > 0 && c < ROWS),
        "cuts inside the transaction: {cut_at:?}"
    );
    let breaks = logs.matches("replication stream broke").count();
    assert!(breaks >= CUTS, "{breaks} stream breaks for {CUTS} cuts");
    assert!(proxy.accepted() > CUTS as u64, "the relay reconnected");
    let distinct = ids.iter().collect::<HashSet<_>>().len();
    assert_eq!(distinct, ROWS, "every row of the transaction, once");
    let dups = ids.len() - distinct;
    eprintln!("{dups} duplicates over {CUTS} cuts at {cut_at:?}");
    assert!(
        dups <= CUTS * WINDOW,
        "{dups} duplicates for {CUTS} cuts (bound: {WINDOW} per cut); cuts at {cut_at:?}"
    );
}

/// Drops the slot (ending any walsender still holding it) and creates it again, empty, under
/// the same name, in the same database; returns the new slot's position.
pub(crate) async fn recreate_slot(db: &PgDb, slot: &str) -> String {
    let admin = db.client().await;
    wait_for("the slot dropped", T, || {
        let admin = &admin;
        async move {
            let _ = admin
                .execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active",
                    &[&slot],
                )
                .await;
            admin
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
                .is_ok()
        }
    })
    .await;
    admin
        .query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
}

/// A slot dropped and created again under the same name while the relay is stopped (after a
/// SIGKILL, so the row may trail the old slot) is a lost position: exit 3 with the fix, the
/// new slot left alone; with `--on-position-lost poll` the rows written meanwhile come again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_created_again_while_stopped_is_a_lost_position() {
    let db = PgDb::create("recreated").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let args = ["run", "--source", &dsn, "--name", &name, "--commit-offsets"];
    let mut relay = Relay::start(&args);
    wait_for("slot active", T, || db.slot_active(&slot)).await;
    let mut client = db.client().await;
    let before = write_events(&mut client, 5, 10, "before").await;
    wait_lines("the events before the kill", &relay, before.len(), T).await;
    relay.sigkill();

    // Written while the slot is being replaced: the new slot never sees them.
    let old_slot = db.slot_confirmed(&slot).await.unwrap();
    let skipped = write_events(&mut client, 2, 10, "skipped").await;
    let new_slot = recreate_slot(&db, &slot).await;

    let again = InProc::postgres(&dsn, &Settings::new(&name));
    let (code, err) = again.exit().await;
    assert_eq!(
        code, 3,
        "exit 3 = position lost (old slot at {old_slot}, new at {new_slot}); error:\n{err}"
    );
    assert!(
        err.contains("dropped and created again") && err.contains("fix:"),
        "{err}"
    );
    assert!(err.contains("--on-position-lost poll"), "the fix: {err}");
    assert!(
        again.sink.published_ids().is_empty(),
        "nothing streamed: {:?}",
        again.sink.published_ids()
    );
    assert_eq!(
        db.slot_confirmed(&slot).await.as_deref(),
        Some(new_slot.as_str()),
        "the slot is left as it was"
    );

    // The recovery policy publishes the skipped rows again from the table.
    end_lease(&db, &name).await;
    let recover = InProc::postgres(&dsn, &Settings::new(&name).position_lost_poll());
    recover
        .wait_published("the skipped rows, replayed", &skipped)
        .await;
    recover.stop().await;
}

/// A slot dropped and created again while the relay's connection is down: the reconnect
/// finds a slot ahead of everything it confirmed and stops with exit 3 instead of streaming
/// on from the new slot's position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_created_again_during_a_reconnect_is_a_lost_position() {
    let db = PgDb::create("recreated2").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let proxy = FaultProxy::start("127.0.0.1:5432".parse().unwrap())
        .await
        .unwrap();
    let dsn = db.dsn_via(proxy.port());
    let relay = InProc::postgres(&dsn, &Settings::new(&name));
    relay
        .wait_running("slot active", || db.slot_active(&slot))
        .await;
    let mut client = db.client().await;
    let before = write_events(&mut client, 3, 10, "before").await;
    relay
        .wait_published("the events before the cut", &before)
        .await;

    proxy.block();
    proxy.cut();
    let skipped = write_events(&mut client, 2, 10, "skipped").await;
    recreate_slot(&db, &slot).await;
    wait_for("a reconnect refused while the slot was replaced", T, || {
        let n = proxy.refused();
        async move { n > 0 }
    })
    .await;
    proxy.unblock();

    let (code, err) = relay.exit().await;
    let logs = relay.logs();
    assert!(
        logs.contains("replication stream broke") || logs.contains("reconnect"),
        "the stream was cut: {logs}"
    );
    assert_eq!(code, 3, "exit 3 = position lost; error:\n{err}");
    assert!(
        err.contains("dropped and created again") && err.contains("fix:"),
        "{err}"
    );
    let got: HashSet<Uuid> = relay.sink.published_ids().into_iter().collect();
    assert!(
        skipped.iter().all(|i| !got.contains(i)),
        "the new slot never had them"
    );
}

/// Peak resident memory of a process (`VmHWM`), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kb * 1024
}

/// One drain of large events through a slowed broker connection with the given
/// `--max-inflight-bytes`; returns the relay's peak RSS.
async fn drain_large_events(budget: usize, events: usize) -> u64 {
    use common::amqp::Topology;
    const PAYLOAD: usize = 256 * 1024;
    let db = PgDb::create("inflight").await;
    let mut topo = Topology::new("inflight").await;
    let proxy = FaultProxy::start(
        format!("127.0.0.1:{}", common::amqp::HOST_PORT)
            .parse()
            .unwrap(),
    )
    .await
    .unwrap();
    let name = unique("r");
    let mut relay = Relay::start_with_env(
        &[
            "run",
            "--source",
            &db.dsn(),
            "--name",
            &name,
            "--exchange",
            &topo.exchange,
            "--max-inflight-bytes",
            &budget.to_string(),
        ],
        &[("OUTBOXD_SINK", &common::amqp::url_via(proxy.port()))],
    );
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("all", "#").await;
    // The broker connection is stalled while the events are written and slow after: the
    // source could read the whole backlog into memory while the sink is behind, unless the
    // byte budget stops it.
    proxy.stall();
    let mut client = db.client().await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let pad = "x".repeat(PAYLOAD);
    for i in 0..events {
        let mut tx = client.transaction().await.unwrap();
        let body = serde_json::json!({"i": i, "pad": pad});
        outbox
            .write(&mut tx, "inflight.large", &format!("a{i}"), &body)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    proxy.set_delay(Duration::from_millis(4));
    proxy.resume();
    wait_for("every large event in the queue", T, || async {
        topo.queue_len(&queue).await as usize >= events
    })
    .await;
    assert!(
        proxy.delayed_chunks() > 0,
        "the broker connection was slowed"
    );
    let peak = peak_rss(relay.child.id());
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    peak
}

/// `--max-inflight-bytes` bounds the relay's memory with large payloads: a backlog of 256 KiB
/// events behind a stalled, then slow, broker, drained with a 1 MiB budget, once with 12 MiB
/// of events and once with 36 MiB. The source stops reading while the sink is behind, so the
/// peak RSS does not grow with the backlog (unbounded, the second run would hold 24 MiB more,
/// at least once over). The bound allows 12 MiB: the peaks of two bounded runs differ by up to
/// about 6 MiB (the allocator's and the clients' buffers at the moment of the peak; 74.4
/// against 80.5 MiB was seen with 12 and 24 MiB of events, which a 6 MiB bound refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_inflight_bytes_bounds_memory_with_large_payloads() {
    let budget = 1024 * 1024;
    let small = drain_large_events(budget, 48).await;
    let large = drain_large_events(budget, 144).await;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    eprintln!(
        "peak RSS with --max-inflight-bytes 1MiB: {:.1} MiB draining 12 MiB of events, {:.1} MiB draining 36 MiB",
        mib(small),
        mib(large)
    );
    assert!(
        large < small + 12 * 1024 * 1024,
        "the peak RSS grew with the backlog: {:.1} MiB for 12 MiB of events, {:.1} MiB for 36 MiB",
        mib(small),
        mib(large)
    );
}
