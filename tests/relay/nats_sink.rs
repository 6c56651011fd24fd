//! Postgres and MariaDB sources → NATS JetStream, end to end against the local nats-server
//! (docs/nats.md): what the stream holds and how (exactly once by `Nats-Msg-Id`, in commit
//! order, with the relay's headers), where poison goes, the stream's declaration and check,
//! partitions, and that relay kills, cut and stalled connections and a full stream lose
//! nothing and duplicate nothing within the duplicate window. Each scenario is written once
//! over [`SourceDb`] and runs as `<scenario>::postgres` and `<scenario>::mariadb`.

use crate::common;

use async_nats::jetstream::stream::{self, DiscardPolicy, StorageType};
use common::nats::{self, header, TestStream};
use common::proxy::FaultProxy;
use common::source_db::{on_both_sources, Pos, SourceDb};
use common::*;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);
/// Between a background writer's transactions.
const PAUSE: Duration = Duration::from_millis(20);

// Each scenario runs as `<scenario>::postgres` and `<scenario>::mariadb`.
on_both_sources!(
    events_are_stored_once_in_order_with_headers_and_poison_is_dead,
    sigkill_restarts_leave_every_event_exactly_once,
    past_the_duplicate_window_a_restart_duplicates,
    cut_and_stalled_connections_lose_and_duplicate_nothing,
    a_full_stream_holds_the_relay_back_with_backoff_and_loses_nothing,
    partitions_give_each_aggregate_its_subject_in_order,
    passive_without_a_stream_stops_with_the_fix_and_check_says_what_to_change,
    poison_rows_without_an_id_each_get_a_dead_record,
    a_duplicate_acknowledgement_for_a_first_publish_is_suspicious,
);

/// `outboxd run` with the NATS sink given through the environment.
fn start(source: &str, name: &str, s: &TestStream, sink: &str, extra: &[&str]) -> Relay {
    let mut args: Vec<String> = vec![
        "run".into(),
        "--source".into(),
        source.into(),
        "--name".into(),
        name.into(),
        "--log-level".into(),
        "info".into(),
    ];
    args.extend(s.args());
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", sink)])
}

/// Every expected id stored exactly once, nothing else but `extra` ids, first copies in commit
/// order.
fn assert_exactly_once(order: &[Uuid], counts: &HashMap<Uuid, usize>, expected: &[Uuid]) {
    let dups: Vec<(&Uuid, &usize)> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        dups.is_empty(),
        "{} ids stored more than once, e.g. {:?}",
        dups.len(),
        &dups[..dups.len().min(3)]
    );
    let have: HashSet<&Uuid> = order.iter().collect();
    let missing: Vec<&Uuid> = expected.iter().filter(|i| !have.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} events missing, e.g. {:?}",
        missing.len(),
        expected.len(),
        &missing[..missing.len().min(3)]
    );
    let want: HashSet<&Uuid> = expected.iter().collect();
    let kept: Vec<&Uuid> = order.iter().filter(|i| want.contains(i)).collect();
    assert!(
        kept.iter().copied().eq(expected.iter()),
        "stream order is commit order"
    );
    assert_eq!(
        order.len(),
        expected.len(),
        "nothing but the expected events"
    );
}

async fn wait_len(s: &TestStream, n: u64, what: &str) {
    wait_for(what, T, || async { s.len().await >= n }).await;
}

/// One outbox row with the id `id` as text (after [`SourceDb::id_as_text`]); the same SQL on
/// both sources.
fn insert_text_id(id: &str, topic: &str, n: u32) -> String {
    format!(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) \
         VALUES ('{id}', '7', '{topic}', '{{\"n\": {n}}}', CURRENT_TIMESTAMP(6))"
    )
}

/// Waits until the stream holds a message with `Nats-Msg-Id` `id`.
async fn wait_id(s: &TestStream, id: Uuid) {
    wait_for(&format!("{id} in the stream"), T, || async {
        s.id_counts().await.1.contains_key(&id)
    })
    .await;
}

/// Two rows whose id is no UUID are two poison events: each is its own dead record, with an id
/// of its own, and the stream stores both (with one shared id it kept the first and
/// acknowledged the second as a duplicate).
async fn poison_rows_without_an_id_each_get_a_dead_record<D: SourceDb>() {
    let db = D::create("natsp").await;
    db.id_as_text().await;
    let s = TestStream::new("np").await;
    let name = unique("r");
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let mut relay = start(
        &db.dsn(),
        &name,
        &s,
        &nats::url(),
        &["--metrics-addr", &addr],
    );
    db.wait_streaming(&name).await;
    let good = Uuid::now_v7();
    db.exec(&insert_text_id("not-a-uuid-1", "poison.one", 1))
        .await;
    db.exec(&insert_text_id("not-a-uuid-2", "poison.two", 2))
        .await;
    db.exec(&insert_text_id(&good.to_string(), "after.poison", 3))
        .await;
    wait_id(&s, good).await;
    let metrics = scrape_metrics(port).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());

    let msgs = s.messages().await;
    let dead: Vec<_> = msgs
        .iter()
        .filter(|m| m.subject.as_str() == s.dead())
        .collect();
    assert_eq!(
        dead.len(),
        2,
        "two dead records; stderr:\n{}",
        relay.stderr_plain()
    );
    let ids: Vec<Uuid> = dead
        .iter()
        .map(|m| header(m, "Nats-Msg-Id").unwrap().parse().unwrap())
        .collect();
    assert_ne!(ids[0], ids[1], "each dead record has an id of its own");
    // Derived from the position (UUIDv8), not the nil UUID the unreadable ids are read as.
    assert!(ids.iter().all(|i| i.get_version_num() == 8), "{ids:?}");
    for (m, topic) in dead.iter().zip(["poison.one", "poison.two"]) {
        assert_eq!(header(m, "x-original-topic").unwrap(), topic);
        assert!(header(m, "x-dead-reason").unwrap().contains("not a UUID"));
    }
    assert_eq!(
        metric_value(&metrics, "outboxd_events_deduplicated_total"),
        Some(0.0),
        "nothing was acknowledged as a duplicate"
    );
}

/// Two different rows with the same id (a producer bug: deleted and written again): the second
/// is a first publish the stream acknowledges as a duplicate. It is still stored once (that is
/// what the id promises), but logged at WARN and counted, unlike a republished event.
async fn a_duplicate_acknowledgement_for_a_first_publish_is_suspicious<D: SourceDb>() {
    let db = D::create("natsd").await;
    db.id_as_text().await;
    let s = TestStream::new("nd").await;
    let name = unique("r");
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let mut relay = start(
        &db.dsn(),
        &name,
        &s,
        &nats::url(),
        &["--metrics-addr", &addr],
    );
    db.wait_streaming(&name).await;
    let (reused, last) = (Uuid::now_v7(), Uuid::now_v7());
    db.exec(&insert_text_id(&reused.to_string(), "reused.one", 1))
        .await;
    db.exec(&format!("DELETE FROM outbox WHERE id = '{reused}'"))
        .await;
    db.exec(&insert_text_id(&reused.to_string(), "reused.two", 2))
        .await;
    db.exec(&insert_text_id(&last.to_string(), "after.reuse", 3))
        .await;
    wait_id(&s, last).await;
    // The check reads the stream's copy after the acknowledgement: poll for its count.
    wait_for("the suspicious duplicate counted", T, || async {
        let m = scrape_metrics(port).await;
        metric_value(&m, "outboxd_events_suspicious_duplicates_total").unwrap_or(0.0) >= 1.0
    })
    .await;
    let metrics = scrape_metrics(port).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let (_, counts) = s.id_counts().await;
    assert_eq!(counts.get(&reused), Some(&1), "stored once");
    assert_eq!(
        metric_value(&metrics, "outboxd_events_suspicious_duplicates_total"),
        Some(1.0),
        "exactly the one: {metrics}"
    );
    let err = relay.stderr_plain();
    assert!(
        err.lines().any(|l| l.contains("WARN")
            && l.contains(&reused.to_string())
            && l.contains("duplicate")),
        "{err}"
    );
}

async fn events_are_stored_once_in_order_with_headers_and_poison_is_dead<D: SourceDb>() {
    let db = D::create("nats").await;
    let s = TestStream::new("ns").await;
    let name = unique("r");
    let mut relay = start(&db.dsn(), &name, &s, &nats::url(), &[]);
    db.wait_streaming(&name).await;
    let mut expected = db.write(10, 100, "invoice.issued").await;
    // A topic with a space cannot be a subject token: a dead record, and the stream goes on.
    let poison = db.write(1, 1, "bad topic").await;
    expected.extend(db.write(1, 10, "invoice.paid").await);
    wait_len(&s, 1011, "1,011 messages in the stream").await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());

    let msgs = s.messages().await;
    let dead: Vec<_> = msgs
        .iter()
        .filter(|m| m.subject.as_str() == s.dead())
        .collect();
    assert_eq!(dead.len(), 1, "one dead record");
    assert_eq!(
        header(dead[0], "Nats-Msg-Id").unwrap(),
        poison[0].to_string()
    );
    assert!(header(dead[0], "x-dead-reason")
        .unwrap()
        .contains("whitespace"));
    assert_eq!(header(dead[0], "x-original-topic").unwrap(), "bad topic");
    assert!(dead[0].payload.is_empty());
    let (order, counts) = s.id_counts().await;
    let order: Vec<Uuid> = order.into_iter().filter(|i| *i != poison[0]).collect();
    assert_exactly_once(&order, &counts, &expected);
    let first = msgs
        .iter()
        .find(|m| header(m, "Nats-Msg-Id").unwrap() == expected[0].to_string())
        .unwrap();
    assert_eq!(
        first.subject.as_str(),
        format!("{}.invoice.issued", s.prefix)
    );
    assert_eq!(header(first, "x-aggregate-id").unwrap(), D::aggregate(0));
    let pos = header(first, "x-source-position").unwrap();
    assert!(D::is_position(&pos), "a {} position: {pos}", D::LABEL);
    assert!(header(first, "x-outbox-created-at").unwrap().ends_with('Z'));
    let body: serde_json::Value = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(body["invoice"], 0);

    let cfg = s.config().await;
    assert_eq!(cfg.subjects, vec![format!("{}.>", s.prefix)]);
    assert_eq!(cfg.storage, StorageType::File);
    assert_eq!(cfg.duplicate_window, Duration::from_secs(120));
}

/// The proof: SIGKILL the relay mid-stream, again and again, while a producer writes; within
/// the duplicate window the stream holds every committed event exactly once.
async fn sigkill_restarts_leave_every_event_exactly_once<D: SourceDb>() {
    let db = D::create("natsk").await;
    let s = TestStream::new("nk").await;
    let name = unique("r");
    // Each life serves its metrics: what it republished that the stream already held.
    let life = || {
        let port = free_local_port();
        let addr = format!("127.0.0.1:{port}");
        let relay = start(
            &db.dsn(),
            &name,
            &s,
            &nats::url(),
            &["--metrics-addr", &addr],
        );
        (relay, port)
    };
    let deduplicated = |port: u16| async move {
        let m = scrape_metrics(port).await;
        let suspicious =
            metric_value(&m, "outboxd_events_suspicious_duplicates_total").unwrap_or(0.0);
        // What a life republishes of an earlier one's is the same position: never suspicious.
        assert_eq!(suspicious, 0.0, "{m}");
        metric_value(&m, "outboxd_events_deduplicated_total").unwrap_or(0.0)
    };
    let (mut relay, mut port) = life();
    db.wait_streaming(&name).await;
    // About 10 s of writing, so that most of the 20 kills land while the producer writes.
    let writer = db.write_in_background(80, 50, Duration::from_millis(100), "kill.stream");
    let (kills, step) = (20, 150);
    let mut republished_held = 0.0;
    for k in 1..=kills {
        wait_len(
            &s,
            k * step,
            &format!("{} messages before kill {k}", k * step),
        )
        .await;
        republished_held += deduplicated(port).await;
        relay.sigkill();
        (relay, port) = life();
    }
    let expected = writer.await.unwrap();
    wait_len(&s, expected.len() as u64, "every event").await;
    republished_held += deduplicated(port).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let (order, counts) = s.id_counts().await;
    assert_exactly_once(&order, &counts, &expected);
    // The kills did leave acknowledged events unstored, and their republished copies were
    // what the stream recognised.
    assert!(
        republished_held > 0.0,
        "no life republished an event the stream already held: the kills tested nothing"
    );
    eprintln!("{kills} kills: {republished_held} republished events the stream already held");
}

/// The control for the proof, and what the documentation says happens past the window: with
/// a duplicate window shorter than the restart, a SIGKILL leaves duplicates (and no loss).
async fn past_the_duplicate_window_a_restart_duplicates<D: SourceDb>() {
    let db = D::create("natsw").await;
    let s = TestStream::new("nw").await;
    s.js.create_stream(stream::Config {
        name: s.name.clone(),
        subjects: vec![format!("{}.>", s.prefix)],
        storage: StorageType::File,
        duplicate_window: Duration::from_millis(100),
        ..Default::default()
    })
    .await
    .unwrap();
    let name = unique("r");
    let mut relay = start(&db.dsn(), &name, &s, &nats::url(), &[]);
    db.wait_streaming(&name).await;
    wait_for("the warning about the short window", T, || {
        let e = relay.stderr();
        async move { e.contains("duplicate window") && e.contains("--dupe-window 2m") }
    })
    .await;
    let writer = db.write_in_background(40, 50, PAUSE, "window.stream");
    wait_len(&s, 500, "500 messages before the kill").await;
    // The fault: a kill while the stream holds acknowledged events past the stored position.
    // The relay is stopped while we look, so it stores nothing between the look and the kill.
    let deadline = std::time::Instant::now() + T;
    let unstored = loop {
        relay.signal("STOP");
        let stored = db.stored_pos(&name).await;
        let past = s
            .messages()
            .await
            .iter()
            .filter_map(|m| Pos::of_event(&header(m, "x-source-position")?))
            .filter(|p| stored.is_none_or(|st| p.after(st)))
            .count();
        if past > 0 {
            break past;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never an acknowledged event past the stored position"
        );
        relay.signal("CONT");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    relay.sigkill();
    // The republished events arrive after the window: the stream keeps them again.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut relay = start(&db.dsn(), &name, &s, &nats::url(), &[]);
    let expected = writer.await.unwrap();
    let end_ids: HashSet<Uuid> = expected.iter().copied().collect();
    wait_for("every event", T, || async {
        let (_, counts) = s.id_counts().await;
        end_ids.iter().all(|i| counts.contains_key(i))
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let (_, counts) = s.id_counts().await;
    let dups = counts.values().filter(|n| **n > 1).count();
    assert!(
        dups > 0,
        "a restart past the window republishes acknowledged-but-unstored events as duplicates \
         ({unstored} were unstored at the kill)"
    );
}

async fn cut_and_stalled_connections_lose_and_duplicate_nothing<D: SourceDb>() {
    let db = D::create("natsc").await;
    let s = TestStream::new("nc").await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], nats::PORT).into())
        .await
        .unwrap();
    let name = unique("r");
    let mut relay = start(
        &db.dsn(),
        &name,
        &s,
        &nats::url_via(proxy.port()),
        &["--confirm-timeout", "3s"],
    );
    db.wait_streaming(&name).await;
    let writer = db.write_in_background(60, 50, PAUSE, "cut.stream");
    for k in 1..=2u64 {
        let accepted = proxy.accepted();
        wait_len(&s, k * 700, &format!("{} messages before cut {k}", k * 700)).await;
        proxy.cut();
        wait_for("the relay to reconnect", T, || {
            let now = proxy.accepted();
            async move { now > accepted }
        })
        .await;
    }
    let before = s.len().await;
    let accepted = proxy.accepted();
    proxy.stall();
    wait_for(
        "a confirm timeout or lost connection, then a failed reconnect",
        T,
        || {
            let err = relay.stderr();
            let now = proxy.accepted();
            async move { err.contains("sink still unavailable") && now > accepted }
        },
    )
    .await;
    let during = s.len().await;
    proxy.resume();
    let expected = writer.await.unwrap();
    wait_len(&s, expected.len() as u64, "every event").await;
    // Before the stop: a relay with nothing unconfirmed stops at once on SIGTERM, without
    // reconnecting (RelayOptions::stop).
    relay.wait_for_stderr(&["sink recovered"], T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert!(relay.stderr().contains("sink recovered"));
    assert!(
        during <= before + 1000,
        "little passes a stalled connection ({before} → {during})"
    );
    let (order, counts) = s.id_counts().await;
    assert_exactly_once(&order, &counts, &expected);
}

async fn a_full_stream_holds_the_relay_back_with_backoff_and_loses_nothing<D: SourceDb>() {
    let db = D::create("natsf").await;
    let s = TestStream::new("nf").await;
    let mut cfg = stream::Config {
        name: s.name.clone(),
        subjects: vec![format!("{}.>", s.prefix)],
        storage: StorageType::File,
        duplicate_window: Duration::from_secs(120),
        max_bytes: 100 * 1024,
        discard: DiscardPolicy::New,
        ..Default::default()
    };
    s.js.create_stream(cfg.clone()).await.unwrap();
    let name = unique("r");
    let mut relay = start(&db.dsn(), &name, &s, &nats::url(), &[]);
    db.wait_streaming(&name).await;
    let expected = db.write(10, 100, "full.stream").await;
    wait_for("the stream to refuse messages", T, || {
        let e = relay.stderr();
        async move { e.contains("JetStream refused the message") }
    })
    .await;
    // Held back: a few retries with growing delays, not a storm.
    let retries =
        |e: &str| e.matches("sink still unavailable").count() + e.matches("sink failed").count();
    let at = retries(&relay.stderr());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let during = retries(&relay.stderr()) - at;
    assert!(during <= 8, "{during} retries in 5 s against a full stream");
    let held = s.len().await;
    assert!(held < 1000, "the stream is full at {held} messages");
    cfg.max_bytes = -1;
    let updated = s.js.update_stream(&cfg).await.unwrap();
    assert_eq!(updated.config.max_bytes, -1, "the limit is lifted");
    wait_for("every event stored once there is room", T, || async {
        let mut st = s.js.get_stream(&s.name).await.unwrap();
        st.info().await.unwrap().state.last_sequence >= 1000
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let mut st = s.js.get_stream(&s.name).await.unwrap();
    let st = st.info().await.unwrap().state.clone();
    // 1,000 stores for 1,000 events: none lost, none stored twice. While the stream refuses,
    // a later, smaller event can fit where an earlier one did not, and the server enforces
    // the byte limit itself (it was seen dropping its oldest messages): docs/nats.md says so.
    assert_eq!(st.last_sequence, 1000, "one store per event");
    let (order, counts) = s.id_counts().await;
    assert!(counts.values().all(|n| *n == 1), "none stored twice");
    let want: HashSet<&Uuid> = expected.iter().collect();
    assert!(
        order.iter().all(|i| want.contains(i)),
        "nothing but the events"
    );
    assert_eq!(order.len() as u64, st.messages);
}

async fn partitions_give_each_aggregate_its_subject_in_order<D: SourceDb>() {
    let db = D::create("natsp").await;
    let s = TestStream::new("np").await;
    let name = unique("r");
    let mut relay = start(&db.dsn(), &name, &s, &nats::url(), &["--partitions", "4"]);
    db.wait_streaming(&name).await;
    let expected = db.write(5, 100, "part.evt").await;
    wait_len(&s, 500, "500 messages").await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let mut seen = HashSet::new();
    let mut per_aggregate: HashMap<String, Vec<Uuid>> = HashMap::new();
    for m in s.messages().await {
        let agg = header(&m, "x-aggregate-id").unwrap();
        let k = outboxd::sink::partition::partition_of(&agg, 4);
        assert_eq!(m.subject.as_str(), format!("{}.p{k}.part.evt", s.prefix));
        assert_eq!(header(&m, "x-partition").unwrap(), k.to_string());
        seen.insert(k);
        per_aggregate
            .entry(agg)
            .or_default()
            .push(header(&m, "Nats-Msg-Id").unwrap().parse().unwrap());
    }
    assert_eq!(seen.len(), 4, "97 aggregates spread over all 4 partitions");
    let pos: HashMap<Uuid, usize> = expected
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, i))
        .collect();
    for ids in per_aggregate.values() {
        assert!(
            ids.windows(2).all(|w| pos[&w[0]] < pos[&w[1]]),
            "an aggregate's events in commit order"
        );
    }
}

async fn passive_without_a_stream_stops_with_the_fix_and_check_says_what_to_change<D: SourceDb>() {
    let db = D::create("natsd").await;
    let s = TestStream::new("nd").await;
    let name = unique("r");
    let mut relay = start(
        &db.dsn(),
        &name,
        &s,
        &nats::url(),
        &["--declare", "passive"],
    );
    let code = relay.wait_exit(T).await;
    assert_ne!(code, 0);
    let err = relay.stderr();
    assert!(
        err.contains("does not exist") && err.contains(&format!("nats stream add {}", s.name)),
        "{err}"
    );

    s.js.create_stream(stream::Config {
        name: s.name.clone(),
        subjects: vec![format!("{}.>", s.prefix)],
        storage: StorageType::Memory,
        duplicate_window: Duration::from_secs(10),
        ..Default::default()
    })
    .await
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "check",
            "--source",
            &db.dsn(),
            "--name",
            &name,
            "--sink",
            &nats::url(),
            "--stream",
            &s.name,
            "--subject",
            &format!("{}.{{topic}}", s.prefix),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("nats connect"), "{text}");
    assert!(text.contains(&format!("nats stream {}", s.name)), "{text}");
    assert!(text.contains("duplicate window 10s"), "{text}");
    assert!(
        text.contains(&format!("nats stream edit {} --dupe-window 2m", s.name)),
        "{text}"
    );
    assert!(text.contains("memory storage"), "{text}");

    // A stream that does not capture the relay's subjects is a failure with the fix.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "check",
            "--source",
            &db.dsn(),
            "--name",
            &name,
            "--sink",
            &nats::url(),
            "--stream",
            &s.name,
            "--subject",
            "elsewhere.{topic}",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        text.contains("does not cover elsewhere.>") && text.contains("--subjects 'elsewhere.>'"),
        "{text}"
    );
}

/// `outboxd check` against one stream: (exit success, stdout).
fn check_stream(dsn: &str, name: &str, s: &TestStream) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "check",
            "--source",
            dsn,
            "--name",
            name,
            "--sink",
            &nats::url(),
        ])
        .args(s.args())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// Stream settings under which JetStream deletes events it acknowledged to the relay: `check`
/// says so with the fix for each, and the relay refuses the one that deletes every event at
/// once (interest retention without a consumer).
#[tokio::test]
async fn stream_settings_that_delete_acknowledged_events_are_refused_or_warned() {
    let db = PgDb::create("natsk").await;
    let name = unique("r");
    let base = |s: &TestStream| stream::Config {
        name: s.name.clone(),
        subjects: vec![format!("{}.>", s.prefix)],
        storage: StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };

    // Interest retention and no consumer: every event is deleted as soon as it is stored.
    let interest = TestStream::new("nki").await;
    interest
        .js
        .create_stream(stream::Config {
            retention: stream::RetentionPolicy::Interest,
            ..base(&interest)
        })
        .await
        .unwrap();
    let (ok, text) = check_stream(&db.dsn(), &name, &interest);
    assert!(
        !ok,
        "interest retention without consumers fails check:\n{text}"
    );
    assert!(
        text.contains("interest retention") && text.contains("no consumer"),
        "{text}"
    );
    let mut relay = start(&db.dsn(), &name, &interest, &nats::url(), &[]);
    let code = relay.wait_exit(T).await;
    assert_ne!(code, 0, "the relay refuses the stream");
    let err = relay.stderr();
    assert!(
        err.contains("interest retention") && err.contains("--retention limits"),
        "{err}"
    );
    let _ = interest.js.delete_stream(&interest.name).await;

    // Work-queue retention: the first consumer's ack deletes the event for every other one.
    let wq = TestStream::new("nkw").await;
    wq.js
        .create_stream(stream::Config {
            retention: stream::RetentionPolicy::WorkQueue,
            ..base(&wq)
        })
        .await
        .unwrap();
    let (_, text) = check_stream(&db.dsn(), &name, &wq);
    assert!(text.contains("work-queue retention"), "{text}");
    let _ = wq.js.delete_stream(&wq.name).await;

    // One message per subject: every topic keeps only its last event.
    let per_subject = TestStream::new("nks").await;
    per_subject
        .js
        .create_stream(stream::Config {
            max_messages_per_subject: 1,
            ..base(&per_subject)
        })
        .await
        .unwrap();
    let (_, text) = check_stream(&db.dsn(), &name, &per_subject);
    assert!(
        text.contains("keeps only the last 1 message")
            && text.contains(&format!(
                "nats stream edit {} --max-msgs-per-subject=-1",
                per_subject.name
            )),
        "{text}"
    );
    let _ = per_subject.js.delete_stream(&per_subject.name).await;

    // An age limit deletes old events whatever the discard policy: `--discard new` is not its fix.
    let aged = TestStream::new("nka").await;
    aged.js
        .create_stream(stream::Config {
            max_age: Duration::from_secs(3600),
            discard: DiscardPolicy::New,
            ..base(&aged)
        })
        .await
        .unwrap();
    let (_, text) = check_stream(&db.dsn(), &name, &aged);
    assert!(
        text.contains("older than 1h")
            && text.contains(&format!("nats stream edit {} --max-age=0", aged.name)),
        "{text}"
    );
    assert!(!text.contains("--discard new"), "{text}");
    let _ = aged.js.delete_stream(&aged.name).await;
}

/// An event larger than the stream's `max_msg_size` (but within the server's `max_payload`)
/// can never be stored: it becomes a dead record that says why, and the events behind it are
/// stored, in order.
#[tokio::test]
async fn an_event_over_the_streams_max_msg_size_is_dead_lettered() {
    let db = PgDb::create("natsm").await;
    let s = TestStream::new("nm").await;
    s.js.create_stream(stream::Config {
        name: s.name.clone(),
        subjects: vec![format!("{}.>", s.prefix)],
        storage: StorageType::File,
        duplicate_window: Duration::from_secs(120),
        max_message_size: 4096,
        ..Default::default()
    })
    .await
    .unwrap();
    let name = unique("r");
    let mut relay = start(&db.dsn(), &name, &s, &nats::url(), &[]);
    db.wait_streaming(&name).await;
    let mut expected = db.write(1, 2, "size.before").await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let mut client = db.client().await;
    let mut tx = client.transaction().await.unwrap();
    let big = serde_json::json!({"blob": "x".repeat(10_000)});
    let big_id = outbox
        .write(&mut tx, "size.big", "agg-big", &big)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    expected.extend(db.write(1, 2, "size.after").await);
    wait_len(&s, 5, "4 events and 1 dead record in the stream").await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());

    let msgs = s.messages().await;
    let dead: Vec<_> = msgs
        .iter()
        .filter(|m| m.subject.as_str() == s.dead())
        .collect();
    assert_eq!(dead.len(), 1, "one dead record");
    assert_eq!(header(dead[0], "Nats-Msg-Id").unwrap(), big_id.to_string());
    let reason = header(dead[0], "x-dead-reason").unwrap();
    assert!(reason.contains("max_msg_size 4096"), "{reason}");
    let (order, counts) = s.id_counts().await;
    let order: Vec<Uuid> = order.into_iter().filter(|i| *i != big_id).collect();
    assert_exactly_once(&order, &counts, &expected);
}

/// A topic whose subject is the poison subject (`<prefix>.dead` from `<prefix>.{topic}` and
/// topic `dead`) is not stored there as if it were a dead record's peer: it becomes a dead
/// record itself, whose reason says why, so a consumer of the poison subject never takes an
/// event for a dead record nor the other way round.
#[tokio::test]
async fn a_topic_on_the_poison_subject_is_a_dead_record_that_says_why() {
    let db = PgDb::create("natsx").await;
    let s = TestStream::new("nx").await;
    let name = unique("r");
    let mut relay = start(&db.dsn(), &name, &s, &nats::url(), &[]);
    db.wait_streaming(&name).await;
    let clash = db.write(1, 1, "dead").await;
    let expected = db.write(1, 3, "fine").await;
    wait_len(&s, 4, "4 messages in the stream").await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let msgs = s.messages().await;
    let dead: Vec<_> = msgs
        .iter()
        .filter(|m| m.subject.as_str() == s.dead())
        .collect();
    assert_eq!(
        dead.len(),
        1,
        "{} messages on the poison subject",
        dead.len()
    );
    assert_eq!(
        header(dead[0], "Nats-Msg-Id").unwrap(),
        clash[0].to_string()
    );
    let reason = header(dead[0], "x-dead-reason").expect("a dead record says why");
    assert!(reason.contains("poison subject"), "{reason}");
    assert!(dead[0].payload.is_empty(), "a dead record has no body");
    let (order, counts) = s.id_counts().await;
    let order: Vec<Uuid> = order.into_iter().filter(|i| *i != clash[0]).collect();
    assert_exactly_once(&order, &counts, &expected);
}
