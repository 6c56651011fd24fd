//! Debezium's own Outbox Event Router tests, translated: each scenario here takes the rows,
//! the configuration and the assertions of one test of Debezium's `EventRouterTest` (the
//! router on records built by hand) or of its `AbstractEventRouterTest` (the router behind a
//! real connector and outbox table), and runs them end to end against a real Postgres and
//! MariaDB, on RabbitMQ and on Kafka where the sink matters (keys, partitions, record
//! timestamps, tombstones, header bytes). Each scenario's doc names the Debezium test(s) it
//! comes from. Debezium's configuration becomes outboxd's flags as
//! docs/migrating-from-debezium.md maps them; where outboxd does something else on purpose,
//! the scenario asserts what that page documents instead (and says so).
//!
//! Tests of Debezium's that have nothing to translate: `canSkipTombstone` (outboxd reads the
//! table's log, which has no tombstones: a DELETE is covered by `can_skip_deletion`),
//! `shouldFailWhenTheSchemaLooksValidButDoesNotHaveTheCorrectFields` and the other
//! `…WithoutDebeziumCdcEnvelope…` cases (Connect records that are not change events: the
//! nearest thing is DDL and other tables' rows, `can_skip_messages_without_debezium_cdc_envelope`),
//! `shouldFailOnInvalidConfigurationFor…` and `canFailOnUpdates` (configuration outboxd does
//! not have; `outboxd from-debezium` refuses or explains it, tested in `tests/surface`).

use crate::common::{self, amqp, kafka};
use common::amqp::Topology;
use common::source_db::SourceDb;
use common::Relay;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

/// The sink a scenario runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    Rabbit,
    Kafka,
}

/// The column types a scenario's outbox table uses, per database.
#[derive(Clone, Copy)]
enum Ty {
    Bool,
    Int,
    BigInt,
    Timestamp,
    Text,
    Bytes,
    Uuid,
}

/// How a database writes Debezium's outbox table and its rows.
trait Dbz: SourceDb {
    /// Whether a `BOOLEAN` column is a boolean (Postgres) or `TINYINT(1)` (MariaDB: 0 or 1).
    const BOOLEANS: bool;
    /// Debezium's reference outbox table as its examples create it here (the payload column
    /// of type `payload`), `extra` column definitions (`, name type`) after its columns.
    fn reference_table(payload: &str, extra: &str) -> String;
    /// The payload column's type in the reference table (`jsonb` / `JSON`).
    const JSON: &'static str;
    fn ty(t: Ty) -> &'static str;
    /// A literal for the payload column (`jsonb` / `JSON`).
    fn json(s: &str) -> String;
    /// A literal for a bytes column holding `s`.
    fn bytes(s: &str) -> String;
    /// Whether relay `name` streams from this database now.
    async fn streaming_now(&self, name: &str) -> bool;
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

impl Dbz for common::PgDb {
    const BOOLEANS: bool = true;
    const JSON: &'static str = "jsonb";
    fn reference_table(payload: &str, extra: &str) -> String {
        format!(
            "DROP TABLE outbox; CREATE TABLE outbox (id uuid NOT NULL PRIMARY KEY,
               aggregatetype varchar(255) NOT NULL, aggregateid varchar(255) NOT NULL,
               type varchar(255) NOT NULL, payload {payload}{extra})"
        )
    }
    fn ty(t: Ty) -> &'static str {
        match t {
            Ty::Bool => "boolean",
            Ty::Int => "int",
            Ty::BigInt => "bigint",
            Ty::Timestamp => "timestamp without time zone",
            Ty::Text => "varchar(1000)",
            Ty::Bytes => "bytea",
            Ty::Uuid => "uuid",
        }
    }
    fn json(s: &str) -> String {
        format!("{}::jsonb", quote(s))
    }
    fn bytes(s: &str) -> String {
        format!("convert_to({}, 'UTF8')", quote(s))
    }
    async fn streaming_now(&self, name: &str) -> bool {
        self.slot_active(format!("outboxd_{name}")).await
    }
}

impl Dbz for common::MyDb {
    const BOOLEANS: bool = false;
    const JSON: &'static str = "JSON";
    fn reference_table(payload: &str, extra: &str) -> String {
        format!(
            "DROP TABLE outbox; CREATE TABLE outbox (id CHAR(36) NOT NULL PRIMARY KEY,
               aggregatetype VARCHAR(255) NOT NULL, aggregateid VARCHAR(255) NOT NULL,
               type VARCHAR(255) NOT NULL, payload {payload}{extra})"
        )
    }
    fn ty(t: Ty) -> &'static str {
        match t {
            Ty::Bool => "BOOLEAN",
            Ty::Int => "INT",
            Ty::BigInt => "BIGINT",
            Ty::Timestamp => "DATETIME(3)",
            Ty::Text => "VARCHAR(1000)",
            Ty::Bytes => "BLOB",
            Ty::Uuid => "CHAR(36)",
        }
    }
    fn json(s: &str) -> String {
        quote(s)
    }
    fn bytes(s: &str) -> String {
        quote(s)
    }
    async fn streaming_now(&self, _name: &str) -> bool {
        self.streaming().await
    }
}

/// A header value as a consumer reads it: AMQP keeps the type, Kafka has bytes (text here).
#[derive(Clone, Debug, PartialEq)]
enum H {
    Str(String),
    Bool(bool),
    Int(i64),
    Float(f64),
    Other(String),
}

/// One message as either sink delivered it.
#[derive(Clone, Debug)]
struct Msg {
    /// The routing key (RabbitMQ) or the topic (Kafka).
    dest: String,
    /// The record key (Kafka) or `x-aggregate-id` (RabbitMQ).
    key: Option<String>,
    headers: Vec<(String, H)>,
    /// `None`: a Kafka tombstone.
    body: Option<Vec<u8>>,
    /// The record timestamp (Kafka, milliseconds) or the `timestamp` property (RabbitMQ,
    /// seconds, here × 1000).
    timestamp_ms: Option<i64>,
    partition: Option<i32>,
}

impl Msg {
    fn from_amqp(d: &Delivery) -> Msg {
        let headers = d
            .properties
            .headers()
            .as_ref()
            .map(|t| {
                t.inner()
                    .iter()
                    .map(|(k, v)| {
                        let h = match v {
                            AMQPValue::LongString(s) => {
                                H::Str(String::from_utf8_lossy(s.as_bytes()).into_owned())
                            }
                            AMQPValue::ShortString(s) => H::Str(s.to_string()),
                            AMQPValue::Boolean(b) => H::Bool(*b),
                            AMQPValue::LongLongInt(i) => H::Int(*i),
                            AMQPValue::LongInt(i) => H::Int(i64::from(*i)),
                            AMQPValue::Double(f) => H::Float(*f),
                            AMQPValue::Float(f) => H::Float(f64::from(*f)),
                            other => H::Other(format!("{other:?}")),
                        };
                        (k.to_string(), h)
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut m = Msg {
            dest: d.routing_key.to_string(),
            key: None,
            headers,
            body: Some(d.data.clone()),
            timestamp_ms: d.properties.timestamp().map(|s| s as i64 * 1000),
            partition: None,
        };
        m.key = m.text("x-aggregate-id");
        m
    }

    fn from_kafka(topic: &str, r: &kafka::Record) -> Msg {
        Msg {
            dest: topic.to_string(),
            key: r.key.clone(),
            headers: r
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), H::Str(v.clone())))
                .collect(),
            body: (!r.tombstone).then(|| r.value.clone()),
            timestamp_ms: r.timestamp,
            partition: Some(r.partition),
        }
    }

    fn header(&self, name: &str) -> Option<&H> {
        self.headers
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v)
    }

    /// A string header's value.
    fn text(&self, name: &str) -> Option<String> {
        match self.header(name)? {
            H::Str(s) => Some(s.clone()),
            _ => None,
        }
    }

    fn id(&self) -> Option<String> {
        self.text("id")
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(self.body.as_deref().expect("a value, not a tombstone"))
            .expect("a JSON body")
    }
}

/// What a typed header is on `via`: the AMQP type, or Kafka Connect's header text.
fn typed(via: Via, amqp: H, kafka_text: &str) -> H {
    match via {
        Via::Rabbit => amqp,
        Via::Kafka => H::Str(kafka_text.into()),
    }
}

/// One scenario's database, sink and relay.
struct Case<D: Dbz> {
    db: D,
    via: Via,
    name: String,
    /// Makes the aggregate types (and so the Kafka topics) this case's own on the shared broker.
    tag: String,
    topo: Option<Topology>,
    queue: Option<String>,
    dead_topic: String,
    relay: Option<Relay>,
}

impl<D: Dbz> Case<D> {
    /// A database whose outbox table is `ddl` (run as it is).
    async fn with_table(via: Via, ddl: &str) -> Case<D> {
        if via == Via::Kafka {
            kafka::require();
        }
        let db = D::create("dbz").await;
        db.exec(ddl).await;
        let tag = format!("x{}", &Uuid::new_v4().simple().to_string()[..8]);
        Case {
            db,
            via,
            name: common::unique("dbz"),
            topo: match via {
                Via::Rabbit => Some(Topology::new("dbz").await),
                Via::Kafka => None,
            },
            queue: None,
            dead_topic: format!("dbz.dead.{tag}"),
            tag,
            relay: None,
        }
    }

    /// Debezium's reference outbox table with `extra` columns.
    async fn new(via: Via, extra: &str) -> Case<D> {
        Self::with_table(via, &D::reference_table(D::JSON, extra)).await
    }

    /// The same with a `VARCHAR(1000)` payload (Debezium's `alterTableModifyPayload`), which
    /// can hold an empty payload.
    async fn new_text_payload(via: Via, extra: &str) -> Case<D> {
        Self::with_table(via, &D::reference_table(D::ty(Ty::Text), extra)).await
    }

    /// `base` made this case's own: the aggregate type (and Kafka topic suffix) it writes.
    fn agg(&self, base: &str) -> String {
        format!("{base}{}", self.tag)
    }

    fn args<'a>(&'a self, dsn: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "run",
            "--source",
            dsn,
            "--name",
            &self.name,
            "--log-level",
            "info,lapin=warn",
        ];
        match &self.topo {
            Some(t) => args.extend(["--exchange", t.exchange.as_str()]),
            None => args.extend(["--kafka-dead-topic", self.dead_topic.as_str()]),
        }
        args.extend_from_slice(extra);
        args
    }

    fn sink(&self) -> String {
        match self.via {
            Via::Rabbit => amqp::url(),
            Via::Kafka => kafka::url(),
        }
    }

    /// Starts the relay with `extra` flags and waits until it streams (and, on RabbitMQ,
    /// binds a queue to everything it publishes).
    async fn start(&mut self, extra: &[&str]) {
        let dsn = self.db.dsn();
        let sink = self.sink();
        let mut relay = Relay::start_with_env(&self.args(&dsn, extra), &[("OUTBOXD_SINK", &sink)]);
        let (db, name) = (&self.db, &self.name);
        relay
            .wait_running("the relay to stream", T, || db.streaming_now(name))
            .await;
        if let Some(t) = self.topo.as_mut() {
            t.wait_declared(T).await;
            self.queue = Some(t.bind_queue("all", "#").await);
        }
        self.relay = Some(relay);
    }

    /// Starts the relay with `extra` and expects it to refuse at start (exit 2) before any row
    /// is written; returns what it said.
    async fn refused(&self, extra: &[&str]) -> String {
        let dsn = self.db.dsn();
        let sink = self.sink();
        let mut relay = Relay::start_with_env(&self.args(&dsn, extra), &[("OUTBOXD_SINK", &sink)]);
        let code = relay.wait_exit(T).await;
        let err = relay.stderr_plain();
        assert_eq!(code, 2, "refused at start, with the fix: {err}");
        err
    }

    /// Inserts one row: Debezium's `createInsert(eventId, eventType, aggregateType,
    /// aggregateId, payload, additional)` — `payload` and `extra_values` as SQL.
    async fn insert(
        &self,
        id: Uuid,
        event_type: &str,
        aggregate_type: &str,
        aggregate_id: &str,
        payload: &str,
        extra: &[(&str, &str)],
    ) {
        let mut cols = "id, aggregatetype, aggregateid, type, payload".to_string();
        let mut vals = format!(
            "'{id}', {}, {}, {}, {payload}",
            quote(aggregate_type),
            quote(aggregate_id),
            quote(event_type)
        );
        for (c, v) in extra {
            cols.push_str(&format!(", {c}"));
            vals.push_str(&format!(", {v}"));
        }
        self.db
            .exec(&format!("INSERT INTO outbox ({cols}) VALUES ({vals})"))
            .await;
    }

    /// `n` messages: on RabbitMQ from the queue bound to everything; on Kafka from `topics`
    /// (each read whole, in its order).
    async fn take(&self, topics: &[String], n: usize) -> Vec<Msg> {
        match self.via {
            Via::Rabbit => {
                let t = self.topo.as_ref().expect("topology");
                t.take(self.queue.as_ref().expect("bound"), n, T)
                    .await
                    .iter()
                    .map(Msg::from_amqp)
                    .collect()
            }
            Via::Kafka => {
                let deadline = std::time::Instant::now() + T;
                loop {
                    let mut out = Vec::new();
                    for topic in topics {
                        let t = topic.clone();
                        let recs = tokio::task::spawn_blocking(move || kafka::read_all(&t, true))
                            .await
                            .expect("reader");
                        out.extend(recs.iter().map(|r| Msg::from_kafka(topic, r)));
                    }
                    if out.len() >= n {
                        assert_eq!(out.len(), n, "exactly {n} records in {topics:?}: {out:#?}");
                        return out;
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{} of {n} records in {topics:?} after {T:?}; the relay's stderr:\n{}",
                        out.len(),
                        self.relay.as_ref().map(Relay::stderr).unwrap_or_default()
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// `n` dead records, with their reasons.
    async fn take_dead(&self, n: usize) -> Vec<Msg> {
        match self.via {
            Via::Rabbit => {
                let t = self.topo.as_ref().expect("topology");
                t.take(&t.dead(), n, T)
                    .await
                    .iter()
                    .map(Msg::from_amqp)
                    .collect()
            }
            Via::Kafka => self.take(std::slice::from_ref(&self.dead_topic), n).await,
        }
    }

    /// The topic Debezium's router names for `aggregate_type` (`outbox.event.<type>`).
    fn topic(&self, aggregate_type: &str) -> String {
        format!("outbox.event.{aggregate_type}")
    }

    /// Whether nothing else arrived: RabbitMQ's queue is empty once `take` took what it took.
    async fn nothing_more(&self) {
        if let (Some(t), Some(q)) = (&self.topo, &self.queue) {
            assert_eq!(t.queue_len(q).await, 0, "nothing more was published");
            assert_eq!(t.queue_len(&t.dead()).await, 0, "and nothing dead");
        }
    }

    async fn stop(mut self) {
        let mut relay = self.relay.take().expect("started");
        relay.signal("TERM");
        assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    }
}

/// Runs each scenario on both databases against the sinks listed:
/// `name::<sink>::{postgres,mariadb}`.
macro_rules! debezium_cases {
    ($($scenario:ident: [$($via:ident),+]),* $(,)?) => {$(
        mod $scenario {
            $(
                #[allow(non_snake_case)]
                mod $via {
                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn postgres() {
                        super::super::$scenario::<crate::common::PgDb>(super::super::Via::$via).await
                    }

                    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                    async fn mariadb() {
                        super::super::$scenario::<crate::common::MyDb>(super::super::Via::$via).await
                    }
                }
            )+
        }
    )*};
}

debezium_cases! {
    can_skip_deletion: [Rabbit],
    can_skip_updates: [Rabbit],
    can_skip_messages_without_debezium_cdc_envelope: [Rabbit],
    can_extract_table_fields: [Rabbit, Kafka],
    can_set_default_message_key: [Kafka],
    can_set_message_key: [Kafka],
    fails_on_invalid_set_message_key: [Rabbit],
    can_set_timestamp_from_debezium_envelope_by_default: [Rabbit, Kafka],
    can_set_timestamp_by_user_defined_configuration: [Rabbit, Kafka],
    can_route_based_on_field: [Rabbit, Kafka],
    can_configure_every_table_field: [Kafka],
    can_influence_table_column_types: [Kafka],
    can_set_schema_version_when_more_than_payload_is_in_envelope: [Kafka],
    can_set_payload_type_into_the_envelope: [Kafka],
    can_set_multiple_fields_into_the_envelope: [Rabbit, Kafka],
    can_set_partition_with_additional_fields: [Kafka],
    can_pass_int_key: [Kafka],
    can_pass_binary_message: [Rabbit, Kafka],
    can_mark_an_event_as_deleted: [Kafka],
    no_tombstone_if_not_configured: [Rabbit, Kafka],
    can_expand_json_payload_if_configured: [Kafka],
    should_fail_on_missing_field: [Rabbit],
    should_consume_records_from_insert: [Kafka],
    should_send_event_type_as_header: [Rabbit, Kafka],
    should_send_event_type_as_value: [Kafka],
    should_support_all_features: [Rabbit, Kafka],
    should_produce_tombstone_event_for_null_payload: [Kafka],
}

const DEBEZIUM: &[&str] = &["--column", "debezium"];

/// `EventRouterTest.canSkipDeletion` (and `canSkipTombstone`): deleting an outbox row — what
/// a producer does to keep the table small right after the insert — publishes nothing.
async fn can_skip_deletion<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(DEBEZIUM).await;
    let (a, marker) = (Uuid::now_v7(), Uuid::now_v7());
    let user = c.agg("User");
    c.insert(a, "UserCreated", &user, "10711fa5", &D::json("{}"), &[])
        .await;
    c.db.exec(&format!("DELETE FROM outbox WHERE id = '{a}'"))
        .await;
    c.insert(
        marker,
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 2).await;
    let ids: Vec<_> = got.iter().map(|m| m.id().unwrap()).collect();
    assert_eq!(
        ids,
        [a.to_string(), marker.to_string()],
        "the insert and the marker, no deletion"
    );
    c.nothing_more().await;
    c.stop().await;
}

/// `EventRouterTest.canSkipUpdates`: an UPDATE of an outbox row publishes nothing. Debezium's
/// `canFailOnUpdates` (`debezium.op.invalid.behavior=fatal`) has no counterpart: outboxd never
/// publishes updates and keeps running, as docs/migrating-from-debezium.md says.
async fn can_skip_updates<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(DEBEZIUM).await;
    let (a, marker) = (Uuid::now_v7(), Uuid::now_v7());
    let user = c.agg("User");
    c.insert(a, "UserCreated", &user, "10711fa5", &D::json("{}"), &[])
        .await;
    c.db.exec(&format!(
        "UPDATE outbox SET payload = {} WHERE id = '{a}'",
        D::json(r#"{"updated": true}"#)
    ))
    .await;
    c.insert(
        marker,
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 2).await;
    assert_eq!(got[0].id().as_deref(), Some(a.to_string().as_str()));
    assert_eq!(got[0].json(), serde_json::json!({}), "the insert's payload");
    assert_eq!(got[1].id().as_deref(), Some(marker.to_string().as_str()));
    c.nothing_more().await;
    c.stop().await;
}

/// `EventRouterTest.canSkipMessagesWithoutDebeziumCdcEnvelopeDueToMissingSchemaName` (and its
/// `…SchemaNameSuffix` and `…MissingValueSchema` siblings): what is not an insert into the
/// outbox — here DDL on the outbox table and rows of another table — publishes nothing, and
/// the relay goes on.
async fn can_skip_messages_without_debezium_cdc_envelope<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.db.exec("CREATE TABLE other_table (id INT PRIMARY KEY, v VARCHAR(10))")
        .await;
    c.start(DEBEZIUM).await;
    c.db.exec("INSERT INTO other_table VALUES (1, 'a')").await;
    c.db.exec("ALTER TABLE outbox ADD COLUMN note VARCHAR(10) NULL")
        .await;
    let marker = Uuid::now_v7();
    let user = c.agg("User");
    c.insert(
        marker,
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    assert_eq!(got[0].id(), Some(marker.to_string()));
    c.nothing_more().await;
    c.stop().await;
}

/// `EventRouterTest.canExtractTableFields` and `AbstractEventRouterTest
/// .shouldRespectJsonFormatAsString`: the value is the payload (`{}`; the email object), its
/// JSON as the column holds it.
async fn can_extract_table_fields<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(DEBEZIUM).await;
    let user = c.agg("User");
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "7bdf2e9e",
        &D::json(r#"{"email": "gh@mefi.in"}"#),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 2).await;
    assert_eq!(got[0].body.as_deref(), Some(&b"{}"[..]));
    assert_eq!(got[1].json()["email"], "gh@mefi.in");
    c.stop().await;
}

/// `EventRouterTest.canSetDefaultMessageKey` (and `canPassStringKey`): the record key is
/// `aggregateid`.
async fn can_set_default_message_key<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(DEBEZIUM).await;
    let user = c.agg("User");
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    assert_eq!(got[0].key.as_deref(), Some("10711fa5"));
    c.stop().await;
}

/// `EventRouterTest.canSetMessageKey`: `table.field.event.key=type` is
/// `--column aggregate_id=type`: the key is the event type.
async fn can_set_message_key<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(&["--column", "debezium;aggregate_id=type"]).await;
    let user = c.agg("User");
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    assert_eq!(got[0].key.as_deref(), Some("UserCreated"));
    c.stop().await;
}

/// `EventRouterTest.failsOnInvalidSetMessageKey`: a key column that does not exist
/// (`fakefield`) fails. Debezium fails at the first record; outboxd refuses at start, before
/// any row, with the fix.
async fn fails_on_invalid_set_message_key<D: Dbz>(via: Via) {
    let c = Case::<D>::new(via, "").await;
    let err = c
        .refused(&["--column", "debezium;aggregate_id=fakefield"])
        .await;
    assert!(
        err.contains("fakefield") && err.contains("fix:") && err.contains("ALTER TABLE"),
        "{err}"
    );
}

/// `EventRouterTest.canSetTimestampFromDebeziumEnvelopeByDefault`: without a timestamp column
/// the record's timestamp is the event's time. Debezium's is its envelope's `ts_ms` (when the
/// connector processed the change); outboxd's is the transaction's commit time — the time the
/// row became an event, which `x-outbox-created-at` and RabbitMQ's `timestamp` carry too.
async fn can_set_timestamp_from_debezium_envelope_by_default<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(DEBEZIUM).await;
    let user = c.agg("User");
    let before = chrono::Utc::now().timestamp_millis() - 2000;
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let after = chrono::Utc::now().timestamp_millis() + 2000;
    let got = c.take(&[c.topic(&user)], 1).await;
    let ts = got[0].timestamp_ms.expect("a timestamp");
    // RabbitMQ's property has seconds.
    assert!(
        ts >= before - 1000 && ts <= after,
        "{before} ≤ {ts} ≤ {after}"
    );
    let created =
        chrono::DateTime::parse_from_rfc3339(&got[0].text("x-outbox-created-at").unwrap())
            .unwrap()
            .timestamp_millis();
    match via {
        Via::Kafka => assert_eq!(ts, created, "the commit time, as x-outbox-created-at"),
        Via::Rabbit => assert_eq!(ts / 1000, created / 1000),
    }
    c.stop().await;
}

/// `EventRouterTest.canSetTimestampByUserDefinedConfiguration` and `AbstractEventRouterTest
/// .shouldConvertMicrosecondsTimestampToMilliseconds`: `table.field.event.timestamp=createdat`
/// is `--column created_at=createdat`; a `TIMESTAMP` of `2019-03-24 20:52:59` (microseconds in
/// the column) is the record timestamp 1553460779000 ms.
async fn can_set_timestamp_by_user_defined_configuration<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(
        via,
        &format!(", createdat {} NOT NULL", D::ty(Ty::Timestamp)),
    )
    .await;
    c.start(&["--column", "debezium;created_at=createdat"])
        .await;
    let user = c.agg("UserEmail");
    c.insert(
        Uuid::now_v7(),
        "UserUpdated",
        &user,
        "7bdf2e9e",
        &D::json(r#"{"email": "gh@mefi.in"}"#),
        &[("createdat", "'2019-03-24 20:52:59'")],
    )
    .await;
    c.insert(
        Uuid::now_v7(),
        "UserUpdated",
        &user,
        "7bdf2e9e",
        &D::json("{}"),
        &[("createdat", "'2019-03-24 20:52:59.123'")],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 2).await;
    assert_eq!(got[0].timestamp_ms, Some(1_553_460_779_000));
    match via {
        Via::Kafka => assert_eq!(got[1].timestamp_ms, Some(1_553_460_779_123)),
        Via::Rabbit => assert_eq!(got[1].timestamp_ms, Some(1_553_460_779_000)),
    }
    c.stop().await;
}

/// `EventRouterTest.canRouteBasedOnField`: `route.by.field=aggregatetype` is the default
/// topic `outbox.event.<aggregatetype>`: two User events and an Address event.
async fn can_route_based_on_field<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(DEBEZIUM).await;
    let (user, address) = (c.agg("User"), c.agg("Address"));
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    c.insert(
        Uuid::now_v7(),
        "UserUpdate",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    c.insert(
        Uuid::now_v7(),
        "AddressCreated",
        &address,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user), c.topic(&address)], 3).await;
    let dests: Vec<&str> = got.iter().map(|m| m.dest.as_str()).collect();
    let (tu, ta) = (c.topic(&user), c.topic(&address));
    assert_eq!(dests, [tu.as_str(), tu.as_str(), ta.as_str()]);
    c.stop().await;
}

/// `EventRouterTest.canConfigureEveryTableField`: every column renamed (`event_id`,
/// `payload_id`, `event_type`, `payload_body`, routed by `payload_id`) is `--column` plus a
/// `--routing-key` over the column; Debezium's `id` header is `--header id=id` without the
/// preset.
async fn can_configure_every_table_field<D: Dbz>(via: Via) {
    let ddl = format!(
        "DROP TABLE outbox; CREATE TABLE outbox (event_id {} NOT NULL PRIMARY KEY,
           payload_id {t} NOT NULL, event_type {t} NOT NULL, payload_body {t} NOT NULL)",
        D::ty(Ty::Uuid),
        t = D::ty(Ty::Text)
    );
    let mut c = Case::<D>::with_table(via, &ddl).await;
    c.start(&[
        "--column",
        "id=event_id;aggregate_id=payload_id;topic=event_type;payload=payload_body",
        "--routing-key",
        "outbox.event.{payload_id}",
        "--header",
        "id=id",
    ])
    .await;
    let id = Uuid::now_v7();
    let key = c.agg("10711fa5");
    c.db.exec(&format!(
        "INSERT INTO outbox VALUES ('{id}', '{key}', 'UserCreated', '{{}}')"
    ))
    .await;
    let got = c.take(&[c.topic(&key)], 1).await;
    assert_eq!(got[0].body.as_deref(), Some(&b"{}"[..]));
    assert_eq!(got[0].id(), Some(id.to_string()));
    assert_eq!(got[0].key.as_deref(), Some(key.as_str()));
    c.stop().await;
}

/// `EventRouterTest.canInfluenceTableColumnTypes`: columns of other types. An integer
/// `event_id` is refused at start (documented: the event id is the message id and the
/// consumer's idempotency key, a UUID); an integer `payload_id` is the key in decimal; a bytes
/// `payload_body` travels as bytes (`--payload-content-type`); `some_boolean:envelope:bool` is
/// `--envelope-field some_boolean=bool`, a boolean on Postgres and MariaDB's `TINYINT(1)` 1
/// (documented: MariaDB has no boolean type), the bytes payload a string when it is UTF-8 text
/// (Kafka Connect's JsonConverter writes a bytes field in base64: documented); routed by
/// `my_route_field`.
async fn can_influence_table_column_types<D: Dbz>(via: Via) {
    let table = |id_type: &str| {
        format!(
            "DROP TABLE IF EXISTS outbox; CREATE TABLE outbox (event_id {id_type} NOT NULL PRIMARY KEY,
               payload_id {} NOT NULL, event_type {} NOT NULL, my_route_field {} NOT NULL,
               payload_body {} NOT NULL, some_boolean {} NOT NULL)",
            D::ty(Ty::BigInt),
            D::ty(Ty::Text),
            D::ty(Ty::Text),
            D::ty(Ty::Bytes),
            D::ty(Ty::Bool)
        )
    };
    let mut c = Case::<D>::with_table(via, &table(D::ty(Ty::Int))).await;
    let flags = [
        "--column",
        "id=event_id;aggregate_id=payload_id;topic=event_type;payload=payload_body",
        "--routing-key",
        "outbox.event.{my_route_field}",
        "--payload-content-type",
        "application/octet-stream",
        "--envelope-field",
        "some_boolean=bool",
    ];
    let err = c.refused(&flags).await;
    assert!(err.contains("event_id") && err.contains("fix:"), "{err}");
    c.db.exec(&table(D::ty(Ty::Uuid))).await;
    c.start(&flags).await;
    let route = c.agg("routename");
    let id = Uuid::now_v7();
    c.db.exec(&format!(
        "INSERT INTO outbox VALUES ('{id}', 1232, 'CoolSchemaCreated', '{route}', {}, true)",
        D::bytes("{}")
    ))
    .await;
    let got = c.take(&[c.topic(&route)], 1).await;
    assert_eq!(got[0].key.as_deref(), Some("1232"));
    let bool_value = if D::BOOLEANS {
        serde_json::json!(true)
    } else {
        serde_json::json!(1)
    };
    assert_eq!(
        got[0].json(),
        serde_json::json!({"payload": "{}", "bool": bool_value})
    );
    assert_eq!(
        got[0].id(),
        Some(id.to_string()),
        "the Kafka sink's id header"
    );
    c.stop().await;
}

/// `EventRouterTest.canSetSchemaVersionWhenMoreThanPayloadIsInEnvelope` and
/// `shouldNotSetSchemaVersionByDefault`: Debezium versions the value's Connect schema from a
/// `version` column; outboxd has no schema registry (documented), and a `version` column is the
/// aggregate's version, `x-aggregate-version`, beside the envelope field.
async fn can_set_schema_version_when_more_than_payload_is_in_envelope<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, &format!(", version {} NOT NULL", D::ty(Ty::Int))).await;
    c.start(&["--column", "debezium", "--envelope-field", "type=eventType"])
        .await;
    let user = c.agg("User");
    for v in [1, 3, 1] {
        c.insert(
            Uuid::now_v7(),
            "UserCreated",
            &user,
            "10711fa5",
            &D::json("{}"),
            &[("version", &v.to_string())],
        )
        .await;
    }
    let got = c.take(&[c.topic(&user)], 3).await;
    let versions: Vec<_> = got.iter().map(|m| m.text("x-aggregate-version")).collect();
    assert_eq!(
        versions,
        [Some("1".into()), Some("3".into()), Some("1".into())]
    );
    assert_eq!(
        got[0].json(),
        serde_json::json!({"payload": {}, "eventType": "UserCreated"})
    );
    c.stop().await;
}

/// `EventRouterTest.canSetPayloadTypeIntoTheEnvelope` (`type:envelope`),
/// `canSetPayloadTypeIntoTheEnvelopeWithAlias` (`type:envelope:aggregateType`) and
/// `canExpandJsonPayloadWithAdditionalFieldInEnvelope`: the value becomes
/// `{"payload": <payload>, <field>: <value>}`, the payload expanded.
async fn can_set_payload_type_into_the_envelope<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(&[
        "--column",
        "debezium",
        "--envelope-field",
        "type,type=aggregateType",
    ])
    .await;
    let user = c.agg("User");
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json(r#"{"fullName": "John Doe"}"#),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    assert_eq!(
        got[0].json(),
        serde_json::json!({"payload": {"fullName": "John Doe"}, "type": "UserCreated", "aggregateType": "UserCreated"})
    );
    c.stop().await;
}

/// `EventRouterTest.canSetMultipleFieldsIntoTheEnvelope`:
/// `type:envelope:payloadType,aggregateid:envelope:payloadId,type:header:payloadType`.
async fn can_set_multiple_fields_into_the_envelope<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(&[
        "--column",
        "debezium",
        "--envelope-field",
        "type=payloadType,aggregateid=payloadId",
        "--header",
        "type=payloadType",
    ])
    .await;
    let user = c.agg("User");
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json("{}"),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    let v = got[0].json();
    assert_eq!(v["payloadType"], "UserCreated");
    assert_eq!(v["payloadId"], "10711fa5");
    assert_eq!(got[0].text("payloadType").as_deref(), Some("UserCreated"));
    c.stop().await;
}

/// `EventRouterTest.canSetPartitionWithAdditionalFields`: `p:partition` is
/// `--kafka-partition-column p`: the record goes to partition `p`. Debezium's 123 becomes a
/// partition this case's topic has (3 of 4); a NULL leaves it to the key (as Debezium's
/// router leaves it to the producer), and a partition the topic does not have is a dead record
/// with the reason (Debezium's producer fails the task).
async fn can_set_partition_with_additional_fields<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, &format!(", p {} NULL", D::ty(Ty::Int))).await;
    c.start(&[
        "--column",
        "debezium",
        "--kafka-partitions",
        "4",
        "--kafka-partition-column",
        "p",
    ])
    .await;
    let route = c.agg("routename");
    let (a, b, bad) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    c.insert(
        a,
        "CoolSchemaCreated",
        &route,
        "1232",
        &D::json("{}"),
        &[("p", "3")],
    )
    .await;
    c.insert(
        b,
        "CoolSchemaCreated",
        &route,
        "1232",
        &D::json("{}"),
        &[("p", "NULL")],
    )
    .await;
    c.insert(
        bad,
        "CoolSchemaCreated",
        &route,
        "1232",
        &D::json("{}"),
        &[("p", "9")],
    )
    .await;
    let got = c.take(&[c.topic(&route)], 2).await;
    let by_id = |id: Uuid| got.iter().find(|m| m.id() == Some(id.to_string())).unwrap();
    assert_eq!(by_id(a).partition, Some(3));
    assert_eq!(
        by_id(b).partition,
        Some(outboxd::sink::partition::partition_of("1232", 4) as i32)
    );
    let dead = c.take_dead(1).await;
    let reason = dead[0].text("x-dead-reason").unwrap_or_default();
    assert!(reason.contains("partition 9"), "{reason}");
    c.stop().await;
}

/// `EventRouterTest.canPassIntKey` (and `canPassBinaryKey`, `canSetBinaryMessageKey`): an
/// integer `aggregateid` is the key in decimal text (outboxd's keys are text, documented);
/// a bytes key column is refused at start with the fix (documented).
async fn can_pass_int_key<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(
        via,
        &format!(
            ", numkey {} NULL, rawkey {} NULL",
            D::ty(Ty::BigInt),
            D::ty(Ty::Bytes)
        ),
    )
    .await;
    let err = c
        .refused(&["--column", "debezium;aggregate_id=rawkey"])
        .await;
    assert!(err.contains("rawkey") && err.contains("fix:"), "{err}");
    c.start(&["--column", "debezium;aggregate_id=numkey"]).await;
    let user = c.agg("User");
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "ignored",
        &D::json("{}"),
        &[("numkey", "1232")],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    assert_eq!(got[0].key.as_deref(), Some("1232"));
    c.stop().await;
}

/// `EventRouterTest.canPassBinaryMessage`: a bytes payload travels byte for byte, with the
/// content type `--payload-content-type` gives it.
async fn can_pass_binary_message<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, &format!(", body {} NULL", D::ty(Ty::Bytes))).await;
    c.start(&[
        "--column",
        "debezium;payload=body",
        "--payload-content-type",
        "application/octet-stream",
    ])
    .await;
    let user = c.agg("User");
    c.insert(
        Uuid::now_v7(),
        "UserCreated",
        &user,
        "10711fa5",
        "NULL",
        &[("body", &D::bytes("not json \u{1}"))],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    assert_eq!(got[0].body.as_deref(), Some(&b"not json \x01"[..]));
    if via == Via::Kafka {
        assert_eq!(
            got[0].text("content-type").as_deref(),
            Some("application/octet-stream")
        );
    }
    c.stop().await;
}

/// `EventRouterTest.canMarkAnEventAsDeleted`: `is_deleted:envelope:deleted` with
/// `route.tombstone.on.empty.payload=true` is `--envelope-field is_deleted=deleted
/// --kafka-tombstones`: a payload gives `{"payload": {}, "deleted": true}`, an empty one a
/// tombstone (the key, no value).
async fn can_mark_an_event_as_deleted<D: Dbz>(via: Via) {
    let mut c =
        Case::<D>::new_text_payload(via, &format!(", is_deleted {} NULL", D::ty(Ty::Bool))).await;
    c.start(&[
        "--column",
        "debezium",
        "--envelope-field",
        "is_deleted=deleted",
        "--kafka-tombstones",
    ])
    .await;
    let user = c.agg("User");
    let (a, t) = (Uuid::now_v7(), Uuid::now_v7());
    c.insert(
        a,
        "UserCreated",
        &user,
        "10711fa5",
        "'{}'",
        &[("is_deleted", "true")],
    )
    .await;
    c.insert(
        t,
        "UserCreated",
        &user,
        "10711fa5",
        "''",
        &[("is_deleted", "true")],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 2).await;
    let deleted = if D::BOOLEANS {
        serde_json::json!(true)
    } else {
        serde_json::json!(1)
    };
    assert_eq!(
        got[0].json(),
        serde_json::json!({"payload": {}, "deleted": deleted})
    );
    assert_eq!(got[1].body, None, "a tombstone");
    assert_eq!(got[1].key.as_deref(), Some("10711fa5"));
    assert_eq!(got[1].id(), Some(t.to_string()));
    c.stop().await;
}

/// `EventRouterTest.noTombstoneIfNotConfigured` and `AbstractEventRouterTest
/// .shouldNotProduceTombstoneEventForNullPayload`: without the tombstone option Debezium
/// publishes `{"payload": "" | null, …}`; outboxd publishes no message whose payload is
/// missing — a NULL or empty payload is a dead record with the reason (documented).
async fn no_tombstone_if_not_configured<D: Dbz>(via: Via) {
    let mut c =
        Case::<D>::new_text_payload(via, &format!(", is_deleted {} NULL", D::ty(Ty::Bool))).await;
    c.start(&[
        "--column",
        "debezium",
        "--envelope-field",
        "is_deleted=deleted",
    ])
    .await;
    let user = c.agg("User");
    let (empty, null) = (Uuid::now_v7(), Uuid::now_v7());
    c.insert(
        empty,
        "UserCreated",
        &user,
        "10711fa5",
        "''",
        &[("is_deleted", "true")],
    )
    .await;
    c.insert(
        null,
        "UserUpdated",
        &user,
        "a9d76f78",
        "NULL",
        &[("is_deleted", "true")],
    )
    .await;
    let dead = c.take_dead(2).await;
    assert_eq!(
        dead.iter()
            .map(|m| m.text("x-dead-reason").unwrap())
            .collect::<Vec<_>>(),
        ["payload is not valid JSON", "payload is NULL"]
    );
    assert_eq!(dead[1].text("x-aggregate-id").as_deref(), Some("a9d76f78"));
    c.nothing_more().await;
    c.stop().await;
}

/// `EventRouterTest.canExpandJsonPayloadIfConfigured`,
/// `canExpandJsonWithNestedArraysWhereFirstArrayIsEmpty`,
/// `shouldExpandJSONPayloadWithEmptyArrayAndRemoveThatArray`,
/// `canExpandJsonArrayWithFirstElementNull`, `canExpandJsonArrayWithComplexElements` and
/// `shouldNotExpandJSONPayloadIfNotConfigured`: outboxd always publishes a JSON payload as the
/// value itself (documented: `table.expand.json.payload` is always on), and no schema is
/// inferred from it, so nothing of it is dropped — not even the empty array Debezium's
/// expansion removes.
async fn can_expand_json_payload_if_configured<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(DEBEZIUM).await;
    let user = c.agg("User");
    let payloads = [
        r#"{"fullName": "John Doe", "enabled": true, "rating": 4.9, "age": 42, "pets": ["dog", "cat"], "petObjects": [{"type": "dog"}, {"type": "cat"}]}"#,
        r#"{"fullName": "John Doe", "petObjects": [{"type": "dog", "colors": []}, {"type": "cat", "colors": [{"name": "white"}]}]}"#,
        r#"{"fullName": "John Doe", "petObjects": [{"type": "dog", "colors": []}]}"#,
        r#"{"fullName": "John Doe", "numbers": [null, 2, 3]}"#,
        r#"{"fullName": "John Doe", "rating": 4.9, "age": 42}"#,
    ];
    for p in payloads {
        c.insert(
            Uuid::now_v7(),
            "UserCreated",
            &user,
            "10711fa5",
            &D::json(p),
            &[],
        )
        .await;
    }
    let got = c.take(&[c.topic(&user)], payloads.len()).await;
    for (m, p) in got.iter().zip(payloads) {
        let want: serde_json::Value = serde_json::from_str(p).unwrap();
        assert_eq!(m.json(), want);
    }
    c.stop().await;
}

/// `EventRouterTest.shouldFailOnMissingField` and `canSetFieldIntoTheEnvelopeWithMissingField`:
/// an additional field whose column does not exist. Debezium fails at the first record (or
/// ignores the field with `…missing=ignore`); outboxd refuses at start, before any row, with
/// the `ALTER TABLE` that adds it — for `--envelope-field` and for `--header` alike (no
/// "ignore": a typo in a flag is not a column that is sometimes there).
async fn should_fail_on_missing_field<D: Dbz>(via: Via) {
    let c = Case::<D>::new(via, "").await;
    let err = c
        .refused(&[
            "--column",
            "debezium",
            "--envelope-field",
            "nonExistingField=alias",
        ])
        .await;
    assert!(
        err.contains("nonExistingField") && err.contains("ALTER TABLE"),
        "{err}"
    );
    let err = c
        .refused(&["--column", "debezium", "--header", "nope=x-nope"])
        .await;
    assert!(
        err.contains("\"nope\"") && err.contains("ALTER TABLE"),
        "{err}"
    );
}

/// `AbstractEventRouterTest.shouldConsumeRecordsFromInsert`: a row already in the table when
/// the connector starts (its initial snapshot, here `--snapshot all`) and one inserted after:
/// both on `outbox.event.User`, key `aggregateid`, value the payload.
async fn should_consume_records_from_insert<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    let user = c.agg("User");
    let (before, after) = (
        Uuid::parse_str("70f52ae3-f671-4bac-ae62-1b9be6e73700").unwrap(),
        Uuid::parse_str("59a42efd-b015-44a9-9dde-cb36d9002425").unwrap(),
    );
    c.insert(
        before,
        "UserCreated",
        &user,
        "10711faf",
        &D::json("{}"),
        &[],
    )
    .await;
    c.start(&["--column", "debezium", "--snapshot", "all"])
        .await;
    c.insert(after, "UserCreated", &user, "10711fa5", &D::json("{}"), &[])
        .await;
    let got = c.take(&[c.topic(&user)], 2).await;
    assert_eq!(got[0].id(), Some(before.to_string()));
    assert_eq!(got[1].id(), Some(after.to_string()));
    assert_eq!(got[1].key.as_deref(), Some("10711fa5"));
    assert_eq!(got[1].json(), serde_json::json!({}));
    c.stop().await;
}

/// `AbstractEventRouterTest.shouldSendEventTypeAsHeader`: `type:header:eventType` is
/// `--header type=eventType`.
async fn should_send_event_type_as_header<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(&["--column", "debezium", "--header", "type=eventType"])
        .await;
    let user = c.agg("User");
    c.insert(
        Uuid::parse_str("59a42efd-b015-44a9-9dde-cb36d9002425").unwrap(),
        "UserCreated",
        &user,
        "10711fa5",
        &D::json(r#"{"email": "gh@mefi.in"}"#),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    assert_eq!(got[0].dest, c.topic(&user));
    assert_eq!(got[0].text("eventType").as_deref(), Some("UserCreated"));
    assert_eq!(got[0].json()["email"], "gh@mefi.in");
    c.stop().await;
}

/// `AbstractEventRouterTest.shouldSendEventTypeAsValue`: `type:envelope:eventType` is
/// `--envelope-field type=eventType`.
async fn should_send_event_type_as_value<D: Dbz>(via: Via) {
    let mut c = Case::<D>::new(via, "").await;
    c.start(&["--column", "debezium", "--envelope-field", "type=eventType"])
        .await;
    let user = c.agg("User");
    c.insert(
        Uuid::parse_str("d4da2428-8b19-11ea-bc55-0242ac130003").unwrap(),
        "UserCreated",
        &user,
        "9948fcad",
        &D::json(r#"{"email": "gh@mefi.in"}"#),
        &[],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    let v = got[0].json();
    assert_eq!(v["eventType"], "UserCreated");
    assert_eq!(v["payload"]["email"], "gh@mefi.in");
    c.stop().await;
}

/// The extra columns of Debezium's `alterTableWithExtra4Fields` and the flags of its
/// "all features" configuration: `version:envelope:eventVersion`,
/// `aggregatetype:envelope:aggregateType`, `somebooltype:envelope:someBoolType`,
/// `somebooltype:header`, `is_deleted:envelope:deleted`, `table.field.event.timestamp=createdat`.
fn all_features<D: Dbz>() -> (String, Vec<&'static str>) {
    (
        format!(
            ", version {} NOT NULL, somebooltype {} NOT NULL, createdat {} NOT NULL, is_deleted {} DEFAULT false",
            D::ty(Ty::Int),
            D::ty(Ty::Bool),
            D::ty(Ty::Timestamp),
            D::ty(Ty::Bool)
        ),
        vec![
            "--column",
            "debezium;created_at=createdat",
            "--envelope-field",
            "version=eventVersion,aggregatetype=aggregateType,somebooltype=someBoolType,is_deleted=deleted",
            "--header",
            "somebooltype=somebooltype",
        ],
    )
}

/// `AbstractEventRouterTest.shouldSupportAllFeatures`: the record's timestamp from `createdat`
/// (1553460779000), topic `outbox.event.UserEmail`, header `id`, header `somebooltype` a
/// boolean `true` (AMQP boolean; on Kafka `true` as Kafka Connect's header converter writes
/// it; MariaDB's `BOOLEAN` is `TINYINT(1)`: 1, documented), key `aggregateid`, and the value
/// `{"payload": …, "eventVersion": 1, "aggregateType": "UserEmail", "someBoolType": true,
/// "deleted": false}`.
async fn should_support_all_features<D: Dbz>(via: Via) {
    let (extra, flags) = all_features::<D>();
    let mut c = Case::<D>::new(via, &extra).await;
    c.start(&flags).await;
    let user = c.agg("UserEmail");
    let id = Uuid::parse_str("f9171eb6-19f3-4579-9206-0e179d2ebad7").unwrap();
    c.insert(
        id,
        "UserUpdated",
        &user,
        "7bdf2e9e",
        &D::json(r#"{"email": "gh@mefi.in"}"#),
        &[
            ("version", "1"),
            ("somebooltype", "true"),
            ("createdat", "'2019-03-24 20:52:59'"),
        ],
    )
    .await;
    let got = c.take(&[c.topic(&user)], 1).await;
    let m = &got[0];
    assert_eq!(m.timestamp_ms, Some(1_553_460_779_000));
    assert_eq!(m.dest, c.topic(&user));
    assert_eq!(m.id(), Some(id.to_string()));
    let header = m.header("somebooltype").cloned();
    if D::BOOLEANS {
        assert_eq!(header, Some(typed(via, H::Bool(true), "true")));
    } else {
        assert_eq!(header, Some(typed(via, H::Int(1), "1")));
    }
    assert_eq!(m.key.as_deref(), Some("7bdf2e9e"));
    let (t, f) = if D::BOOLEANS {
        (serde_json::json!(true), serde_json::json!(false))
    } else {
        (serde_json::json!(1), serde_json::json!(0))
    };
    assert_eq!(
        m.json(),
        serde_json::json!({"payload": {"email": "gh@mefi.in"}, "eventVersion": 1,
            "aggregateType": user, "someBoolType": t, "deleted": f})
    );
    c.stop().await;
}

/// `AbstractEventRouterTest.shouldProduceTombstoneEventForNullPayload` (all features, a NULL
/// payload, `route.tombstone.on.empty.payload=true`) and `…ForEmptyPayload` (a `VARCHAR`
/// payload of `''`): tombstones with the key, the timestamp from `createdat`, the `id` and
/// `somebooltype` headers.
async fn should_produce_tombstone_event_for_null_payload<D: Dbz>(via: Via) {
    let (extra, mut flags) = all_features::<D>();
    let mut c = Case::<D>::new_text_payload(via, &extra).await;
    flags.push("--kafka-tombstones");
    c.start(&flags).await;
    let user = c.agg("UserEmail");
    let (null, empty) = (
        Uuid::parse_str("a9d76f78-bda6-48d3-97ed-13a146163218").unwrap(),
        Uuid::now_v7(),
    );
    let extra_values = [
        ("version", "1"),
        ("somebooltype", "true"),
        ("createdat", "'2019-03-24 20:52:59'"),
        ("is_deleted", "true"),
    ];
    c.insert(
        null,
        "UserUpdated",
        &user,
        "a9d76f78",
        "NULL",
        &extra_values,
    )
    .await;
    c.insert(empty, "UserUpdated", &user, "a9d76f78", "''", &extra_values)
        .await;
    let got = c.take(&[c.topic(&user)], 2).await;
    for (m, id) in got.iter().zip([null, empty]) {
        assert_eq!(m.body, None, "a tombstone");
        assert_eq!(m.timestamp_ms, Some(1_553_460_779_000));
        assert_eq!(m.id(), Some(id.to_string()));
        assert_eq!(m.key.as_deref(), Some("a9d76f78"));
        let want = if D::BOOLEANS { "true" } else { "1" };
        assert_eq!(m.text("somebooltype").as_deref(), Some(want));
    }
    c.stop().await;
}

/// Runs a scenario that needs no sink on both databases: `name::{postgres,mariadb}`.
macro_rules! on_both {
    ($($scenario:ident),*) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$scenario::<crate::common::PgDb>().await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mariadb() {
                super::$scenario::<crate::common::MyDb>().await
            }
        }
    )*};
}

on_both!(check_names_a_column_the_flags_need_and_the_table_lacks);

/// `outboxd check` maps the table with the columns `run` would read with the same flags: a
/// `--header` or `--envelope-field` column the table lacks fails the "outbox table" line with
/// the `ALTER TABLE` that adds it; without them the line is ok.
async fn check_names_a_column_the_flags_need_and_the_table_lacks<D: Dbz>() {
    let db = D::create("dbzcheck").await;
    db.exec(&D::reference_table(D::JSON, "")).await;
    let dsn = db.dsn();
    let check = |extra: &'static [&'static str]| {
        let mut args = vec![
            "check".to_string(),
            "--source".into(),
            dsn.clone(),
            "--column".into(),
            "debezium".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        async move {
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut p = Relay::start(&a);
            p.wait_exit(T).await;
            let out = p.lines();
            // The table's line and its fix.
            let at = out
                .iter()
                .position(|l| l.contains("outbox table:"))
                .unwrap_or_else(|| panic!("an outbox table line: {out:#?}"));
            out[at..(at + 2).min(out.len())].join("\n")
        }
    };
    let ok = check(&[]).await;
    assert!(ok.starts_with("ok"), "{ok}");
    for flags in [
        &["--header", "nope=x-nope"][..],
        &["--envelope-field", "nope=alias"][..],
    ] {
        let line = check(flags).await;
        assert!(
            line.starts_with("FAIL") && line.contains("\"nope\"") && line.contains("ALTER TABLE"),
            "{flags:?}: {line}"
        );
    }
}
