//! The Laravel example (`examples/laravel/`) end to end, as its team would run it: the PHP
//! producer issues invoices (`Outbox::write` inside `DB::transaction`, sensitive fields sealed
//! by the PHP class) while outboxd relays the outbox rows from the MariaDB binlog (or, in poll
//! mode, from the table) to RabbitMQ and the PHP consumer books each invoice in a ledger. The
//! relay and the consumer are SIGKILLed mid-stream; poll mode is switched to CDC mid-stream. At
//! the end each invoice is booked exactly once, with its fields decrypted, and no personal
//! value is in clear in the outbox table, on the broker or in any process's output. Needs PHP
//! (`scripts/services/php.sh`).

use crate::common;

use common::amqp::{self, Topology};
use common::*;
use lapin::options::BasicPublishOptions;
use mysql_async::prelude::Queryable;
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);
const ARTISAN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/laravel/artisan");
const SCHEMA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/laravel/schema/invoice.issued.json"
);

/// One run of the example: its own database (the example's tables), key ring, exchange and
/// queue.
struct Laravel {
    db: MyDb,
    topo: Topology,
    queue: String,
    audit: String,
    _dir: tempfile::TempDir,
    keys: String,
}

impl Laravel {
    async fn new(prefix: &str) -> Laravel {
        let php = Command::new("php").arg("-v").output();
        assert!(
            php.is_ok_and(|o| o.status.success()),
            "php is not installed: run `sudo scripts/services/php.sh` (apt-get install -y php8.2-cli php8.2-mysql php-amqplib php-illuminate-database php-illuminate-events)"
        );
        let db = MyDb::create(prefix).await;
        // The example brings its own outbox table (the contract's has other columns).
        my_exec(&mut db.conn().await, "DROP TABLE outbox").await;
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys.json").to_str().unwrap().to_string();
        let g = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["keys", "generate", "--keys", &keys])
            .output()
            .unwrap();
        assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
        let topo = Topology::new(prefix).await;
        let queue = format!("{}.billing", topo.exchange);
        let mut lv = Laravel {
            db,
            queue,
            audit: String::new(),
            topo,
            _dir: dir,
            keys,
        };
        let m = lv.run(&["migrate"]);
        assert!(m.status.success(), "{}", String::from_utf8_lossy(&m.stderr));
        let (q, dead) = (lv.queue.clone(), format!("{}.dead", lv.queue));
        lv.topo.adopt(&[q, dead], &[]);
        lv
    }

    fn env(&self) -> [(&str, &str); 3] {
        [
            ("DB_DATABASE", &self.db.name),
            ("OUTBOX_KEYS", &self.keys),
            ("OUTBOX_SCHEMA", SCHEMA),
        ]
    }

    /// `php artisan <args>` to completion.
    fn run(&self, args: &[&str]) -> std::process::Output {
        Command::new("php")
            .arg(ARTISAN)
            .args(args)
            .envs(self.env())
            .output()
            .unwrap()
    }

    /// `php artisan <args>` in the background, its output collected.
    fn spawn(&self, args: &[&str]) -> Relay {
        let mut all = vec![ARTISAN];
        all.extend_from_slice(args);
        Relay::start_bin("php", &all, &self.env())
    }

    fn relay(&self, name: &str, mode: &str) -> Relay {
        let dsn = self.db.dsn();
        Relay::start_with_env(
            &[
                "run",
                "--source",
                &dsn,
                "--name",
                name,
                "--mode",
                mode,
                "--exchange",
                &self.topo.exchange,
                // The example's outbox table names its topic column `event_type`.
                "--column",
                "topic=event_type",
                "--log-level",
                "info,lapin=warn",
            ],
            &[("OUTBOXD_SINK", &amqp::url())],
        )
    }

    /// Once the relay declared the exchange: an audit queue that keeps a copy of every message
    /// as the broker carried it, then the consumer, ready once its queue is bound.
    async fn start_consumer(&mut self) -> Relay {
        self.topo.wait_declared(T).await;
        self.audit = self.topo.bind_queue("audit", "#").await;
        self.consumer().await
    }

    async fn consumer(&self) -> Relay {
        let c = self.spawn(&[
            "consume",
            "--queue",
            &self.queue,
            "--exchange",
            &self.topo.exchange,
        ]);
        c.wait_for_stderr(&["consuming"], T).await;
        c
    }

    async fn count(&self, sql: &str) -> u64 {
        my_value(&mut self.db.conn().await, sql)
            .await
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    async fn booked(&self) -> u64 {
        self.count("SELECT COUNT(*) FROM ledger").await
    }

    /// Waits until `n` ledger lines exist and checks that some of the `total` invoices are still
    /// to come (the kill that follows is mid-stream); returns the count.
    async fn booked_mid_stream(&self, n: u64, total: u64) -> u64 {
        wait_for(&format!("{n} invoices booked"), T, || async {
            self.booked().await >= n
        })
        .await;
        let booked = self.booked().await;
        assert!(
            booked < total,
            "the stream was over before the kill ({booked} booked)"
        );
        booked
    }

    /// The producer's `<number> <event id>` lines, after it exited with 0.
    async fn issued(&self, producer: &mut Relay, n: usize) -> Vec<String> {
        assert_eq!(producer.wait_exit(T).await, 0, "{}", producer.stderr());
        let lines = producer.lines();
        assert_eq!(lines.len(), n, "{lines:?}");
        lines
    }

    /// Drains what is left in the queue with a consumer that stops once it is empty.
    async fn drain(&self) -> String {
        let mut c = self.spawn(&[
            "consume",
            "--queue",
            &self.queue,
            "--exchange",
            &self.topo.exchange,
            "--until-empty",
            "yes",
        ]);
        assert_eq!(c.wait_exit(T).await, 0, "{}", c.stderr());
        c.stderr()
    }

    /// Every issued invoice booked exactly once, with the decrypted name, under its event id.
    async fn assert_each_booked_once(&self, issued: &[String]) {
        let n = issued.len() as u64;
        assert_eq!(self.count("SELECT COUNT(*) FROM invoices").await, n);
        assert_eq!(self.booked().await, n, "ledger lines");
        assert_eq!(
            self.count("SELECT COUNT(DISTINCT invoice_id) FROM ledger")
                .await,
            n,
            "an invoice booked twice"
        );
        assert_eq!(
            self.count(
                "SELECT COUNT(*) FROM ledger l JOIN invoices i ON i.id = l.invoice_id
                 JOIN outbox o ON o.id = l.event_id AND o.aggregate_id = i.id
                 WHERE l.customer_name = i.customer_name AND l.total_cents = i.total_cents"
            )
            .await,
            n,
            "ledger lines with the decrypted name under the invoice's own event"
        );
        let event_ids: Vec<String> = issued
            .iter()
            .map(|l| l.split(' ').nth(1).unwrap().replace('-', ""))
            .collect();
        let in_ledger = self
            .count(&format!(
                "SELECT COUNT(*) FROM ledger WHERE HEX(event_id) IN ({})",
                event_ids
                    .iter()
                    .map(|e| format!("'{}'", e.to_uppercase()))
                    .collect::<Vec<_>>()
                    .join(",")
            ))
            .await;
        assert_eq!(in_ledger, n, "the producer's event ids in the ledger");
        assert_eq!(
            self.count("SELECT COUNT(*) FROM processed_messages").await,
            n
        );
    }

    /// No customer name or tax id in clear: not in the outbox table, not in any message the
    /// broker carried (the audit queue), not in any process's output.
    async fn assert_never_in_clear(&self, outputs: &[String]) -> Vec<lapin::message::Delivery> {
        let mut c = self.db.conn().await;
        let clear: Vec<(String, String)> = c
            .query("SELECT customer_name, tax_id FROM invoices")
            .await
            .unwrap();
        assert!(!clear.is_empty());
        let payloads: Vec<String> = c.query("SELECT payload FROM outbox").await.unwrap();
        assert_eq!(payloads.len(), clear.len());
        let messages = self.topo.take_all(&self.audit).await;
        assert!(messages.len() >= clear.len(), "{} messages", messages.len());
        let bodies: Vec<String> = messages
            .iter()
            .map(|d| String::from_utf8_lossy(&d.data).into_owned())
            .collect();
        for (name, tax) in &clear {
            for (what, texts) in [
                ("outbox payload", &payloads),
                ("message", &bodies),
                ("output", &outputs.to_vec()),
            ] {
                for t in texts {
                    assert!(
                        !t.contains(name.as_str()) && !t.contains(tax.as_str()),
                        "{what} holds {name:?} or {tax:?} in clear: {t}"
                    );
                }
            }
        }
        for p in &payloads {
            let v: serde_json::Value = serde_json::from_str(p).unwrap();
            for f in ["customer_name", "tax_id"] {
                assert!(
                    v[f].as_str().is_some_and(|s| s.starts_with("enc:v1:")),
                    "{p}"
                );
            }
        }
        messages
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn laravel_relay_and_consumer_sigkilled_mid_stream_book_each_invoice_once() {
    let mut lv = Laravel::new("lv_cdc").await;
    let name = unique("lv");
    let mut relay = lv.relay(&name, "cdc");
    let mut consumer = lv.start_consumer().await;
    let total = 60;
    let mut producer = lv.spawn(&["issue-invoices", "--rate", "20", "--count", "60"]);

    // The relay, once it has stored a position (a relay killed before that starts over).
    lv.booked_mid_stream(10, total).await;
    relay
        .wait_running("a stored position", T, || async {
            lv.db.stored(&name).await.is_some()
        })
        .await;
    relay.sigkill();
    let mut relay = lv.relay(&name, "cdc");
    // The consumer, mid-stream too; the next one takes over its unacknowledged messages.
    let at = lv.booked_mid_stream(lv.booked().await + 10, total).await;
    consumer.sigkill();
    let consumer2 = lv.consumer().await;
    let issued = lv.issued(&mut producer, total as usize).await;

    let head = lv.db.head_past_writes().await;
    relay
        .wait_running("the stored position past the last invoice", T, || async {
            lv.db
                .stored(&name)
                .await
                .is_some_and(|(f, p, _)| binlog_ge(&(f, p), &head))
        })
        .await;
    assert!(
        relay.stderr().contains("streaming the binlog") && !relay.stderr().contains("first start"),
        "the second relay resumed from the stored position: {}",
        relay.stderr()
    );
    wait_for("every invoice booked", T, || async {
        lv.booked().await >= total
    })
    .await;
    let mut consumer2 = consumer2;
    consumer2.sigkill();
    let drained = lv.drain().await;
    lv.assert_each_booked_once(&issued).await;
    assert!(at >= 20, "the consumer was killed after {at} bookings");

    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let outputs = [
        relay.stderr(),
        consumer.stderr(),
        consumer2.stderr(),
        drained,
        producer.stderr(),
    ];
    let messages = lv.assert_never_in_clear(&outputs).await;

    // A redelivered message changes nothing (its claim is found); a message whose sealed
    // fields were copied to another event id goes to the dead-letter queue with the reason.
    let ch = lv.topo.channel().await;
    let original = &messages[0];
    // `original`'s headers with `version` as x-aggregate-version (none: without the header,
    // so the stale gate lets the message through and the claim alone must stop a repeat).
    let publish = |id: String, body: Vec<u8>, version: Option<i64>| {
        let ch = ch.clone();
        let mut headers = lapin::types::FieldTable::default();
        for (k, v) in original
            .properties
            .headers()
            .clone()
            .unwrap_or_default()
            .inner()
        {
            if k.as_str() != "x-aggregate-version" {
                headers.insert(k.clone(), v.clone());
            }
        }
        if let Some(v) = version {
            headers.insert(
                "x-aggregate-version".into(),
                lapin::types::AMQPValue::LongLongInt(v),
            );
        }
        let props = original
            .properties
            .clone()
            .with_message_id(id.into())
            .with_headers(headers);
        let q = lv.queue.clone();
        async move {
            ch.basic_publish(
                "".into(),
                q.as_str().into(),
                BasicPublishOptions::default(),
                &body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
    };
    let body = original.data.clone();
    publish(amqp::message_id(original).to_string(), body.clone(), None).await;
    publish(uuid::Uuid::now_v7().to_string(), body, None).await;
    let drained = lv.drain().await;
    assert!(drained.contains("WrongEvent"), "{drained}");
    lv.assert_each_booked_once(&issued).await;
    let dead = lv.topo.take_all(&format!("{}.dead", lv.queue)).await;
    assert_eq!(dead.len(), 1);
    let reason = amqp::header_str(&dead[0], "x-outboxd-error").unwrap_or_default();
    assert!(reason.starts_with("WrongEvent"), "{reason}");

    // The stale gate: new events of the same invoice, version 1 again (stale: dropped, its
    // claim recorded) and version 2 (newer: booked).
    let invoice: serde_json::Value = serde_json::from_slice(&original.data).unwrap();
    for (version, name) in [(1, "stale version"), (2, "newer version")] {
        let body = serde_json::json!({"invoice_id": invoice["invoice_id"], "customer_name": name,
                                      "total_cents": 1});
        publish(
            uuid::Uuid::now_v7().to_string(),
            body.to_string().into_bytes(),
            Some(version),
        )
        .await;
    }
    lv.drain().await;
    assert_eq!(lv.booked().await, total + 1);
    let gated = "SELECT COUNT(*) FROM ledger WHERE customer_name";
    assert_eq!(lv.count(&format!("{gated} = 'stale version'")).await, 0);
    assert_eq!(lv.count(&format!("{gated} = 'newer version'")).await, 1);
    let claims = lv.count("SELECT COUNT(*) FROM processed_messages").await;
    assert_eq!(claims, total + 2, "the stale message is claimed too");

    // Pruning is outboxd's: the consumer's claims and the relayed outbox rows (a window of 0s
    // here; in production longer than any redelivery can come late).
    for table in ["processed_messages", "outbox"] {
        let before = lv.count(&format!("SELECT COUNT(*) FROM {table}")).await;
        assert!(before >= total, "{table}: {before} rows before pruning");
        let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["prune", "--source", &lv.db.dsn(), "--table", table])
            .args(["--older-than", "0s", "--force"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            lv.count(&format!("SELECT COUNT(*) FROM {table}")).await,
            0,
            "{table}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn laravel_poll_mode_then_a_switch_to_cdc_books_each_invoice_once() {
    let mut lv = Laravel::new("lv_poll").await;
    let mut poll = lv.relay(&unique("lvp"), "poll");
    let mut consumer = lv.start_consumer().await;
    let total = 40;
    let mut producer = lv.spawn(&["issue-invoices", "--rate", "20", "--count", "30"]);

    // The switch: the poll relay stops (SIGTERM: its batch in flight is marked or released),
    // a CDC relay starts; its first start publishes the rows still pending, then streams. The
    // last 10 invoices are issued after the switch, so CDC carries some whatever the timing.
    lv.booked_mid_stream(10, 30).await;
    poll.signal("TERM");
    assert_eq!(poll.wait_exit(T).await, 0, "{}", poll.stderr());
    let name = unique("lvc");
    let mut cdc = lv.relay(&name, "cdc");
    let mut issued = lv.issued(&mut producer, 30).await;
    let mut producer2 = lv.spawn(&[
        "issue-invoices",
        "--rate",
        "50",
        "--count",
        "10",
        "--first",
        "31",
    ]);
    issued.extend(lv.issued(&mut producer2, 10).await);

    let head = lv.db.head_past_writes().await;
    cdc.wait_running("the stored position past the last invoice", T, || async {
        lv.db
            .stored(&name)
            .await
            .is_some_and(|(f, p, _)| binlog_ge(&(f, p), &head))
    })
    .await;
    wait_for("every invoice booked", T, || async {
        lv.booked().await >= total
    })
    .await;
    consumer.sigkill();
    let drained = lv.drain().await;
    lv.assert_each_booked_once(&issued).await;
    // Both modes carried invoices: poll mode marked its rows, the rows after the switch stay
    // pending (CDC never updates the table).
    let published = lv
        .count("SELECT COUNT(*) FROM outbox WHERE status = 'published'")
        .await;
    assert!(
        (10..total).contains(&published),
        "{published} rows published by poll mode"
    );
    cdc.signal("TERM");
    assert_eq!(cdc.wait_exit(T).await, 0, "{}", cdc.stderr());
    lv.assert_never_in_clear(&[
        poll.stderr(),
        cdc.stderr(),
        consumer.stderr(),
        drained,
        producer.stderr(),
        producer2.stderr(),
    ])
    .await;
}
