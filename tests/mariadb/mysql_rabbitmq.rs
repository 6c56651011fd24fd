//! MariaDB source → RabbitMQ sink, end to end against the real servers: bodies byte for byte,
//! the binlog's `x-source-position` and `x-source-gtid`, commit order, the stored position
//! only past confirmed messages, and a SIGKILL mid-stream that loses nothing.

use crate::common;

use common::amqp::{self, header_str, message_id, Topology};
use common::*;
use mysql_async::prelude::Queryable;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

fn start_relay(db: &MyDb, name: &str, exchange: &str) -> Relay {
    let dsn = db.dsn();
    Relay::start_with_env(
        &[
            "run",
            "--source",
            &dsn,
            "--name",
            name,
            "--exchange",
            exchange,
            "--log-level",
            "info,lapin=warn",
        ],
        &[("OUTBOXD_SINK", &amqp::url())],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arrive_with_binlog_positions_and_gtids() {
    let db = MyDb::create("my_rmq").await;
    let mut topo = Topology::new("myx").await;
    let name = unique("r");
    let mut relay = start_relay(&db, &name, &topo.exchange);
    wait_for("the binlog dump", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;

    let mut c = db.conn().await;
    let mut expected = my_write_events(&mut c, 10, 100, "invoice.issued").await;
    // A payload whose text is not its canonical JSON form: the body keeps it.
    let spaced = Uuid::now_v7();
    c.exec_drop(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (?, 7, 'invoice.spaced', '{ \"b\" :1,  \"a\":[ 2 ] , \"s\": \"Ayşe 🧾\" }', NOW(6))",
        (spaced.as_bytes().to_vec(),),
    )
    .await
    .unwrap();
    expected.push(spaced);

    wait_for("every message", T, || async {
        topo.queue_len(&all).await as usize >= expected.len()
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let msgs = topo.take_all(&all).await;
    let got: Vec<Uuid> = msgs.iter().map(message_id).collect();
    assert_eq!(
        got, expected,
        "commit order, nothing missing, nothing extra"
    );

    let rows: Vec<(Vec<u8>, i64, String, Vec<u8>)> = c
        .query("SELECT id, aggregate_id, topic, payload FROM outbox")
        .await
        .unwrap();
    let rows: HashMap<Uuid, (i64, String, Vec<u8>)> = rows
        .into_iter()
        .map(|(id, a, t, p)| (Uuid::from_slice(&id).unwrap(), (a, t, p)))
        .collect();
    let mut last_pos = String::new();
    let mut gtids = HashSet::new();
    for m in &msgs {
        let (agg, topic, payload) = &rows[&message_id(m)];
        assert_eq!(&m.data, payload, "body = stored payload text byte for byte");
        assert_eq!(m.routing_key.as_str(), topic);
        assert_eq!(header_str(m, "x-aggregate-id").unwrap(), agg.to_string());
        let pos = header_str(m, "x-source-position").unwrap();
        let parts: Vec<&str> = pos.split(':').collect();
        assert_eq!(parts.len(), 3, "file:end_pos:index: {pos}");
        assert!(parts[0].starts_with("mariadb-bin."), "{pos}");
        assert!(
            pos > last_pos,
            "increasing in commit order: {last_pos} then {pos}"
        );
        last_pos = pos;
        let gtid = header_str(m, "x-source-gtid").expect("MariaDB has GTIDs");
        assert!(
            outboxd::source::mysql::gtid::Gtid::parse(&gtid).is_some(),
            "{gtid}"
        );
        gtids.insert(gtid);
    }
    assert_eq!(gtids.len(), 11, "one GTID per transaction");
    let spaced_msg = msgs.last().unwrap();
    assert_eq!(
        std::str::from_utf8(&spaced_msg.data).unwrap(),
        "{ \"b\" :1,  \"a\":[ 2 ] , \"s\": \"Ayşe 🧾\" }"
    );

    // The stored position is at or past the last confirmed message's transaction end.
    let (file, pos, _) = db.stored(&name).await.unwrap();
    let last: Vec<&str> = last_pos.split(':').collect();
    assert!(binlog_ge(
        &(file, pos),
        &(last[0].to_string(), last[1].parse().unwrap())
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_nothing() {
    let db = MyDb::create("my_rmq_kill").await;
    let mut topo = Topology::new("myk").await;
    let name = unique("r");
    let mut relay = start_relay(&db, &name, &topo.exchange);
    wait_for("the binlog dump", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;
    let writer = {
        let mut c = db.conn().await;
        tokio::spawn(async move { my_write_events(&mut c, 100, 50, "kill.rmq").await })
    };
    wait_for("some messages", T, || async {
        topo.queue_len(&all).await >= 1000
    })
    .await;
    // Killed once a position was stored, so the restart resumes mid-stream (a relay killed
    // before its first start is done snapshots again).
    wait_for("a stored position", T, || async {
        db.stored(&name).await.is_some()
    })
    .await;
    relay.sigkill();
    let expected = writer.await.unwrap();
    let head = my_head().await;
    let relay2 = start_relay(&db, &name, &topo.exchange);
    // Everything is confirmed once the stored position passes the head taken after the last
    // write; only then is the queue complete (a consumer of a growing queue may take more
    // than it counts).
    wait_for("the stored position past the last write", T, || async {
        db.stored(&name)
            .await
            .is_some_and(|(f, p, _)| binlog_ge(&(f, p), &head))
    })
    .await;
    let got: Vec<Uuid> = topo.take_all(&all).await.iter().map(message_id).collect();
    let set: HashSet<&Uuid> = got.iter().collect();
    let missing = expected.iter().filter(|i| !set.contains(i)).count();
    assert_eq!(
        missing,
        0,
        "{missing} of {} lost; stderr:\n{}",
        expected.len(),
        relay2.stderr()
    );
    let dups = got.len() - got.iter().collect::<HashSet<_>>().len();
    assert!(dups < expected.len() / 2, "{dups} duplicates");
}
