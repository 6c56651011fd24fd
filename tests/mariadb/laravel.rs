//! The Laravel example application (`examples/laravel/`, on the `outboxd/laravel` package) end
//! to end, as its team would run it: `php artisan invoices:issue` writes invoices
//! (`Outbox::write` inside `DB::transaction`, sensitive fields sealed per the topic's schema)
//! while outboxd relays the outbox rows from the MariaDB binlog (or, in poll mode, from the
//! table) to RabbitMQ and `php artisan outbox:consume billing` books each invoice in a ledger.
//! The consumer starts before the relay and waits for its exchange. The relay and the consumer
//! are SIGKILLed mid-stream; poll mode is switched to CDC mid-stream. At the end each invoice is
//! booked exactly once, with its fields decrypted, and no personal value is in clear in the
//! application's tables, the outbox, on the broker or in any process's output; `php artisan
//! outbox:prune` keeps the pending rows in poll mode. Needs PHP (`scripts/services/php.sh`,
//! then `scripts/php-install.sh`).

use crate::common;

use common::amqp::{self, Topology};
use common::*;
use lapin::options::BasicPublishOptions;
use mysql_async::prelude::Queryable;
use outboxd::crypto::{decrypt_payload, Keyring};
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);
const APP: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/laravel");
const ARTISAN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/laravel/artisan");

/// The clear values `invoices:issue` gives invoice `k`: its customer's name and tax id.
fn personal(k: u64) -> (String, String) {
    (
        format!("Customer Ğüneş {k}"),
        format!("DE{:09}", k * 7919 % 1_000_000_000),
    )
}

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
            "php is not installed: run `scripts/services/php.sh` (apt-get install -y php8.2-cli php8.2-mysql php-amqplib php-laravel-framework phpunit composer)"
        );
        assert!(
            std::path::Path::new(APP).join("vendor/autoload.php").is_file(),
            "examples/laravel has no vendor/: run `scripts/php-install.sh` (composer install, offline)"
        );
        let db = MyDb::create(prefix).await;
        // The package's migration creates the outbox table (its own layout), and the consumer's.
        let mut c = db.conn().await;
        for table in [
            "outbox",
            "processed_messages",
            "consumer_aggregate_versions",
        ] {
            my_exec(&mut c, &format!("DROP TABLE IF EXISTS {table}")).await;
        }
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
        let m = lv.run(&["migrate", "--force"]);
        assert!(m.status.success(), "{}", String::from_utf8_lossy(&m.stderr));
        let (q, dead) = (lv.queue.clone(), format!("{}.dead", lv.queue));
        lv.topo.adopt(&[q, dead], &[]);
        lv
    }

    /// The application's settings, as its `.env` would hold them (the environment wins over
    /// `.env`); logs to stderr, where they are checked for clear values too.
    fn env(&self) -> [(&str, &str); 7] {
        [
            ("DB_DATABASE", &self.db.name),
            ("OUTBOX_KEYRING", &self.keys),
            ("OUTBOX_EXCHANGE", &self.topo.exchange),
            ("BILLING_QUEUE", &self.queue),
            ("LOG_CHANNEL", "stderr"),
            ("OUTBOXD_BINARY", env!("CARGO_BIN_EXE_outboxd")),
            ("OUTBOXD_MODE", "cdc"),
        ]
    }

    /// `php artisan <args>` to completion.
    fn run(&self, args: &[&str]) -> std::process::Output {
        self.run_with(args, &[])
    }

    /// `php artisan <args>` to completion, with `env` over the application's settings.
    fn run_with(&self, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
        Command::new("php")
            .arg(ARTISAN)
            .args(args)
            .envs(self.env())
            .envs(env.iter().copied())
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
                "--log-level",
                "info,lapin=warn",
            ],
            &[("OUTBOXD_SINK", &amqp::url())],
        )
    }

    /// Once the relay declared the exchange: an audit queue that keeps a copy of every message
    /// as the broker carried it.
    async fn audit(&mut self) {
        self.topo.wait_declared(T).await;
        self.audit = self.topo.bind_queue("audit", "#").await;
    }

    /// `php artisan outbox:consume billing`, without waiting.
    fn consumer_spawn(&self) -> Relay {
        self.spawn(&["outbox:consume", "billing"])
    }

    /// A consumer, ready once its queue is bound.
    async fn consumer(&self) -> Relay {
        let c = self.consumer_spawn();
        consuming(&c).await;
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

    /// `(row uuid, sealed value)` of `column` in `table`, opened with the key ring (the
    /// `Sealed` cast binds each value to its row's uuid and to `/<table>/<column>`).
    async fn opened(&self, table: &str, column: &str, order: &str) -> Vec<String> {
        let rows: Vec<(String, String)> = self
            .db
            .conn()
            .await
            .query(format!(
                "SELECT uuid, {column} FROM {table} ORDER BY {order}"
            ))
            .await
            .unwrap();
        let keyring = Keyring::load(std::path::Path::new(&self.keys)).unwrap();
        rows.into_iter()
            .map(|(uuid, sealed)| {
                assert!(sealed.starts_with("enc:v1:"), "{table}.{column} in clear");
                let doc = serde_json::json!({ table: { column: sealed } });
                let open = decrypt_payload(&keyring, uuid.parse().unwrap(), &doc).unwrap();
                open[table][column].as_str().unwrap().to_string()
            })
            .collect()
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

    /// Drains what is left in the queue with a consumer that stops once it is empty; returns
    /// its output.
    async fn drain(&self) -> String {
        let mut c = self.spawn(&["outbox:consume", "billing", "--stop-when-empty"]);
        assert_eq!(c.wait_exit(T).await, 0, "{}", output(&c));
        output(&c)
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
                 WHERE l.total_cents = i.total_cents"
            )
            .await,
            n,
            "ledger lines under the invoice's own event"
        );
        // The name the consumer booked is the one the invoice was issued with: both sealed at
        // rest, each under its own row.
        let booked = self.opened("ledger", "customer_name", "invoice_id").await;
        let invoiced = self.opened("invoices", "customer_name", "id").await;
        assert_eq!(booked, invoiced, "the decrypted names booked");
        let event_ids: Vec<&str> = issued
            .iter()
            .map(|l| l.split(' ').nth(1).unwrap())
            .collect();
        let in_ledger = self
            .count(&format!(
                "SELECT COUNT(*) FROM ledger WHERE event_id IN ({})",
                event_ids
                    .iter()
                    .map(|e| format!("'{e}'"))
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

    /// No customer name or tax id in clear: not in the application's own tables (invoices,
    /// ledger), not in the outbox table, not in any message the broker carried (the audit
    /// queue), not in any process's output.
    async fn assert_never_in_clear(
        &self,
        issued: &[String],
        outputs: &[String],
    ) -> Vec<lapin::message::Delivery> {
        let mut c = self.db.conn().await;
        let clear: Vec<(String, String)> = issued
            .iter()
            .map(|l| personal(l[4..12].parse().unwrap()))
            .collect();
        assert!(!clear.is_empty());
        let payloads: Vec<String> = c.query("SELECT payload FROM outbox").await.unwrap();
        assert_eq!(payloads.len(), clear.len());
        let mut tables: Vec<String> = c
            .query("SELECT CONCAT_WS(' ', uuid, number, customer_name, tax_id, tax_id_index) FROM invoices")
            .await
            .unwrap();
        let ledger: Vec<String> = c
            .query("SELECT CONCAT_WS(' ', uuid, customer_name) FROM ledger")
            .await
            .unwrap();
        tables.extend(ledger);
        assert!(tables.len() >= 2 * clear.len());
        let messages = self.topo.take_all(&self.audit).await;
        assert!(messages.len() >= clear.len(), "{} messages", messages.len());
        let bodies: Vec<String> = messages
            .iter()
            .map(|d| String::from_utf8_lossy(&d.data).into_owned())
            .collect();
        for (name, tax) in &clear {
            for (what, texts) in [
                ("application table row", &tables),
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

/// What an artisan command printed: its stdout lines (the console), then its stderr (the log).
fn output(c: &Relay) -> String {
    format!("{}\n{}", c.lines().join("\n"), c.stderr())
}

/// Waits until `outbox:consume` says it is consuming (its queue declared and bound).
async fn consuming(c: &Relay) {
    wait_for("outbox:consume consuming", T, || async {
        output(c).contains("Consuming ")
    })
    .await;
}

fn assert_ok(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn laravel_relay_and_consumer_sigkilled_mid_stream_book_each_invoice_once() {
    let mut lv = Laravel::new("lv_cdc").await;
    // The consumer first, as the README starts it: it waits for the relay's exchange.
    let mut consumer = lv.consumer_spawn();
    wait_for("the consumer waiting for the exchange", T, || async {
        output(&consumer).contains("Waiting for the exchange")
    })
    .await;
    let name = unique("lv");
    let mut relay = lv.relay(&name, "cdc");
    lv.audit().await;
    consuming(&consumer).await;
    let total = 60;
    let mut producer = lv.spawn(&["invoices:issue", "--rate=20", "--count=60"]);

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
        output(&consumer),
        output(&consumer2),
        drained,
        producer.stderr(),
    ];
    let messages = lv.assert_never_in_clear(&issued, &outputs).await;

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
    let names = lv.opened("ledger", "customer_name", "id").await;
    assert!(!names.iter().any(|n| n == "stale version"), "{names:?}");
    assert_eq!(names.iter().filter(|n| *n == "newer version").count(), 1);
    let claims = lv.count("SELECT COUNT(*) FROM processed_messages").await;
    assert_eq!(claims, total + 2, "the stale message is claimed too");

    // `php artisan outbox:prune` (outboxd prune): the consumer's claims and the relayed outbox
    // rows (a window of 0s here; in production longer than any redelivery can come late).
    for table in ["processed_messages", "outbox"] {
        let before = lv.count(&format!("SELECT COUNT(*) FROM {table}")).await;
        assert!(before >= total, "{table}: {before} rows before pruning");
    }
    assert_ok(&lv.run(&["outbox:prune", "--older-than=0s", "--force"]));
    for table in ["processed_messages", "outbox"] {
        let after = lv.count(&format!("SELECT COUNT(*) FROM {table}")).await;
        assert_eq!(after, 0, "{table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn laravel_poll_mode_then_a_switch_to_cdc_books_each_invoice_once() {
    let mut lv = Laravel::new("lv_poll").await;
    let mut poll = lv.relay(&unique("lvp"), "poll");
    lv.audit().await;
    let mut consumer = lv.consumer().await;
    let total = 40;
    let mut producer = lv.spawn(&["invoices:issue", "--rate=20", "--count=30"]);

    // The switch: the poll relay stops (SIGTERM: its batch in flight is marked or released),
    // a CDC relay starts; its first start publishes the rows still pending, then streams. The
    // last 10 invoices are issued after the switch, so CDC carries some whatever the timing.
    lv.booked_mid_stream(10, 30).await;
    poll.signal("TERM");
    assert_eq!(poll.wait_exit(T).await, 0, "{}", poll.stderr());
    let name = unique("lvc");
    let mut cdc = lv.relay(&name, "cdc");
    let mut issued = lv.issued(&mut producer, 30).await;
    let mut producer2 = lv.spawn(&["invoices:issue", "--rate=50", "--count=10", "--first=31"]);
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
    lv.assert_never_in_clear(
        &issued,
        &[
            poll.stderr(),
            cdc.stderr(),
            output(&consumer),
            drained,
            producer.stderr(),
            producer2.stderr(),
        ],
    )
    .await;

    // outbox:prune in poll mode (OUTBOXD_MODE=poll, as the application's .env says when it
    // relays by polling) deletes only the rows poll mode published: the rows after the switch
    // are still pending and stay.
    assert_ok(&lv.run_with(
        &[
            "outbox:prune",
            "--older-than=0s",
            "--force",
            "--table=outbox",
        ],
        &[("OUTBOXD_MODE", "poll")],
    ));
    assert_eq!(
        lv.count("SELECT COUNT(*) FROM outbox WHERE status = 'published'")
            .await,
        0
    );
    assert_eq!(
        lv.count("SELECT COUNT(*) FROM outbox").await,
        total - published,
        "the pending rows kept"
    );
}
