//! Reading back what this relay already wrote to a stream, for the publishing ids (`ids`): the
//! identities of its messages from the stream's end back to the first one older than the
//! event about to go out, and the newest of them (checked against the log the relay reads,
//! `crate::identity::Origin::check_tail`).
//!
//! A stream is read forward only, from an offset. The end is found as the consumer kit finds
//! it: a subscription at the last chunk hands over that chunk's messages together, so a short
//! quiet after them is the end — or, sooner, this relay's message with the producer's last
//! stored publishing id, after which the stream holds nothing of this relay (what other
//! relays keep writing does not hold the read up). Earlier ranges are then read backwards in
//! growing steps, each from its first offset up to the start of the range read before it (the
//! broker starts a subscription at the chunk holding the offset; what comes before it is
//! skipped), until a message of this relay older than the event to publish was seen, offset 0
//! was reached, or [`SCAN_LIMIT`] messages were read. The client's consumer asks for one chunk
//! at a time: the broker sends chunks out of order when it may send several, and the ranges
//! need them in order.
//!
//! A message is this relay's when its `x-outbox-relay` names it: another relay writing the same
//! stream (its own producer, its own ids) is never taken for this one.

use crate::event::SourcePosition;
use crate::identity::{EventKey, ReadBack, RELAY_HEADER, SOURCE_HEADER};
use futures::StreamExt;
use rabbitmq_stream_client::types::{Message, OffsetSpecification, SimpleValue};
use rabbitmq_stream_client::Environment;
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

use super::ids::PUBLISHING_ID_HEADER;

/// Messages read back at most, whoever wrote them: past it, what is older is published again
/// (a duplicate) rather than read for ever.
pub(super) const SCAN_LIMIT: u64 = 250_000;
/// The first backward step, in offsets (then four times as many, and so on).
const FIRST_STEP: u64 = 256;
/// How long an empty stream may stay silent before it is taken for empty.
const FIRST_MESSAGE: Duration = Duration::from_secs(1);
/// The quiet after a chunk that marks the stream's end.
const QUIET: Duration = Duration::from_millis(100);

/// What the read-back found of this relay's messages.
#[derive(Debug, Default)]
pub(super) struct Found {
    pub keys: HashSet<EventKey>,
    /// The relay's newest message read (by publishing id).
    pub newest: Option<(u64, ReadBack)>,
    /// Messages read, whoever wrote them.
    pub read: u64,
    /// Whether a message of this relay older than the event to publish was read: every
    /// message after it has been.
    older: bool,
}

impl Found {
    fn add(&mut self, m: &Message, relay: &str, before: &SourcePosition) {
        self.read += 1;
        let Some(app) = m.application_properties() else {
            return;
        };
        let text = |k: &str| match app.get(k) {
            Some(SimpleValue::String(s)) => Some(s.clone()),
            _ => None,
        };
        if text(RELAY_HEADER).as_deref() != Some(relay) {
            return;
        }
        let message_id = m
            .properties()
            .and_then(|p| p.message_id.as_ref())
            .and_then(|id| <&String>::try_from(id).ok())
            .cloned();
        let (Some(position), Some(message_id)) = (text("x-source-position"), message_id) else {
            return;
        };
        if SourcePosition::parse_stored(&position)
            .is_some_and(|p| p.compare(before) == Some(std::cmp::Ordering::Less))
        {
            self.older = true;
        }
        let r = ReadBack {
            source: text(SOURCE_HEADER),
            position,
            gtid: text("x-source-gtid"),
            message_id,
        };
        self.keys.extend(EventKey::of_record(&r));
        let pid = app.get(PUBLISHING_ID_HEADER).and_then(publishing_id);
        if let Some(pid) = pid {
            if self.newest.as_ref().is_none_or(|(n, _)| pid > *n) {
                self.newest = Some((pid, r));
            }
        }
    }
}

/// A publishing id as written now (`long`, or `int` for small ones) or by earlier versions
/// (`ulong`).
pub(super) fn publishing_id(v: &SimpleValue) -> Option<u64> {
    match v {
        SimpleValue::Ulong(u) => Some(*u),
        SimpleValue::Long(i) => u64::try_from(*i).ok(),
        SimpleValue::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

/// Reads back `relay`'s messages in `stream` (see the module's documentation); `last` is the
/// producer's last stored publishing id. `timeout` bounds each subscription's read.
pub(super) async fn read_back(
    env: &Environment,
    stream: &str,
    relay: &str,
    (before, last): (&SourcePosition, u64),
    timeout: Duration,
) -> Result<Found, String> {
    let mut found = Found::default();
    let scan = Scan {
        relay,
        before,
        last,
    };
    // The last chunk, to the end.
    let Some(mut lowest) = read(env, stream, None, &scan, timeout, &mut found).await? else {
        return Ok(found);
    };
    let mut step = FIRST_STEP;
    while !found.older && lowest > 0 {
        if found.read >= SCAN_LIMIT {
            tracing::warn!(stream, limit = SCAN_LIMIT, "read back that many messages of the stream without reaching what the relay replays: an event written before them is published again");
            break;
        }
        // Not every offset is a message (the broker's tracking entries take offsets too), so a
        // range whose first message comes after its first offset says nothing of what is
        // before it: ranges go back to offset 0 (a stream truncated by retention answers a
        // range before its first message with nothing, at once).
        let from = lowest.saturating_sub(step);
        read(
            env,
            stream,
            Some((from, lowest)),
            &scan,
            timeout,
            &mut found,
        )
        .await?;
        lowest = from;
        step = step.saturating_mul(4);
    }
    Ok(found)
}

/// What a read-back looks for: this relay's messages, back to one older than `before`; the
/// producer's last stored publishing id is `last`.
struct Scan<'a> {
    relay: &'a str,
    before: &'a SourcePosition,
    last: u64,
}

/// One subscription: with `range = Some((from, to))` the messages from `from` up to (not
/// including) `to`, else the last chunk to the stream's end. Returns the first offset
/// delivered at or after `from` (`None`: nothing was delivered, an empty stream).
async fn read(
    env: &Environment,
    stream: &str,
    range: Option<(u64, u64)>,
    scan: &Scan<'_>,
    timeout: Duration,
    found: &mut Found,
) -> Result<Option<u64>, String> {
    let spec = match range {
        Some((from, _)) => OffsetSpecification::Offset(from),
        None => OffsetSpecification::Last,
    };
    let mut consumer = env
        .consumer()
        .offset(spec)
        .build(stream)
        .await
        .map_err(|e| format!("subscribing to {stream:?} to read it back: {e}"))?;
    let deadline = Instant::now() + timeout;
    let mut first = None;
    let outcome = loop {
        let wait = match (range, first) {
            (Some(_), _) => deadline.saturating_duration_since(Instant::now()),
            (None, None) => FIRST_MESSAGE,
            (None, Some(_)) => QUIET,
        };
        let next = tokio::time::timeout(wait, consumer.next()).await;
        let d = match next {
            Ok(Some(Ok(d))) => d,
            Ok(Some(Err(e))) => break Err(format!("reading {stream:?} back: {e}")),
            Ok(None) => break Err(format!("the subscription reading {stream:?} back closed")),
            // The last chunk read to its end (or an empty stream).
            Err(_) if range.is_none() => break Ok(first),
            Err(_) => {
                break Err(format!(
                    "reading {stream:?} back did not reach offset {} within {timeout:?}",
                    range.map(|(_, to)| to).unwrap_or_default()
                ))
            }
        };
        let offset = d.offset();
        if let Some((from, to)) = range {
            // The subscription starts at the chunk holding `from`.
            if offset < from {
                continue;
            }
            if offset >= to {
                break Ok(first);
            }
        }
        first.get_or_insert(offset);
        if Instant::now() > deadline {
            break Err(format!(
                "reading {stream:?} back took longer than {timeout:?}"
            ));
        }
        found.add(d.message(), scan.relay, scan.before);
        // This relay's last message: nothing of its own comes after it.
        let newest = found.newest.as_ref().map(|(pid, _)| *pid);
        if range.is_none() && newest.is_some_and(|pid| pid >= scan.last) {
            break Ok(first);
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), consumer.handle().close()).await;
    outcome
}
