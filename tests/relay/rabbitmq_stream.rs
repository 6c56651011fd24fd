//! The RabbitMQ stream sink against the local broker's stream port (docs/rabbitmq-stream.md):
//! the crash proof on both sources — 20 SIGKILLs, each followed by an immediate restart, under a
//! producer writing all along, then every committed event exactly once in the stream, in commit
//! order per aggregate — and the faults a stream relay meets: a stream deleted under it, a
//! connection cut and stalled through the TCP proxy, a broker port that does not answer.

use crate::common;

use common::killloop::{self, Plan};
use common::proxy::FaultProxy;
use common::rmq_stream::{assert_ordered, TestStream};
use common::source_db::SourceDb;
use common::*;
use std::collections::HashSet;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);
const RATE: u32 = 200;

fn kill_plan() -> Plan {
    Plan {
        kills: 20,
        // Longer than the stdout loop's: a life connects to the stream (three connections and
        // a read of the stream's tail) after it logs where it resumes, and on a loaded machine
        // that can take most of a second.
        lives: [900, 1600, 1100, 2000, 1300]
            .iter()
            .map(|&m| Duration::from_millis(m))
            .collect(),
        rate: RATE,
        produce_after: Some("resuming"),
    }
}

async fn crash_loop(dsn: String, name: String, producer: impl FnOnce() -> killloop::Producer) {
    let s = TestStream::new("kls");
    let args = s.run_args(&dsn, &name, &["--window", "100", "--snapshot", "never"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let stream = s.name.clone();
    let out = killloop::run_reading(
        &args,
        &kill_plan(),
        Vec::new(),
        producer,
        Some(|n: usize| {
            let stream = stream.clone();
            async move {
                TestStream::read_stream(&stream, n, Duration::from_secs(30))
                    .await
                    .into_iter()
                    .map(|m| m.id)
                    .collect()
            }
        }),
    )
    .await;
    let msgs = s.read(out.expected.len(), Duration::from_secs(30)).await;
    let lost = out.lost();
    eprintln!(
        "stream kill loop: {} committed ({:.0}/s), {} in the stream, {} lost, {} duplicates, {} SIGKILLs",
        out.expected.len(),
        out.rate(),
        msgs.len(),
        lost.len(),
        out.duplicates(),
        out.kills
    );
    let tail = |s: &str| s[s.len().saturating_sub(6000)..].to_string();
    assert!(
        lost.is_empty(),
        "{} of {} committed events are not in the stream (first {:?}); stderr tail:\n{}",
        lost.len(),
        out.expected.len(),
        lost.first(),
        tail(&out.stderr)
    );
    assert_eq!(
        out.duplicates(),
        0,
        "the stream holds duplicates; stderr tail:\n{}",
        tail(&out.stderr)
    );
    let expected: HashSet<_> = out.expected.iter().collect();
    assert!(
        msgs.iter().all(|m| expected.contains(&m.id)),
        "a message no one committed"
    );
    assert_ordered(&msgs);
    // The fault was real: lives replayed from their stored position into what the stream held.
    assert!(
        out.stderr
            .contains("replayed events the stream already holds"),
        "no life replayed events the stream already held; stderr tail:\n{}",
        tail(&out.stderr)
    );
    // Lives store progress for the next: fewer than the stdout loop's half, as each life opens
    // three stream connections (and reads the stream's tail) before its first publish.
    out.assert_progress(out.kills / 4);
    s.delete(0).await;
}

/// The same loop on Postgres: a life resumes from the slot, which the broker's publishing ids
/// must line up with as they do with the binlog's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_postgres_twenty_sigkills_exactly_once() {
    let mut db = PgDb::create("kls_pg").await;
    let name = unique("kls");
    db.slots.push(format!("outboxd_{name}"));
    let dsn = db.dsn();
    crash_loop(dsn, name, || killloop::pg_producer(&db, RATE, "kls.pg")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_mariadb_twenty_sigkills_exactly_once() {
    let db = MyDb::create("kls_my").await;
    let name = unique("kls");
    let dsn = db.dsn();
    crash_loop(dsn, name, || killloop::my_producer(&db, RATE, "kls.my")).await;
}

/// A stream deleted under a running relay: the relay says which stream is gone, `--declare
/// auto` creates it again, and every event committed after the deletion reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_deleted_under_the_relay_is_reported_and_nothing_after_it_is_lost() {
    let db = PgDb::create("sdel").await;
    let s = TestStream::new("sdel");
    let name = unique("sd");
    let dsn = db.dsn();
    let args = s.run_args(&dsn, &name, &["--confirm-timeout", "3s"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    db.wait_streaming(&name).await;
    let first = db.write(10, 2, "sdel.before").await;
    assert_eq!(s.read(first.len(), T).await.len(), first.len());
    common::rmq_stream::env()
        .await
        .delete_stream(&s.name)
        .await
        .expect("delete the stream");
    let after = db.write(10, 2, "sdel.after").await;
    let want: HashSet<_> = after.iter().copied().collect();
    wait_for(
        "the events after the deletion in the re-created stream",
        T,
        || async {
            let got: HashSet<_> = s.read(0, T).await.into_iter().map(|m| m.id).collect();
            want.is_subset(&got)
        },
    )
    .await;
    // Events before the deletion that the stored position had not passed yet are published
    // into the new stream too; nothing twice.
    let msgs = s.read(after.len(), T).await;
    let ids: Vec<_> = msgs.iter().map(|m| m.id).collect();
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        ids.len(),
        "duplicates: {msgs:?}"
    );
    assert!(ids.iter().all(|i| want.contains(i) || first.contains(i)));
    assert_ordered(&msgs);
    let err = relay.stderr_plain();
    assert!(
        err.contains(&format!("the stream \"{}\" was deleted", s.name)),
        "the relay did not report the deleted stream: {err}"
    );
    relay.sigkill();
    s.delete(0).await;
}

/// A stream another tool created with arguments of its own (the stream client's leader
/// locator and a max-age) is used as it is under `--declare auto`, whatever the relay's own
/// retention flag says (the broker refuses the relay's create with "precondition failed":
/// before the fix the relay retried that as an outage, for ever, publishing nothing); a
/// classic queue holding the name stops the relay with the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_created_elsewhere_is_used_and_a_queue_of_its_name_is_refused() {
    let db = PgDb::create("sown").await;
    let s = TestStream::new("sown");
    common::rmq_stream::env()
        .await
        .stream_creator()
        .max_age(Duration::from_secs(3600))
        .create(&s.name)
        .await
        .expect("create the stream with arguments of its own");
    let name = unique("so");
    let dsn = db.dsn();
    let args = s.run_args(&dsn, &name, &["--stream-max-age", "7d"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    db.wait_streaming(&name).await;
    let ids = db.write(10, 2, "sown.x").await;
    let msgs = s.read(ids.len(), T).await;
    let got: Vec<_> = msgs.iter().map(|m| m.id).collect();
    assert_eq!(
        got.iter().collect::<HashSet<_>>(),
        ids.iter().collect::<HashSet<_>>(),
        "the relay did not publish into the existing stream: {}",
        relay.stderr_plain()
    );
    assert_eq!(got.len(), ids.len(), "duplicates: {msgs:?}");
    relay.sigkill();
    s.delete(0).await;

    let q = TestStream::new("sownq");
    let amqp = common::amqp::connect().await;
    let ch = amqp.create_channel().await.unwrap();
    ch.queue_declare(
        q.name.clone().into(),
        lapin::options::QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .expect("declare a classic queue");
    let args = q.run_args(&dsn, &name, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    let code = relay.wait_exit(T).await;
    let err = relay.stderr_plain();
    let _ = ch
        .queue_delete(q.name.clone().into(), Default::default())
        .await;
    assert_eq!(
        code, 2,
        "a classic queue in the stream's place is a configuration error: {err}"
    );
    assert!(
        err.contains("a queue of that name exists that is not a stream")
            && err.contains("publish into another stream (--stream), or delete that queue"),
        "{err}"
    );
}

/// Aggregate versions 1 to 130 (`x-aggregate-version`) reach the stream, each confirmed, in
/// order. The stream client (0.4.4) sizes an integer header from −128 to 127 one byte larger
/// than it writes it when it is a `long`: the frame of the first event with a version under 128
/// announced a byte that never came, and the broker confirmed nothing after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_aggregate_versions_are_published_and_confirmed() {
    let db = PgDb::create("sver").await;
    // The test table has the optional `version` column (docs/message-format.md).
    let c = db.client().await;
    let s = TestStream::new("sver");
    let name = unique("sv");
    let dsn = db.dsn();
    let args = s.run_args(&dsn, &name, &["--confirm-timeout", "5s"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    db.wait_streaming(&name).await;
    c.batch_execute(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, version) \
         SELECT gen_random_uuid(), 'agg-v', 'sver.x', '{}'::json, g FROM generate_series(1, 130) g",
    )
    .await
    .unwrap();
    let msgs = s.read(130, Duration::from_secs(30)).await;
    assert_eq!(
        msgs.len(),
        130,
        "{} of 130 events in the stream: {}",
        msgs.len(),
        relay.stderr_plain()
    );
    assert_eq!(
        msgs.iter().map(|m| m.id).collect::<HashSet<_>>().len(),
        130,
        "duplicates: {msgs:?}"
    );
    assert_ordered(&msgs);
    relay.sigkill();
    s.delete(0).await;
}

/// A cut and then a stall of the stream connection through the TCP proxy: the relay
/// reconnects, and the stream holds every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_cut_and_stalled_connection_loses_and_duplicates_nothing() {
    let db = PgDb::create("scut").await;
    let s = TestStream::new("scut");
    let proxy = FaultProxy::start(([127, 0, 0, 1], common::rmq_stream::PORT).into())
        .await
        .unwrap();
    let name = unique("sc");
    let dsn = db.dsn();
    let sink = common::rmq_stream::url_via(proxy.port());
    let args = [
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--sink",
        &sink,
        "--stream",
        &s.name,
        "--confirm-timeout",
        "2s",
    ];
    let mut relay = Relay::start(&args);
    db.wait_streaming(&name).await;
    let mut ids = db.write(20, 2, "scut.a").await;
    assert_eq!(s.read(ids.len(), T).await.len(), ids.len());
    let accepted = proxy.accepted();
    proxy.cut();
    ids.extend(db.write(20, 2, "scut.b").await);
    wait_for("a new connection after the cut", T, || async {
        proxy.accepted() > accepted
    })
    .await;
    assert_eq!(s.read(ids.len(), T).await.len(), ids.len());
    proxy.stall();
    let stalled = proxy.bytes();
    ids.extend(db.write(20, 2, "scut.c").await);
    let e = relay.stderr_plain();
    wait_for("the relay to give up on the stalled connection", T, || {
        let e2 = relay.stderr_plain();
        let before = e.len();
        async move { e2.len() > before && e2[before..].contains("unavailable") }
    })
    .await;
    assert_eq!(
        proxy.bytes(),
        stalled,
        "bytes moved through a stalled proxy"
    );
    proxy.resume();
    let msgs = s.read(ids.len(), T).await;
    let got: Vec<_> = msgs.iter().map(|m| m.id).collect();
    assert_eq!(
        got.iter().collect::<HashSet<_>>().len(),
        got.len(),
        "duplicates in the stream"
    );
    assert_eq!(
        got.iter().collect::<HashSet<_>>(),
        ids.iter().collect::<HashSet<_>>(),
        "the stream differs from what was committed"
    );
    assert_ordered(&msgs);
    relay.sigkill();
    s.delete(0).await;
}

/// A broker without the stream plugin (nothing listens on the port): the relay names the
/// command that enables it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_port_closed_names_the_plugin_command() {
    let db = PgDb::create("snone").await;
    let port = free_local_port();
    let name = unique("sn");
    let dsn = db.dsn();
    let sink = common::rmq_stream::url_via(port);
    let relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--sink",
        &sink,
        "--stream",
        "never_made",
    ]);
    relay
        .wait_for_stderr(&["rabbitmq-plugins enable rabbitmq_stream"], T)
        .await;
}

/// `outboxd check` against stream partitions: one with retention (reported), one without (a
/// warning with the policy that bounds it), one missing (a failure with the command that
/// creates it under `passive`, a warning under `auto`), and a closed port (the plugin command).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_streams_their_retention_and_the_fixes() {
    let db = PgDb::create("schk").await;
    let s = TestStream::new("schk");
    let env = common::rmq_stream::env().await;
    env.stream_creator()
        .max_age(Duration::from_secs(7200))
        .create(&format!("{}-0", s.name))
        .await
        .expect("create the partition with retention");
    env.stream_creator()
        .create(&format!("{}-1", s.name))
        .await
        .expect("create the partition without retention");
    let check = |sink: String, declare: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["check", "--source", &db.dsn(), "--sink", &sink, "--stream"])
            .args([&s.name, "--partitions", "3", "--declare", declare])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let (ok, text) = check(common::rmq_stream::url(), "passive");
    assert!(
        !ok,
        "a missing stream under --declare passive fails: {text}"
    );
    let n = &s.name;
    for want in [
        "ok   stream connect".to_string(),
        format!("ok   stream {n}-0: exists"),
        format!("ok   stream {n}-0 retention: max-age 7200s"),
        format!("warn stream {n}-1 retention: none"),
        format!("rabbitmqctl set_policy -p / outbox-retention '^{n}-1$'"),
        format!("FAIL stream {n}-2: does not exist"),
        format!("rabbitmqadmin declare queue name={n}-2 durable=true"),
    ] {
        assert!(text.contains(&want), "missing {want:?} in:\n{text}");
    }
    let (_, text) = check(common::rmq_stream::url(), "auto");
    assert!(
        text.contains(&format!(
            "warn stream {n}-2: does not exist yet: the relay creates it"
        )),
        "{text}"
    );
    let port = free_local_port();
    let (ok, text) = check(common::rmq_stream::url_via(port), "auto");
    assert!(!ok);
    assert!(
        text.contains("FAIL stream connect")
            && text.contains("rabbitmq-plugins enable rabbitmq_stream"),
        "{text}"
    );
    s.delete(3).await;
}

/// Every stream of `s` with `--partitions n`: the messages of each, in stream order.
async fn read_partitions(
    s: &TestStream,
    n: u32,
    at_least: usize,
) -> Vec<Vec<common::rmq_stream::Msg>> {
    let mut out = Vec::new();
    let mut total = 0;
    for k in 0..n {
        // The first streams may hold fewer than all: wait the full patience only on the last.
        let want = if k + 1 == n {
            at_least.saturating_sub(total)
        } else {
            0
        };
        let msgs = TestStream::read_stream(&format!("{}-{k}", s.name), want, T).await;
        total += msgs.len();
        out.push(msgs);
    }
    out
}

/// `--partitions 3`: three streams, each event in its aggregate's stream (the murmur2
/// placement) once and in commit order per aggregate. Then one partition's stream is deleted
/// under the relay (`--declare passive`, so it stays gone): the other two keep confirming, but
/// the stored position must not pass the first event the missing stream did not confirm. The
/// proof: after the stream is back and the relay restarts, every event committed after the
/// deletion is in its stream (nothing was skipped by the position), and what the other two
/// streams confirmed meanwhile is not in them twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_partitions_keep_aggregate_order_and_store_only_the_confirmed_prefix() {
    const N: u32 = 3;
    let db = PgDb::create("spart").await;
    let s = TestStream::new("spart");
    let env = common::rmq_stream::env().await;
    for k in 0..N {
        env.stream_creator()
            .create(&format!("{}-{k}", s.name))
            .await
            .expect("create a partition's stream");
    }
    let name = unique("sp");
    let dsn = db.dsn();
    let args = s.run_args(
        &dsn,
        &name,
        &[
            "--partitions",
            &N.to_string(),
            "--declare",
            "passive",
            "--confirm-timeout",
            "3s",
        ],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    db.wait_streaming(&name).await;
    let mut ids = db.write(30, 2, "spart.a").await;
    let check = |parts: &[Vec<common::rmq_stream::Msg>], ids: &[uuid::Uuid]| {
        let mut all = HashSet::new();
        for (k, msgs) in parts.iter().enumerate() {
            for m in msgs {
                assert_eq!(
                    outboxd::sink::partition::partition_of(&m.aggregate, N),
                    k as u32,
                    "{} of aggregate {} in the wrong stream",
                    m.id,
                    m.aggregate
                );
                assert!(all.insert(m.id), "{} twice", m.id);
            }
            assert_ordered(msgs);
        }
        let want: HashSet<_> = ids.iter().copied().collect();
        assert!(
            want.is_subset(&all),
            "{} committed events missing",
            want.difference(&all).count()
        );
    };
    let parts = read_partitions(&s, N, ids.len()).await;
    assert!(
        parts.iter().all(|p| !p.is_empty()),
        "a partition got nothing"
    );
    check(&parts, &ids);

    env.delete_stream(&format!("{}-1", s.name))
        .await
        .expect("delete partition 1's stream");
    ids.extend(db.write(30, 2, "spart.b").await);
    // The fault: the relay met the missing stream (and `passive` keeps it missing).
    let part1 = format!("{}-1", s.name);
    relay.wait_for_stderr(&["does not exist", &part1], T).await;
    relay.sigkill();
    env.stream_creator()
        .create(&format!("{}-1", s.name))
        .await
        .expect("create partition 1's stream again");
    let relay = Relay::start(&args);
    let after = ids[60..].to_vec();
    wait_for(
        "the events after the deletion in their streams",
        T,
        || async {
            let parts = read_partitions(&s, N, 0).await;
            let got: HashSet<_> = parts.iter().flatten().map(|m| m.id).collect();
            after.iter().all(|i| got.contains(i))
        },
    )
    .await;
    // Partition 1's events before the deletion went with its stream (those after the stored
    // position are published into the new one); every event after it is in its stream once.
    let parts = read_partitions(&s, N, after.len()).await;
    check(&parts, &after);
    drop(relay);
    s.delete(N).await;
}

/// The test CA's files (made by scripts/services/rabbitmq.sh).
const RMQ_TLS_DIR: &str = "/etc/rabbitmq/outboxd-tls";

/// A TLS endpoint in front of the plain stream port, with the test CA's server certificate and
/// client certificates required: what the broker's `stream.listeners.ssl` does, in the test's
/// own process so that it does not need the shared broker restarted. Returns its port and how
/// many handshakes completed.
async fn tls_front() -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let file = |n: &str| {
        let p = format!("{RMQ_TLS_DIR}/{n}");
        assert!(
            std::path::Path::new(&p).is_file(),
            "{p} does not exist: run sudo scripts/services.sh (it makes the RabbitMQ test CA)"
        );
        p
    };
    let certs: Vec<_> = CertificateDer::pem_file_iter(file("server.pem"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(file("server.key")).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(file("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let handshakes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = handshakes.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let count = count.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut plain =
                    tokio::net::TcpStream::connect(("127.0.0.1", common::rmq_stream::PORT))
                        .await
                        .unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (port, handshakes)
}

/// `rabbitmq-stream+tls://` with `--sink-ca/--sink-cert/--sink-key`: every event reaches the
/// stream through TLS connections (the handshakes are counted), and the settings the stream
/// client would panic on or could not use are refused up front with the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_over_tls_with_a_client_certificate_and_bad_tls_settings_refused() {
    let (port, handshakes) = tls_front().await;
    let db = PgDb::create("stls").await;
    let s = TestStream::new("stls");
    let name = unique("st");
    let dsn = db.dsn();
    let sink = format!("rabbitmq-stream+tls://guest:guest@127.0.0.1:{port}/%2f");
    let ca = format!("{RMQ_TLS_DIR}/ca.pem");
    let cert = format!("{RMQ_TLS_DIR}/client.pem");
    let key = format!("{RMQ_TLS_DIR}/client.key");
    let base = ["run", "--source", &dsn, "--name", &name, "--sink", &sink];
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--stream", &s.name, "--sink-ca", &ca, "--sink-cert", &cert]);
    args.extend(["--sink-key", &key]);
    let mut relay = Relay::start(&args);
    db.wait_streaming(&name).await;
    let ids = db.write(10, 2, "stls.a").await;
    let msgs = s.read(ids.len(), T).await;
    assert_eq!(msgs.iter().map(|m| m.id).collect::<Vec<_>>(), ids);
    assert!(
        handshakes.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "no TLS handshake"
    );
    relay.sigkill();

    // Refused before connecting, each with its fix.
    let refused = |extra: &[&str], want: &str| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend(["--stream", "never_made"]);
        a.extend(extra);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(&a)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{extra:?} was accepted");
        assert!(err.contains(want), "{extra:?}: missing {want:?} in {err}");
    };
    refused(&[], "needs --sink-ca");
    refused(
        &["--sink-ca", "/nonexistent/ca.pem"],
        "cannot read /nonexistent/ca.pem",
    );
    s.delete(0).await;
}

/// A stream the relay wrote is read by an AMQP 0-9-1 client (lapin, as php-amqplib and pika
/// users read streams: `x-stream-offset`, a prefetch, manual acks): every event arrives with
/// its id, its headers — the publishing id, the version, a row header that is an object — and
/// its body, and the broker keeps the connection open. RabbitMQ 3.10 cannot convert an AMQP 1.0
/// `ulong` application property for such a consumer and closes its connection (541).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_0_9_1_clients_read_the_stream() {
    use futures::StreamExt;
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let db = PgDb::create("s091").await;
    let s = TestStream::new("s091");
    let name = unique("s91");
    let args = s.run_args(&db.dsn(), &name, &["--snapshot", "never"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    PgDb::wait_streaming(&db, &name).await;
    let mut ids = Vec::new();
    let client = db.client().await;
    for v in 1..=5i64 {
        let id = uuid::Uuid::now_v7();
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_id, topic, payload, headers, version)
                 VALUES ($1, 'a-1', 'orders.placed', '{\"n\": 1}', '{\"tenant\": {\"id\": 7}}', $2)",
                &[&id, &v],
            )
            .await
            .unwrap();
        ids.push(id);
    }
    assert!(s.holds_at_least(ids.len(), T).await, "{}", relay.stderr());
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString("first".into()),
    );
    let mut consumer = ch
        .basic_consume(
            s.name.as_str().into(),
            "reader".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < ids.len() {
        let d = match tokio::time::timeout(Duration::from_secs(20), consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            other => panic!(
                "the AMQP 0-9-1 reader got {} of {} messages, then {other:?} (connected: {})",
                got.len(),
                ids.len(),
                conn.status().connected()
            ),
        };
        assert!(
            amqp::header(&d, "x-outbox-publishing-id").is_some(),
            "{:?}",
            d.properties
        );
        assert!(
            amqp::header(&d, "x-aggregate-version").is_some(),
            "{:?}",
            d.properties
        );
        assert_eq!(
            amqp::header_str(&d, "tenant").as_deref(),
            Some(r#"{"id":7}"#)
        );
        assert_eq!(d.data, br#"{"n": 1}"#);
        got.push(amqp::message_id(&d));
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(got, ids);
    assert!(conn.status().connected(), "the broker kept the connection");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0);
    s.delete(0).await;
}

/// An event whose frame would be larger than the broker takes once its headers are AMQP 1.0
/// application properties — a nested row header travels as JSON text, and 25,000 control
/// characters cost 6 bytes each there against 1 in AMQP 0-9-1 — with a body under the limit:
/// it goes into the stream as a dead record with the reason, and the next event follows. The
/// frame was measured on the AMQP 0-9-1 headers, so the broker closed the connection on every
/// retry and nothing after the event was published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_too_large_as_sent_is_a_dead_record_and_the_stream_goes_on() {
    use futures::StreamExt;
    use rabbitmq_stream_client::types::{OffsetSpecification, SimpleValue};
    let db = PgDb::create("sframe").await;
    let s = TestStream::new("sframe");
    let name = unique("sfr");
    let args = s.run_args(&db.dsn(), &name, &["--snapshot", "never"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start(&args);
    PgDb::wait_streaming(&db, &name).await;
    let client = db.client().await;
    let headers = serde_json::json!({ "nested": ["\u{1}".repeat(25_000)] }).to_string();
    let body = serde_json::json!({ "blob": "x".repeat(900 * 1024) }).to_string();
    let (big, next) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, headers)
             VALUES ($1, 'a-1', 'orders.placed', $2::text::json, $3::text::json)",
            &[&big, &body, &headers],
        )
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ($1, 'a-1', 'orders.placed', '{}')",
            &[&next],
        )
        .await
        .unwrap();
    assert!(
        s.holds_at_least(2, Duration::from_secs(60)).await,
        "the stream does not hold both events; stderr:\n{}",
        relay.stderr()
    );
    let env = rmq_stream::env().await;
    let mut consumer = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build(&s.name)
        .await
        .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let d = tokio::time::timeout(T, consumer.next())
            .await
            .expect("a message")
            .expect("open")
            .expect("a delivery");
        let m = d.message();
        let app = m.application_properties().unwrap();
        let reason = match app.get("x-dead-reason") {
            Some(SimpleValue::String(r)) => Some(r.clone()),
            _ => None,
        };
        let id = m
            .properties()
            .and_then(|p| p.message_id.as_ref())
            .and_then(|id| <&String>::try_from(id).ok())
            .cloned()
            .unwrap();
        seen.push((id, reason, m.data().map_or(0, |b| b.len())));
    }
    let _ = consumer.handle().close().await;
    assert_eq!(seen[0].0, big.to_string());
    let reason = seen[0]
        .1
        .as_deref()
        .expect("the big event is a dead record");
    assert!(reason.contains("stream frame"), "{reason}");
    assert_eq!(seen[0].2, 0, "a dead record carries no body");
    assert_eq!(
        (seen[1].0.as_str(), seen[1].1.as_deref()),
        (next.to_string().as_str(), None)
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    s.delete(0).await;
}
