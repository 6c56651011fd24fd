//! A Debezium connector's stored offset, from wherever its runtime keeps it: the offset value
//! itself (a JSON object, as Kafka Connect's offsets topic holds it), a `key<TAB>value` line as
//! `kafka-console-consumer.sh --property print.key=true` prints it (the last line for a key is
//! the newest), or Debezium Server's / the embedded engine's offset file (Kafka's
//! `FileOffsetBackingStore`: a Java-serialized map whose keys and values are JSON bytes).
//!
//! What the offset says, by connector: Postgres `{"lsn_commit", "lsn", "lsn_proc", "txId", …}`
//! — every change up to `lsn` was emitted, every transaction that committed by `lsn_commit`
//! entirely; MySQL/MariaDB `{"file", "pos", "gtids", "event", "row", …}` — restart reading at
//! `file:pos` (a transaction's first event, or a boundary when `event` is absent), skip its
//! first `event` events and then `row` rows of the next rows event.

use crate::Error;
use serde_json::Value;

/// What a Debezium offset says about the log position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DebeziumOffset {
    /// The Postgres connector's offset.
    Postgres {
        /// `lsn_commit`: the end of the last transaction emitted entirely.
        lsn_commit: Option<u64>,
        /// `lsn`: the last change emitted (inside the transaction after `lsn_commit`).
        lsn: Option<u64>,
        /// `txId`: that change's transaction.
        tx_id: Option<u64>,
    },
    /// The MySQL or MariaDB connector's offset.
    Binlog {
        file: String,
        /// A transaction's first event (with `event`), or a transaction boundary.
        pos: u64,
        /// `gtids`: the GTID set of the transactions completed before it.
        gtids: Option<String>,
        /// Events of the transaction at `pos` already handled (its first event included).
        event: u64,
        /// Rows of the next rows event after those already emitted.
        row: u64,
    },
}

const FIX: &str = "give the connector's offset value, e.g. --from-debezium '{\"file\":\"mysql-bin.000003\",\"pos\":154,\"event\":2,\"row\":1}' (Kafka Connect: the last record of the connector's key in its offsets topic; Debezium Server: its offset file), or a file holding it";

fn refuse(problem: impl Into<String>) -> Error {
    Error::config(problem, FIX)
}

/// Every JSON value found in `bytes`, with where it ended: each `{` or `[` that starts a
/// complete JSON value is read (a serialized Java map holds its keys and values as such bytes).
fn embedded_json(bytes: &[u8]) -> Vec<Value> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'{' || bytes[i] == b'[' {
            let mut it = serde_json::Deserializer::from_slice(&bytes[i..]).into_iter::<Value>();
            if let Some(Ok(v)) = it.next() {
                i += it.byte_offset();
                out.push(v);
                continue;
            }
        }
        i += 1;
    }
    out
}

/// Whether a JSON value is a Debezium offset value (not a key, not something else).
fn is_offset(v: &Value) -> bool {
    v.as_object().is_some_and(|o| {
        o.contains_key("lsn")
            || o.contains_key("lsn_commit")
            || (o.contains_key("file") && o.contains_key("pos"))
    })
}

/// The offsets in `input` with the key each was stored under (when the input has keys).
pub(crate) fn offsets_in(input: &[u8]) -> Vec<(Option<Value>, Value)> {
    let values = embedded_json(input);
    let mut out: Vec<(Option<Value>, Value)> = Vec::new();
    let mut key: Option<Value> = None;
    for v in values {
        if is_offset(&v) {
            // A later record for the same key replaces an earlier one (a topic's log, printed).
            out.retain(|(k, _)| k.is_none() || *k != key);
            out.push((key.take(), v));
        } else if v.is_array() {
            key = Some(v);
        }
    }
    out
}

/// Reads the one offset in `input` (an offset value, printed offsets-topic records, or an
/// offset file's bytes).
pub fn parse(input: &[u8]) -> Result<DebeziumOffset, Error> {
    let found = offsets_in(input);
    let value = match found.as_slice() {
        [] => {
            return Err(refuse(
                "no Debezium offset found (an object with \"lsn\"/\"lsn_commit\" for Postgres, or \"file\" and \"pos\" for MySQL/MariaDB)",
            ))
        }
        [(_, v)] => v.clone(),
        many => {
            return Err(refuse(format!(
                "{} connectors' offsets found ({}): which one is this relay's is not for outboxd to guess",
                many.len(),
                many.iter()
                    .map(|(k, _)| k.as_ref().map_or("?".to_string(), Value::to_string))
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    };
    from_value(&value)
}

fn number(o: &serde_json::Map<String, Value>, key: &str) -> Result<Option<u64>, Error> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| refuse(format!("\"{key}\" is {n}, not a position"))),
        // Some stores keep numbers as text.
        Some(Value::String(s)) => s
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| refuse(format!("\"{key}\" is {s:?}, not a position"))),
        Some(other) => Err(refuse(format!("\"{key}\" is {other}, not a position"))),
    }
}

/// An offset value (the JSON object) as what it says.
pub(crate) fn from_value(v: &Value) -> Result<DebeziumOffset, Error> {
    let Some(o) = v.as_object() else {
        return Err(refuse(format!("{v} is not an offset object")));
    };
    let snapshot = match o.get("snapshot") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !matches!(s.to_ascii_lowercase().as_str(), "false" | ""),
        Some(_) => true,
    };
    let completed = matches!(o.get("snapshot_completed"), Some(Value::Bool(true)))
        || matches!(o.get("snapshot_completed"), Some(Value::String(s)) if s == "true");
    if snapshot && !completed {
        return Err(Error::config(
            "the Debezium offset was stored during the connector's initial snapshot: the rows it read from the table are in no log position",
            "let the connector finish its snapshot and stream for a moment, stop it, and take the offset it stores then; or start outboxd with --snapshot instead of an offset",
        ));
    }
    if o.contains_key("lsn") || o.contains_key("lsn_commit") {
        return Ok(DebeziumOffset::Postgres {
            lsn_commit: number(o, "lsn_commit")?,
            lsn: number(o, "lsn")?,
            tx_id: number(o, "txId")?,
        });
    }
    let file = match o.get("file") {
        Some(Value::String(f)) if !f.trim().is_empty() => f.trim().to_string(),
        _ => return Err(refuse("the offset has no binlog \"file\"")),
    };
    let pos = number(o, "pos")?.ok_or_else(|| refuse("the offset has no binlog \"pos\""))?;
    Ok(DebeziumOffset::Binlog {
        file,
        pos,
        gtids: o
            .get("gtids")
            .and_then(Value::as_str)
            .map(|g| g.replace(['\n', '\r'], ""))
            .filter(|g| !g.trim().is_empty()),
        event: number(o, "event")?.unwrap_or(0),
        row: number(o, "row")?.unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_postgres_offset_value() {
        let o = parse(br#"{"transaction_id":null,"lsn_proc":23803184,"messageType":"INSERT","lsn_commit":23801920,"lsn":23803184,"txId":756,"ts_usec":1700000000000000}"#).unwrap();
        assert_eq!(
            o,
            DebeziumOffset::Postgres {
                lsn_commit: Some(23801920),
                lsn: Some(23803184),
                tx_id: Some(756)
            }
        );
    }

    #[test]
    fn a_mysql_offset_from_printed_offsets_topic_records_takes_the_newest() {
        let printed = concat!(
            "[\"inventory-connector\",{\"server\":\"dbserver1\"}]\t{\"ts_sec\":1,\"file\":\"mysql-bin.000003\",\"pos\":154}\n",
            "[\"inventory-connector\",{\"server\":\"dbserver1\"}]\t{\"ts_sec\":2,\"file\":\"mysql-bin.000003\",\"pos\":900,\"gtids\":\"0-1-12\",\"row\":1,\"server_id\":1,\"event\":3}\n",
        );
        assert_eq!(
            parse(printed.as_bytes()).unwrap(),
            DebeziumOffset::Binlog {
                file: "mysql-bin.000003".into(),
                pos: 900,
                gtids: Some("0-1-12".into()),
                event: 3,
                row: 1
            }
        );
    }

    /// Debezium Server's offset file: a Java-serialized `HashMap<byte[], byte[]>` (the bytes
    /// around the JSON are the serialization's, abridged here).
    #[test]
    fn an_offset_file_of_debezium_server() {
        let mut file = vec![0xAC, 0xED, 0x00, 0x05, 0x73, 0x72, 0x00, 0x11];
        file.extend_from_slice(b"java.util.HashMap\x05\x07\xda\xc1\xc3\x16\x60\xd1\x03\x00\x02F\x00\nloadFactorI\x00\tthresholdxp?@\x00\x00\x00\x00\x00\x0cw\x08\x00\x00\x00\x10\x00\x00\x00\x01ur\x00\x02[B\xac\xf3\x17\xf8\x06\x08T\xe0\x02\x00\x00xp\x00\x00\x00\x2b");
        file.extend_from_slice(br#"["kafka",{"server":"tutorial"}]"#);
        file.extend_from_slice(b"uq\x00~\x00\x02\x00\x00\x00\x50");
        file.extend_from_slice(
            br#"{"lsn_proc":37094192,"lsn_commit":37094192,"lsn":37094192,"txId":780,"ts_usec":1}"#,
        );
        file.extend_from_slice(b"x");
        assert_eq!(
            parse(&file).unwrap(),
            DebeziumOffset::Postgres {
                lsn_commit: Some(37094192),
                lsn: Some(37094192),
                tx_id: Some(780)
            }
        );
    }

    #[test]
    fn refusals_say_why() {
        let e = parse(b"hello").unwrap_err().to_string();
        assert!(e.contains("no Debezium offset"), "{e}");
        let two = concat!(
            "[\"a\",{\"server\":\"x\"}] {\"file\":\"b.000001\",\"pos\":4}\n",
            "[\"b\",{\"server\":\"y\"}] {\"file\":\"b.000001\",\"pos\":8}\n"
        );
        let e = parse(two.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("2 connectors"), "{e}");
        let e = parse(br#"{"file":"b.000001","pos":4,"snapshot":true}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("snapshot"), "{e}");
        let e = parse(br#"{"file":"b.000001","pos":-4}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a position"), "{e}");
        assert!(parse(br#"{"file":"b.000001","pos":"12","event":"2"}"#).is_ok());
    }
}
