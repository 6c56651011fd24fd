//! What the relay already wrote to a partition: before a link first writes to a partition, the
//! tail of that partition is read back to the first record of this relay older than the event
//! about to go out, and the identities of this relay's records found there (records whose
//! `x-outbox-relay` header is the relay's name; their source, position, GTID and id, see
//! `crate::identity`) are kept. A replayed event whose identity is among them is in Kafka
//! already: the sink acknowledges it without producing it again (docs/kafka.md). Membership,
//! not a high-water mark: an event is skipped only when its own record was read back, so a gap
//! (a record lost while later ones were written) is republished, never skipped; and the
//! identity holds the event's id, so another row at a reused position (a resumed snapshot, a
//! restored database) is never taken for it.
//!
//! The sink picks every record's partition itself — Kafka's Java default partitioner
//! (`sink::partition`: murmur2 of the key, as Debezium's producers place records) — so that it
//! knows which partition to read back.

use super::config::KafkaConfig;
use crate::event::SourcePosition;
use crate::identity::{EventKey, ReadBack, RELAY_HEADER, SOURCE_HEADER};
use crate::sink::SinkError;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// Records read back per step (then four times as many, and so on).
const FIRST_STEP: i64 = 256;

/// The number of partitions of `topic`. Blocking.
pub(crate) fn partitions(cfg: &KafkaConfig, topic: &str) -> Result<i32, SinkError> {
    let n = super::declare::partition_count(cfg, topic)? as i32;
    if n == 0 {
        return Err(SinkError::Rejected(format!(
            "topic {topic} does not exist (or has no partitions): create it, or run with --declare auto"
        )));
    }
    Ok(n)
}

/// This relay's records in the tail of a partition: their identities, and the newest of them.
#[derive(Debug, Default)]
pub(crate) struct Written {
    pub keys: HashSet<EventKey>,
    /// The relay's last record in the partition, with its offset.
    pub newest: Option<(i64, ReadBack)>,
}

impl Written {
    fn add(&mut self, offset: i64, r: ReadBack) {
        self.keys.extend(EventKey::of_record(&r));
        if self.newest.as_ref().is_none_or(|(o, _)| offset > *o) {
            self.newest = Some((offset, r));
        }
    }
}

/// This relay's records in the tail of `topic`/`partition`, read back from the end to the
/// first of its records older than `before` (or the partition's start, or `limit` records).
/// Blocking.
pub(crate) fn written(
    cfg: &KafkaConfig,
    topic: &str,
    partition: i32,
    before: &SourcePosition,
    limit: i64,
) -> Result<Written, SinkError> {
    let (low, high) = reader(cfg)?
        .fetch_watermarks(topic, partition, cfg.op_timeout)
        .map_err(|e| {
            SinkError::Connection(format!("reading the end of {topic}/{partition}: {e}"))
        })?;
    let mut found = Written::default();
    let mut end = high;
    let mut step = FIRST_STEP;
    while end > low {
        let start = (end - step).max(low).max(high - limit);
        if start >= end {
            tracing::warn!(topic, partition, limit, "read back the Kafka sink's --kafka-scan-limit records without reaching what the relay replays: an event written before them is published again");
            break;
        }
        // A reader per step: one reassigned after reaching the end may report that end again
        // before it reads the new range.
        let older = scan(
            &reader(cfg)?,
            cfg,
            topic,
            partition,
            start,
            before,
            &mut found,
        )?;
        if older {
            break;
        }
        end = start;
        step = step.saturating_mul(4);
    }
    Ok(found)
}

fn reader(cfg: &KafkaConfig) -> Result<BaseConsumer<super::logs::Quiet>, SinkError> {
    cfg.client()?
        .set("enable.partition.eof", "true")
        .set("enable.auto.commit", "false")
        .set("allow.auto.create.topics", "false")
        .set("group.id", format!("outboxd-{}-tail", cfg.name))
        .create_with_context(super::logs::Quiet)
        .map_err(|e| SinkError::Connection(format!("creating the tail reader: {e}")))
}

/// Reads from `start` to the partition's end (the end of fetching, not the high watermark the
/// broker reports for `end`: tansu reports the last batch's first offset plus one); adds this
/// relay's records to `found`; whether one of them is older than `before` (everything after
/// it has then been read).
fn scan(
    consumer: &BaseConsumer<super::logs::Quiet>,
    cfg: &KafkaConfig,
    topic: &str,
    partition: i32,
    start: i64,
    before: &SourcePosition,
    found: &mut Written,
) -> Result<bool, SinkError> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(start))
        .map_err(|e| SinkError::Connection(e.to_string()))?;
    consumer
        .assign(&tpl)
        .map_err(|e| SinkError::Connection(format!("reading {topic}/{partition}: {e}")))?;
    let deadline = Instant::now() + cfg.op_timeout;
    let mut older = false;
    loop {
        if Instant::now() > deadline {
            return Err(SinkError::Connection(format!(
                "reading back {topic}/{partition} did not reach its end within {:?}",
                cfg.op_timeout
            )));
        }
        let m = match consumer.poll(Duration::from_millis(200)) {
            None => continue,
            Some(Err(KafkaError::PartitionEOF(_))) => return Ok(older),
            Some(Err(e)) => {
                return Err(SinkError::Connection(format!(
                    "reading back {topic}/{partition}: {e}"
                )))
            }
            Some(Ok(m)) => m,
        };
        let Some(h) = m.headers() else { continue };
        let header = |name: &str| {
            h.iter()
                .find(|x| x.key == name)
                .and_then(|x| x.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        if header(RELAY_HEADER).as_deref() != Some(cfg.name.as_str()) {
            continue;
        }
        let (Some(position), Some(message_id)) = (header("x-source-position"), header("id")) else {
            continue;
        };
        if let Some(pos) = SourcePosition::parse_stored(&position) {
            if pos.compare(before) == Some(std::cmp::Ordering::Less) {
                older = true;
            }
        }
        found.add(
            m.offset(),
            ReadBack {
                source: header(SOURCE_HEADER),
                position,
                gtid: header("x-source-gtid"),
                message_id,
            },
        );
    }
}
