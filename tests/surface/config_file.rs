//! The configuration file (docs/configuration.md): precedence flags > environment > file,
//! refusals with the fix (unknown keys, inline passwords), `outboxd config` redacting secrets,
//! and a relay configured by the file alone publishing to the real RabbitMQ from Postgres.

use crate::common;

use common::amqp::{self, message_id, Topology};
use common::*;
use std::io::Write;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

/// `key = value  # origin` of `outboxd config`'s output.
fn effective(lines: &[String], key: &str) -> Option<(String, String)> {
    lines.iter().find_map(|l| {
        let (k, rest) = l.split_once(" = ")?;
        if k != key {
            return None;
        }
        let (v, origin) = rest.rsplit_once("  # ")?;
        Some((v.to_string(), origin.to_string()))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_beat_environment_beats_file_and_secrets_are_redacted() {
    let f = file(
        "window = 7\nconfirm_timeout = \"5s\"\nexchange = \"from_file\"\nrouting_key = \"{topic}.f\"\ntable = [\"a\", \"b\"]\nha = true\n",
    );
    let path = f.path().to_str().unwrap();
    let mut relay = Relay::start_with_env(
        &["config", "--config", path, "--window", "9"],
        &[
            ("OUTBOXD_EXCHANGE", "from_env"),
            ("OUTBOXD_SINK", "amqp://relay:hunter2@mq:5672/prod"),
        ],
    );
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let lines = relay.lines();
    let get = |k: &str| effective(&lines, k).unwrap_or_else(|| panic!("{k} in {lines:#?}"));
    assert_eq!(get("window"), ("\"9\"".into(), "flag".into()));
    assert_eq!(get("exchange"), ("\"from_env\"".into(), "env".into()));
    assert_eq!(get("routing_key"), ("\"{topic}.f\"".into(), "file".into()));
    assert_eq!(get("confirm_timeout"), ("\"5s\"".into(), "file".into()));
    assert_eq!(get("table"), ("[\"a\", \"b\"]".into(), "file".into()));
    assert_eq!(get("ha"), ("true".into(), "file".into()));
    assert_eq!(get("max_inflight_bytes").1, "default");
    let sink = get("sink");
    assert_eq!(sink.1, "env");
    assert!(sink.0.contains("relay:***@mq"), "{sink:?}");
    assert!(!lines.concat().contains("hunter2"), "{lines:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_files_are_refused_with_the_fix() {
    for (text, needle) in [
        ("windw = 3\n", "did you mean \"window\""),
        ("routing-key = \"x\"\n", "write \"routing_key\""),
        (
            "source = \"postgres://relay:hunter2@127.0.0.1/app\"\n",
            "source_file",
        ),
        ("window = \"many\"\n", "many"),
    ] {
        let f = file(text);
        let mut relay = Relay::start(&["config", "--config", f.path().to_str().unwrap()]);
        assert_eq!(relay.wait_exit(T).await, 2, "{text}: {}", relay.stderr());
        let err = relay.stderr();
        assert!(err.contains(needle), "{text}: {err}");
        assert!(!err.contains("hunter2"), "{text}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_configured_by_the_file_publishes() {
    let db = PgDb::create("cfg").await;
    let mut topo = Topology::new("cf").await;
    let name = unique("r");
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("sink");
    std::fs::write(&secret, amqp::url()).unwrap();
    // Files holding secrets must be the user's alone.
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let f = file(&format!(
        "source = \"{}\"\nsink_file = \"{}\"\nname = \"{name}\"\nexchange = \"{}\"\nrouting_key = \"cfg.{{topic}}\"\nlog_level = \"info,lapin=warn\"\n",
        db.dsn(),
        secret.display(),
        topo.exchange
    ));
    let mut relay = Relay::start(&["run", "--config", f.path().to_str().unwrap()]);
    wait_for("the relay's slot to be active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "cfg.#").await;
    let mut client = db.client().await;
    let ids = write_events(&mut client, 1, 3, "order.placed").await;
    let got = topo.take(&q, 3, T).await;
    assert_eq!(got.iter().map(message_id).collect::<Vec<_>>(), ids);
    assert_eq!(got[0].routing_key.as_str(), "cfg.order.placed");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

/// `outboxd from-debezium` on a Kafka Connect connector and on Debezium Server's properties:
/// the file it prints is one outboxd reads (`outboxd config --config` takes every key, refuses
/// none), carries the router's options over, keeps passwords out and names what it leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_debezium_prints_a_file_outboxd_reads() {
    let connect = file(
        r#"{"name": "orders-outbox", "config": {
          "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
          "database.hostname": "db", "database.port": "5432", "database.user": "dbz",
          "database.password": "hunter2-db", "database.dbname": "orders",
          "table.include.list": "public.outbox", "topic.prefix": "orders",
          "transforms": "outbox",
          "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
          "transforms.outbox.table.fields.additional.placement": "type:header:eventType,type:envelope:eventType",
          "transforms.outbox.route.tombstone.on.empty.payload": "true",
          "transforms.outbox.table.field.event.timestamp": "created"}}"#,
    );
    let server = file(
        "debezium.sink.type=kafka\n\
         debezium.sink.kafka.producer.bootstrap.servers=k1:9092,k2:9092\n\
         debezium.sink.kafka.producer.sasl.jaas.config=hunter2-jaas\n\
         debezium.source.connector.class=io.debezium.connector.mysql.MySqlConnector\n\
         debezium.source.database.hostname=db\n\
         debezium.source.database.user=dbz\n\
         debezium.source.database.password=hunter2-my\n\
         debezium.source.table.include.list=shop.outbox\n\
         debezium.source.offset.storage.file.filename=data/offsets.dat\n\
         debezium.transforms=outbox\n\
         debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter\n",
    );
    for (input, wants) in [
        (
            &connect,
            &[
                "slot = \"debezium\"",
                "header = [\"type=eventType\"]",
                "kafka_tombstones = true",
                "#   topic.prefix:",
            ][..],
        ),
        (
            &server,
            &[
                "sink = \"kafka://k1:9092,k2:9092\"",
                "data/offsets.dat",
                "#   debezium.sink.kafka.producer.sasl.jaas.config:",
            ][..],
        ),
    ] {
        let mut p = Relay::start(&["from-debezium", input.path().to_str().unwrap()]);
        assert_eq!(p.wait_exit(T).await, 0, "{}", p.stderr());
        let toml = p.lines().join("\n") + "\n";
        assert!(!toml.contains("hunter2"), "no password: {toml}");
        for w in wants {
            assert!(toml.contains(w), "{w:?} in:\n{toml}");
        }
        assert!(p.stderr().contains("not carried over"), "{}", p.stderr());
        let out = file(&toml);
        let mut c = Relay::start(&["config", "--config", out.path().to_str().unwrap()]);
        assert_eq!(c.wait_exit(T).await, 0, "{toml}\n{}", c.stderr());
        let lines = c.lines();
        assert_eq!(
            effective(&lines, "snapshot"),
            Some(("\"never\"".into(), "file".into())),
            "{lines:#?}"
        );
    }
    let mut bad = Relay::start(&["from-debezium", "/nonexistent/connector.json"]);
    assert_eq!(bad.wait_exit(T).await, 2, "{}", bad.stderr());
}
