//! A Debezium connector's configuration as the outboxd configuration file that relays the same
//! outbox table the same way (`outboxd from-debezium`). Reads Kafka Connect's connector JSON
//! (`{"name": …, "config": {…}}` or the bare config object) and Debezium Server's
//! `application.properties` (`debezium.source.*`, `debezium.transforms.*`, `debezium.sink.*`).
//! Every option is either carried over into a key of the file (its keys are `run`'s long flags,
//! docs/configuration.md) or named under "not carried over" with the reason: nothing is dropped
//! silently. A connector that is not a Postgres or MySQL/MariaDB connector, or that does not run
//! the Outbox Event Router, is refused.

use crate::names::Column;
use crate::Error;
use std::collections::BTreeMap;

/// The file, and what of the input it could not carry over (option, why).
#[derive(Debug, Clone)]
pub struct Translation {
    pub toml: String,
    pub not_carried: Vec<(String, String)>,
}

/// Which runtime the configuration came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runtime {
    KafkaConnect,
    DebeziumServer,
}

/// The input, split: the connector's options, the Outbox Event Router's (without their
/// prefixes), Debezium Server's sink and format options, and everything else.
#[derive(Debug, Default)]
struct Parts {
    name: Option<String>,
    connector: BTreeMap<String, String>,
    router: BTreeMap<String, String>,
    router_prefix: String,
    sink: BTreeMap<String, String>,
    other: BTreeMap<String, String>,
}

const EVENT_ROUTER: &[&str] = &[
    "io.debezium.transforms.outbox.EventRouter",
    "io.debezium.transforms.outbox.EventRouterDelegate",
];

fn refuse(problem: impl Into<String>, fix: impl Into<String>) -> Error {
    Error::config(problem, fix)
}

/// `application.properties` as key → value (comments, `key=value`/`key: value`/`key value`,
/// line continuations and the common escapes).
fn properties(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut logical = String::new();
    for raw in text.lines() {
        let line = raw.trim_start();
        if logical.is_empty() && (line.is_empty() || line.starts_with('#') || line.starts_with('!'))
        {
            continue;
        }
        let backslashes = line.chars().rev().take_while(|c| *c == '\\').count();
        if backslashes % 2 == 1 {
            logical.push_str(&line[..line.len() - 1]);
            continue;
        }
        logical.push_str(line);
        let entry = std::mem::take(&mut logical);
        let mut key = String::new();
        let mut chars = entry.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    if let Some(n) = chars.next() {
                        key.push(n);
                    }
                }
                '=' | ':' => break,
                c if c.is_whitespace() => {
                    while chars.peek().is_some_and(|c| c.is_whitespace()) {
                        chars.next();
                    }
                    if matches!(chars.peek(), Some('=') | Some(':')) {
                        chars.next();
                    }
                    break;
                }
                c => key.push(c),
            }
        }
        let rest: String = chars.collect();
        let mut value = String::new();
        let mut it = rest.trim_start().chars();
        while let Some(c) = it.next() {
            if c == '\\' {
                match it.next() {
                    Some('n') => value.push('\n'),
                    Some('t') => value.push('\t'),
                    Some(o) => value.push(o),
                    None => {}
                }
            } else {
                value.push(c);
            }
        }
        if !key.is_empty() {
            out.insert(key, value.trim_end().to_string());
        }
    }
    out
}

fn json_map(v: &serde_json::Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| {
                    let text = match v {
                        serde_json::Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    (k.clone(), text)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Splits a flat option map (Kafka Connect's keys, or Debezium Server's with their
/// `debezium.source.` / `debezium.` prefixes already taken off the transforms) into parts.
fn split(
    mut all: BTreeMap<String, String>,
    runtime: Runtime,
    name: Option<String>,
) -> Result<Parts, Error> {
    let (source_prefix, transforms_key, transform_prefix) = match runtime {
        Runtime::KafkaConnect => ("", "transforms", "transforms."),
        Runtime::DebeziumServer => (
            "debezium.source.",
            "debezium.transforms",
            "debezium.transforms.",
        ),
    };
    let mut parts = Parts {
        name,
        ..Parts::default()
    };
    let transforms: Vec<String> = all
        .remove(transforms_key)
        .map(|t| {
            t.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let router = transforms.iter().find(|t| {
        all.get(&format!("{transform_prefix}{t}.type"))
            .is_some_and(|ty| EVENT_ROUTER.contains(&ty.trim()))
    });
    let Some(router) = router.cloned() else {
        return Err(refuse(
            "the connector does not run Debezium's Outbox Event Router (no transform of type io.debezium.transforms.outbox.EventRouter)",
            "outboxd relays an outbox table the way the Outbox Event Router does; translate the configuration of the connector that routes your outbox table",
        ));
    };
    parts.router_prefix = format!("{transform_prefix}{router}.");
    for (k, v) in all {
        if let Some(opt) = k.strip_prefix(&parts.router_prefix) {
            if opt != "type" {
                parts.router.insert(opt.to_string(), v);
            }
        } else if runtime == Runtime::DebeziumServer && k.starts_with("debezium.sink.") {
            parts.sink.insert(k, v);
        } else if let Some(opt) = k
            .strip_prefix(source_prefix)
            .filter(|_| !source_prefix.is_empty())
        {
            parts.connector.insert(opt.to_string(), v);
        } else if runtime == Runtime::KafkaConnect && !k.starts_with(transform_prefix) {
            parts.connector.insert(k, v);
        } else {
            parts.other.insert(k, v);
        }
    }
    // The other transforms' own options.
    for t in transforms.iter().filter(|t| **t != router) {
        parts
            .other
            .insert(format!("{transform_prefix}{t}"), format!("(transform {t})"));
    }
    Ok(parts)
}

fn parse_input(input: &str) -> Result<(Parts, Runtime), Error> {
    let trimmed = input.trim_start();
    if trimmed.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(trimmed).map_err(|e| {
            refuse(
                format!("the connector configuration is not valid JSON: {e}"),
                "give Kafka Connect's connector JSON ({\"name\": …, \"config\": {…}}) or Debezium Server's application.properties",
            )
        })?;
        let (name, config) = match v.get("config") {
            Some(c) => (
                v.get("name").and_then(|n| n.as_str()).map(String::from),
                json_map(c),
            ),
            None => (None, json_map(&v)),
        };
        let name = name.or_else(|| config.get("name").cloned());
        let mut config = config;
        config.remove("name");
        Ok((
            split(config, Runtime::KafkaConnect, name)?,
            Runtime::KafkaConnect,
        ))
    } else {
        let props = properties(input);
        if !props.keys().any(|k| k.starts_with("debezium.")) {
            return Err(refuse(
                "no debezium.* property found: not a Debezium Server application.properties",
                "give Kafka Connect's connector JSON or Debezium Server's application.properties",
            ));
        }
        let name = props.get("debezium.source.name").cloned();
        Ok((
            split(props, Runtime::DebeziumServer, name)?,
            Runtime::DebeziumServer,
        ))
    }
}

/// A TOML basic string.
fn toml_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn toml_list(items: &[String]) -> String {
    format!(
        "[{}]",
        items
            .iter()
            .map(|s| toml_str(s))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// `{` and `}` of literal template text doubled.
fn template_text(s: &str) -> String {
    s.replace('{', "{{").replace('}', "}}")
}

/// A relay name from the connector's: `[a-z0-9_]`, at most 40 characters.
fn relay_name(name: &str) -> String {
    let mut n: String = name
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    n.truncate(40);
    if n.is_empty() {
        "outboxd".into()
    } else {
        n
    }
}

/// Why an option of the connector (not the router) is not carried over; `None` for options
/// this translation reads.
fn connector_option_reason(key: &str) -> Option<&'static str> {
    const READ: &[&str] = &[
        "name",
        "connector.class",
        "database.hostname",
        "database.port",
        "database.user",
        "database.dbname",
        "database.sslmode",
        "slot.name",
        "publication.name",
        "plugin.name",
        "table.include.list",
        "snapshot.mode",
        "offset.storage.file.filename",
    ];
    if READ.contains(&key) {
        return None;
    }
    Some(match key {
        "database.password" => "a secret: it never goes into a config file; give the DSN's password with OUTBOXD_SOURCE or source_file",
        "tasks.max" => "one relay publishes a table's events in commit order; run standbys with --ha instead",
        "topic.prefix" | "database.server.name" => "names Debezium's change-event topics; the Outbox Event Router's topics (and outboxd's) do not use it",
        "database.server.id" => "outboxd registers with a server id derived from --name",
        "database.include.list" | "schema.include.list" | "table.whitelist" | "database.whitelist" | "schema.whitelist" | "column.include.list" | "column.exclude.list" | "table.exclude.list" => "outboxd reads the outbox table named by --table (from table.include.list); other filters do not apply",
        "heartbeat.interval.ms" | "heartbeat.action.query" | "heartbeat.topics.prefix" => "outboxd acknowledges the server's keepalives while the outbox is idle, so the slot follows the WAL without heartbeats",
        "publication.autocreate.mode" => "outboxd creates a publication for the outbox table when --publication does not exist, and uses an existing one as it is",
        "slot.drop.on.stop" => "outboxd never drops its slot on stop; `outboxd teardown` does",
        "tombstones.on.delete" => "deletes of the outbox table are never published",
        "decimal.handling.mode" | "time.precision.mode" | "binary.handling.mode" | "bigint.unsigned.handling.mode" | "interval.handling.mode" | "hstore.handling.mode" => "outboxd sends column values as docs/message-format.md says (booleans, integers and floats typed, the rest as text), not per Debezium's modes",
        "include.schema.changes" | "schema.history.internal.kafka.topic" | "schema.history.internal.kafka.bootstrap.servers" | "schema.history.internal" | "schema.history.internal.file.filename" | "database.history.kafka.topic" | "database.history.kafka.bootstrap.servers" => "outboxd keeps no schema history: it maps columns by name from each table map (binlog_row_metadata=FULL) or relation message",
        "key.converter" | "value.converter" | "header.converter" | "key.converter.schemas.enable" | "value.converter.schemas.enable" => "outboxd writes the key as the aggregate id's text, the value as the payload's bytes (StringConverter's and ByteArrayConverter's output; JsonConverter with schemas.enable=true also sent a schema, which outboxd does not) and headers as SimpleHeaderConverter writes them",
        "poll.interval.ms" | "max.batch.size" | "max.queue.size" | "max.queue.size.in.bytes" => "outboxd's flow is bounded by --window and --max-inflight-bytes",
        "errors.tolerance" | "errors.log.enable" | "errors.log.include.messages" | "errors.deadletterqueue.topic.name" | "errors.deadletterqueue.context.headers.enable" | "errors.retry.timeout" | "errors.retry.delay.max.ms" => "a row that cannot be published becomes a dead record with the reason (docs/message-format.md); the stream never stops for one",
        "provide.transaction.metadata" => "outboxd publishes no transaction boundary events; x-source-position orders events",
        "signal.data.collection" | "signal.enabled.channels" | "incremental.snapshot.chunk.size" | "read.only" => "no signals or incremental snapshots: a first start publishes the table's rows by --snapshot",
        "snapshot.locking.mode" | "snapshot.isolation.mode" | "snapshot.fetch.size" | "snapshot.delay.ms" | "snapshot.max.threads" | "snapshot.select.statement.overrides" | "snapshot.include.collection.list" => "outboxd's first start reads the table in one consistent snapshot of its own (--snapshot)",
        "offset.storage" | "offset.flush.interval.ms" | "offset.flush.timeout.ms" | "offset.storage.topic" => "outboxd keeps its position in the outboxd_state table (or --offset-file); take Debezium's with `outboxd offset set --from-debezium`",
        "database.ssl.mode" | "database.sslrootcert" | "database.sslcert" | "database.sslkey" | "database.ssl.truststore" | "database.ssl.keystore" => "give TLS settings in the source DSN (sslmode/ssl-mode, sslrootcert; docs/configuration.md)",
        k if k.starts_with("producer.override.") || k.starts_with("consumer.override.") => "librdkafka's producer is configured by outboxd's --kafka-* flags",
        k if k.starts_with("key.converter.") || k.starts_with("value.converter.") || k.starts_with("header.converter.") => "converters do not apply: see key.converter/value.converter",
        k if k.starts_with("schema.history.") || k.starts_with("database.history.") => "outboxd keeps no schema history",
        k if k.starts_with("errors.") => "a row that cannot be published becomes a dead record with the reason",
        k if k.starts_with("snapshot.") => "outboxd's first start reads the table by --snapshot",
        k if k.starts_with("predicates") => "predicates select records for transforms; outboxd relays inserts of the outbox table only",
        _ => "not an option outboxd has: it configures Debezium's own machinery",
    })
}

/// Translates a Debezium connector configuration into an outboxd configuration file.
pub fn translate(input: &str) -> Result<Translation, Error> {
    let (p, runtime) = parse_input(input)?;
    let mut not_carried: Vec<(String, String)> = Vec::new();
    let mut keys: Vec<(String, String, Option<String>)> = Vec::new();
    let mut key = |k: &str, v: String, why: Option<String>| keys.push((k.into(), v, why));
    let c = &p.connector;
    let class = c.get("connector.class").map(|s| s.trim()).unwrap_or("");
    let (scheme, default_port) = match class {
        "io.debezium.connector.postgresql.PostgresConnector" => ("postgres", "5432"),
        "io.debezium.connector.mysql.MySqlConnector" => ("mysql", "3306"),
        "io.debezium.connector.mariadb.MariaDbConnector" => ("mariadb", "3306"),
        other => {
            return Err(refuse(
                format!("connector.class {other:?}: outboxd reads Postgres and MySQL/MariaDB"),
                "translate a io.debezium.connector.postgresql.PostgresConnector, mysql.MySqlConnector or mariadb.MariaDbConnector configuration",
            ))
        }
    };
    let postgres = scheme == "postgres";

    // The source DSN, without its password.
    let host = c
        .get("database.hostname")
        .cloned()
        .unwrap_or_else(|| "localhost".into());
    let port = c
        .get("database.port")
        .cloned()
        .unwrap_or_else(|| default_port.into());
    let user = c.get("database.user").cloned().unwrap_or_default();
    let tables: Vec<String> = c
        .get("table.include.list")
        .map(|t| {
            t.split(',')
                .map(|s| s.trim().replace("\\.", "."))
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let database = if postgres {
        c.get("database.dbname").cloned().unwrap_or_default()
    } else {
        tables
            .first()
            .and_then(|t| t.split_once('.').map(|(db, _)| db.to_string()))
            .or_else(|| {
                c.get("database.include.list")
                    .map(|d| d.split(',').next().unwrap_or("").trim().to_string())
            })
            .unwrap_or_default()
    };
    let mut dsn = format!(
        "{scheme}://{}{host}:{port}/{database}",
        if user.is_empty() {
            String::new()
        } else {
            format!("{}@", urlencode(&user))
        }
    );
    if let Some(mode) = c.get("database.sslmode").filter(|_| postgres) {
        dsn.push_str(&format!("?sslmode={mode}"));
    }
    key(
        "source",
        toml_str(&dsn),
        Some(
            "the password is not carried over: give it with OUTBOXD_SOURCE or a source_file".into(),
        ),
    );
    if let Some(n) = &p.name {
        key(
            "name",
            toml_str(&relay_name(n)),
            Some(format!("from the connector's name {n:?}")),
        );
    }
    if tables.is_empty() {
        not_carried.push((
            "table.include.list".into(),
            "absent: the outbox table is the default `outbox` (set `table` if it is another)"
                .into(),
        ));
    } else {
        // MySQL names tables `db.table`; the DSN's database is the `db`.
        let names: Vec<String> = tables
            .iter()
            .map(|t| {
                if postgres {
                    t.strip_prefix("public.").unwrap_or(t).to_string()
                } else {
                    t.split_once('.').map_or(t.clone(), |(_, n)| n.to_string())
                }
            })
            .collect();
        key("table", toml_list(&names), None);
    }
    if postgres {
        let plugin = c
            .get("plugin.name")
            .map(String::as_str)
            .unwrap_or("pgoutput");
        if plugin != "pgoutput" {
            return Err(refuse(
                format!("plugin.name {plugin}: outboxd reads pgoutput slots, so the connector's {plugin} slot cannot be taken over"),
                "switch the connector to plugin.name=pgoutput first, or start outboxd on a slot of its own with --snapshot since=<time of the last event Debezium published>",
            ));
        }
        key(
            "slot",
            toml_str(c.get("slot.name").map(String::as_str).unwrap_or("debezium")),
            Some("Debezium's slot: outboxd resumes where the connector's last acknowledged position is".into()),
        );
        key(
            "publication",
            toml_str(
                c.get("publication.name")
                    .map(String::as_str)
                    .unwrap_or("dbz_publication"),
            ),
            None,
        );
    }
    key(
        "snapshot",
        toml_str("never"),
        Some(format!(
            "Debezium published the rows already in the table{}: outboxd takes over its position (`outboxd offset set --from-debezium`)",
            c.get("snapshot.mode").map(|m| format!(" (snapshot.mode={m})")).unwrap_or_default()
        )),
    );
    if runtime == Runtime::DebeziumServer {
        if let Some(f) = c.get("offset.storage.file.filename") {
            key(
                "# offset",
                String::new(),
                Some(format!("Debezium Server keeps its position in {f}: outboxd offset set --config <this file> --from-debezium {f}")),
            );
        }
    }

    // The Outbox Event Router.
    let r = &p.router;
    let get = |k: &str, default: &str| r.get(k).cloned().unwrap_or_else(|| default.to_string());
    let mut columns = vec!["debezium".to_string()];
    for (opt, logical, default) in [
        ("table.field.event.id", Column::Id, "id"),
        ("table.field.event.key", Column::AggregateId, "aggregateid"),
        ("table.field.event.type", Column::Topic, "type"),
        ("table.field.event.payload", Column::Payload, "payload"),
    ] {
        let v = get(opt, default);
        if v != default {
            columns.push(format!("{logical}={v}"));
        }
    }
    if let Some(ts) = r.get("table.field.event.timestamp") {
        columns.push(format!("{}={ts}", Column::CreatedAt));
    }
    key("column", toml_list(&columns), None);
    let route_by = get("route.by.field", "aggregatetype");
    let regex = get("route.topic.regex", "(?<routedByValue>.*)");
    let replacement = get("route.topic.replacement", "outbox.event.${routedByValue}");
    if regex != "(?<routedByValue>.*)" {
        not_carried.push((
            "route.topic.regex".into(),
            format!("a regular expression over the routed value ({regex}) is not a template: write --routing-key yourself, e.g. over a column that holds the part you need"),
        ));
    } else if route_by != "aggregatetype" || replacement != "outbox.event.${routedByValue}" {
        let field = if route_by == "aggregatetype" {
            format!("{{{}}}", Column::AggregateType)
        } else {
            format!("{{{route_by}}}")
        };
        let parts: Vec<String> = replacement
            .split("${routedByValue}")
            .map(template_text)
            .collect();
        if parts.iter().any(|p| p.contains('$')) {
            not_carried.push((
                "route.topic.replacement".into(),
                format!("{replacement:?} refers to groups other than ${{routedByValue}}: write --routing-key yourself"),
            ));
        } else {
            key(
                "routing_key",
                toml_str(&parts.join(&field)),
                Some("the topic (Kafka) or routing key (RabbitMQ)".into()),
            );
        }
    }
    let (mut headers, mut envelope, mut partition) = (Vec::new(), Vec::new(), None);
    if let Some(list) = r.get("table.fields.additional.placement") {
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let f: Vec<&str> = entry.split(':').map(str::trim).collect();
            match f.as_slice() {
                [col, "header"] => headers.push(format!("{col}={col}")),
                [col, "header", alias] => headers.push(format!("{col}={alias}")),
                [col, "envelope"] => envelope.push(col.to_string()),
                [col, "envelope", alias] => envelope.push(format!("{col}={alias}")),
                [col, "partition"] | [col, "partition", _] => partition = Some(col.to_string()),
                _ => {
                    return Err(refuse(
                        format!("table.fields.additional.placement: {entry:?} is not column:placement[:alias]"),
                        "fix the connector's configuration (placements are header, envelope and partition)",
                    ))
                }
            }
        }
    }
    if !headers.is_empty() {
        key("header", toml_list(&headers), None);
    }
    if !envelope.is_empty() {
        key(
            "envelope_field",
            toml_list(&envelope),
            Some("the value becomes {\"payload\": …, <alias>: …} as the router (with JsonConverter, schemas off) writes it".into()),
        );
    }
    if let Some(col) = partition {
        key(
            "kafka_partition_column",
            toml_str(&col),
            Some("Kafka sink only".into()),
        );
    }
    if get("route.tombstone.on.empty.payload", "false") == "true" {
        key(
            "kafka_tombstones",
            "true".into(),
            Some("Kafka sink only; RabbitMQ and NATS have no compaction, a NULL payload is a dead record there".into()),
        );
    }
    for (opt, why) in router_notes(r) {
        not_carried.push((format!("{}{opt}", p.router_prefix), why));
    }

    // Debezium Server's sink.
    if runtime == Runtime::DebeziumServer {
        sink_keys(
            &p.sink,
            &mut |k, v, why| keys.push((k.into(), v, why)),
            &mut not_carried,
        )?;
    }
    for k in p.connector.keys() {
        if let Some(why) = connector_option_reason(k) {
            not_carried.push((k.clone(), why.into()));
        }
    }
    for k in p.other.keys() {
        let why = if k.starts_with("debezium.format.") {
            "outboxd writes the value as the payload's bytes and headers as text (SimpleHeaderConverter's form): no Debezium format applies"
        } else if k.contains("transforms") {
            "another transform: outboxd runs only the Outbox Event Router's equivalent"
        } else {
            "not an option outboxd has: it configures Debezium's own runtime"
        };
        not_carried.push((k.clone(), why.into()));
    }

    let mut toml = String::new();
    toml.push_str(&format!(
        "# outboxd configuration translated from {} by `outboxd from-debezium`.\n# Check it with `outboxd check --config <file>`; take the connector's position over with\n# `outboxd offset set --config <file> --from-debezium <its offset>` (docs/migrating-from-debezium.md);\n# then `outboxd run --config <file>`.\n",
        match (&p.name, runtime) {
            (Some(n), Runtime::KafkaConnect) => format!("the Kafka Connect connector {n:?}"),
            (None, Runtime::KafkaConnect) => "a Kafka Connect connector".into(),
            (Some(n), Runtime::DebeziumServer) => format!("the Debezium Server source {n:?}"),
            (None, Runtime::DebeziumServer) => "a Debezium Server configuration".into(),
        }
    ));
    if runtime == Runtime::KafkaConnect {
        toml.push_str("# The sink: Kafka Connect's worker holds the brokers (bootstrap.servers), not the connector.\n# sink = \"kafka://broker:9092\"\n");
    }
    for (k, v, why) in &keys {
        if let Some(why) = why {
            toml.push_str(&format!("# {why}\n"));
        }
        if !k.starts_with('#') {
            toml.push_str(&format!("{k} = {v}\n"));
        }
    }
    if !not_carried.is_empty() {
        toml.push_str("\n# Not carried over:\n");
        for (k, why) in &not_carried {
            toml.push_str(&format!("#   {k}: {why}\n"));
        }
    }
    Ok(Translation { toml, not_carried })
}

/// The router's options this translation does not carry over, with why.
fn router_notes(r: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (opt, v) in r {
        let why = match opt.as_str() {
            "table.field.event.id" | "table.field.event.key" | "table.field.event.type"
            | "table.field.event.payload" | "table.field.event.timestamp" | "route.by.field"
            | "route.topic.regex" | "route.topic.replacement" | "table.fields.additional.placement"
            | "route.tombstone.on.empty.payload" => continue,
            "table.expand.json.payload" if v == "true" => continue,
            "table.expand.json.payload" => "outboxd always publishes a JSON payload as itself (as with true); with JsonConverter and false, consumers got it as a JSON string and must now read the JSON directly",
            "table.field.event.schema.version" => "no schema registry: a `version` column is sent as x-aggregate-version",
            "table.field.additional.missing" => "a column a flag names that the table lacks is refused at start with the fix (no ignore)",
            "table.op.invalid.behavior" | "debezium.op.invalid.behavior" => "updates and deletes of the outbox table are never published, and never stop the relay",
            "table.json.payload.null.behavior" | "table.json.payload.empty.array.behavior" => "the payload is published as it is: its nulls and empty arrays stay",
            "tracing.span.context.field" => "outboxd creates no spans; copy the column into a header instead: header = [\"tracingspancontext=traceparent\"]",
            "tracing.operation.name" | "tracing.with.context.field.only" => "outboxd creates no spans",
            _ => "not an Outbox Event Router option outboxd knows",
        };
        out.push((opt.clone(), why.to_string()));
    }
    out
}

/// Debezium Server's `debezium.sink.*` as `sink` (and the exchange/stream/subject keys).
fn sink_keys(
    s: &BTreeMap<String, String>,
    key: &mut dyn FnMut(&str, String, Option<String>),
    not_carried: &mut Vec<(String, String)>,
) -> Result<(), Error> {
    let ty = s.get("debezium.sink.type").map(|t| t.trim()).unwrap_or("");
    let g = |k: &str| s.get(&format!("debezium.sink.{ty}.{k}")).cloned();
    let mut used: Vec<String> = vec!["debezium.sink.type".into()];
    let mut take = |k: &str| {
        used.push(format!("debezium.sink.{ty}.{k}"));
        g(k)
    };
    match ty {
        "kafka" => {
            let servers = take("producer.bootstrap.servers").unwrap_or_else(|| "localhost:9092".into());
            key("sink", toml_str(&format!("kafka://{servers}")), Some("SASL credentials and TLS are not carried over: give them in OUTBOXD_SINK (kafka://user:password@…, kafkas://) and --sink-ca".into()));
        }
        "rabbitmq" => {
            let host = take("connection.host").unwrap_or_else(|| "localhost".into());
            let port = take("connection.port").unwrap_or_else(|| "5672".into());
            let user = take("connection.username");
            let vhost = take("connection.virtual.host").unwrap_or_default();
            let auth = user.map(|u| format!("{}@", urlencode(&u))).unwrap_or_default();
            let vhost = if vhost.is_empty() || vhost == "/" { String::new() } else { format!("/{}", urlencode(&vhost)) };
            key("sink", toml_str(&format!("amqp://{auth}{host}:{port}{vhost}")), Some("the password is not carried over: give it in OUTBOXD_SINK or sink_file".into()));
            if let Some(x) = take("exchange") {
                key("exchange", toml_str(&x), None);
            }
        }
        "rabbitmqstream" => {
            let host = take("connection.host").unwrap_or_else(|| "localhost".into());
            let port = take("connection.port").unwrap_or_else(|| "5552".into());
            key("sink", toml_str(&format!("rabbitmq-stream://{host}:{port}")), Some("credentials are not carried over: give them in OUTBOXD_SINK".into()));
            if let Some(st) = take("stream") {
                key("stream", toml_str(&st), None);
            }
        }
        "nats-jetstream" => {
            let url = take("url").unwrap_or_else(|| "nats://localhost:4222".into());
            key("sink", toml_str(&url), None);
        }
        other => {
            return Err(refuse(
                format!("debezium.sink.type={other:?}: outboxd publishes to Kafka, RabbitMQ, RabbitMQ streams and NATS JetStream"),
                "translate for one of those sinks, or keep Debezium for this one",
            ))
        }
    }
    for k in s.keys().filter(|k| !used.contains(k)) {
        let why = if k.contains("password") {
            "a secret: give it in OUTBOXD_SINK or sink_file"
        } else {
            "a setting of Debezium Server's sink client: outboxd's sink is configured by its own flags (docs/configuration.md)"
        };
        not_carried.push((k.clone(), why.into()));
    }
    Ok(())
}

fn urlencode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debezium's outbox example, as a Kafka Connect connector.
    const CONNECT: &str = r#"{
      "name": "outbox-connector",
      "config": {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "database.hostname": "order-db",
        "database.port": "5432",
        "database.user": "postgresuser",
        "database.password": "postgrespw",
        "database.dbname": "orderdb",
        "topic.prefix": "dbserver1",
        "schema.include.list": "inventory",
        "table.include.list": "inventory.outboxevent",
        "tombstones.on.delete": "false",
        "slot.name": "orders_slot",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "transforms.outbox.route.topic.replacement": "${routedByValue}.events",
        "transforms.outbox.table.field.event.timestamp": "timestamp",
        "transforms.outbox.table.fields.additional.placement": "type:header:eventType,type:envelope:eventType,shard:partition",
        "transforms.outbox.route.tombstone.on.empty.payload": "true",
        "transforms.outbox.tracing.span.context.field": "tracingspancontext",
        "key.converter": "org.apache.kafka.connect.storage.StringConverter",
        "value.converter": "org.apache.kafka.connect.storage.StringConverter"
      }
    }"#;

    #[test]
    fn a_kafka_connect_postgres_connector() {
        let t = translate(CONNECT).unwrap();
        let toml = &t.toml;
        for line in [
            "source = \"postgres://postgresuser@order-db:5432/orderdb\"",
            "name = \"outbox_connector\"",
            "table = [\"inventory.outboxevent\"]",
            "slot = \"orders_slot\"",
            "publication = \"dbz_publication\"",
            "snapshot = \"never\"",
            "column = [\"debezium\", \"created_at=timestamp\"]",
            "routing_key = \"{aggregate_type}.events\"",
            "header = [\"type=eventType\"]",
            "envelope_field = [\"type=eventType\"]",
            "kafka_partition_column = \"shard\"",
            "kafka_tombstones = true",
        ] {
            assert!(toml.contains(line), "missing {line:?} in:\n{toml}");
        }
        assert!(!toml.contains("postgrespw"), "no password: {toml}");
        let named: Vec<&str> = t.not_carried.iter().map(|(k, _)| k.as_str()).collect();
        for k in [
            "database.password",
            "tasks.max",
            "topic.prefix",
            "schema.include.list",
            "tombstones.on.delete",
            "key.converter",
            "value.converter",
            "transforms.outbox.tracing.span.context.field",
        ] {
            assert!(named.contains(&k), "{k} is named: {named:?}");
        }
        assert!(toml.contains("# Not carried over:"));
    }

    #[test]
    fn a_debezium_server_mariadb_source_with_a_rabbitmq_sink() {
        let props = "\
# Debezium Server
debezium.sink.type=rabbitmq
debezium.sink.rabbitmq.connection.host=rabbit
debezium.sink.rabbitmq.connection.port=5672
debezium.sink.rabbitmq.connection.username=relay
debezium.sink.rabbitmq.connection.password=hunter2-sink
debezium.sink.rabbitmq.exchange=events
debezium.sink.rabbitmq.ackTimeout=3000
debezium.source.connector.class=io.debezium.connector.mariadb.MariaDbConnector
debezium.source.offset.storage.file.filename=data/offsets.dat
debezium.source.database.hostname=db
debezium.source.database.user=debezium
debezium.source.database.password=hunter2-db
debezium.source.database.server.id=184054
debezium.source.topic.prefix=tutorial
debezium.source.table.include.list=shop.outbox
debezium.source.schema.history.internal=io.debezium.storage.file.history.FileSchemaHistory
debezium.transforms=unwrap,outbox
debezium.transforms.unwrap.type=io.debezium.transforms.ExtractNewRecordState
debezium.transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
debezium.transforms.outbox.table.field.event.key=order_id
debezium.transforms.outbox.route.by.field=region
debezium.format.value=json
";
        let t = translate(props).unwrap();
        let toml = &t.toml;
        for line in [
            "source = \"mariadb://debezium@db:3306/shop\"",
            "table = [\"outbox\"]",
            "sink = \"amqp://relay@rabbit:5672\"",
            "exchange = \"events\"",
            "column = [\"debezium\", \"aggregate_id=order_id\"]",
            "routing_key = \"outbox.event.{region}\"",
            "data/offsets.dat",
        ] {
            assert!(toml.contains(line), "missing {line:?} in:\n{toml}");
        }
        assert!(!toml.contains("hunter2"), "no password: {toml}");
        assert!(!toml.contains("slot ="), "no slot on MariaDB: {toml}");
        let named: Vec<&str> = t.not_carried.iter().map(|(k, _)| k.as_str()).collect();
        for k in [
            "database.password",
            "database.server.id",
            "schema.history.internal",
            "debezium.sink.rabbitmq.connection.password",
            "debezium.sink.rabbitmq.ackTimeout",
            "debezium.transforms.unwrap",
            "debezium.format.value",
        ] {
            assert!(named.contains(&k), "{k} is named: {named:?}");
        }
    }

    #[test]
    fn what_cannot_be_translated_is_refused_with_the_reason() {
        let no_router =
            r#"{"connector.class": "io.debezium.connector.postgresql.PostgresConnector"}"#;
        assert!(translate(no_router)
            .unwrap_err()
            .to_string()
            .contains("Outbox Event Router"));
        let sqlserver = CONNECT.replace(
            "io.debezium.connector.postgresql.PostgresConnector",
            "io.debezium.connector.sqlserver.SqlServerConnector",
        );
        assert!(translate(&sqlserver)
            .unwrap_err()
            .to_string()
            .contains("Postgres and MySQL"));
        let decoderbufs = CONNECT.replace(
            "\"slot.name\"",
            "\"plugin.name\": \"decoderbufs\", \"slot.name\"",
        );
        assert!(translate(&decoderbufs)
            .unwrap_err()
            .to_string()
            .contains("pgoutput"));
        let bad = CONNECT.replace("shard:partition", "shard");
        assert!(translate(&bad)
            .unwrap_err()
            .to_string()
            .contains("column:placement"));
        let regex = CONNECT.replace(
            "\"transforms.outbox.route.topic.replacement\"",
            "\"transforms.outbox.route.topic.regex\": \"(?<x>.*)Created\", \"transforms.outbox.route.topic.replacement\"",
        );
        let t = translate(&regex).unwrap();
        assert!(
            t.not_carried.iter().any(|(k, _)| k == "route.topic.regex"),
            "{:?}",
            t.not_carried
        );
        assert!(!t.toml.contains("routing_key ="));
        assert!(translate("just text").is_err());
    }

    #[test]
    fn properties_are_read_as_java_reads_them() {
        let p = properties("a=1\nb : two words \nc three\\\n  more\n# x=y\nd\\=e=f\n");
        assert_eq!(p.get("a").map(String::as_str), Some("1"));
        assert_eq!(p.get("b").map(String::as_str), Some("two words"));
        assert_eq!(p.get("c").map(String::as_str), Some("threemore"));
        assert_eq!(p.get("d=e").map(String::as_str), Some("f"));
        assert!(!p.contains_key("# x"));
    }
}
