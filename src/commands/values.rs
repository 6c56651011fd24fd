//! The command-line names of the library's option enums. The enums live with the code they
//! steer (the sink, the partitioner, the pipeline, the consumer kit) and know nothing of
//! clap; this file says how each variant is spelled after its flag and the one-line help
//! `--help` prints for it, so the command line stays the only place clap is imported. Also the
//! size parser of every byte-count flag (`parse_bytes`), which the sinks' own flags share.

use crate::consumer::runner::{OnPoison, StreamStart};
use crate::outbox::Mode;
use crate::pipeline::PositionLostPolicy;
use crate::sink::format::BodyFormat;
use crate::sink::partition::{PartitionRouting, QueueType};
use crate::sink::DeclareMode;
use crate::source::mysql::xa_pin::XaExpired;
use clap::builder::PossibleValue;

/// `impl clap::ValueEnum` for a library enum: each variant with its spelling and, where the
/// variants are not self-explanatory, its help line.
macro_rules! value_enum {
    ($ty:ident { $($variant:ident => $name:literal $(: $help:literal)?),+ $(,)? }) => {
        impl clap::ValueEnum for $ty {
            fn value_variants<'a>() -> &'a [Self] {
                &[$($ty::$variant),+]
            }

            fn to_possible_value(&self) -> Option<PossibleValue> {
                Some(match self {
                    $($ty::$variant => PossibleValue::new($name)$(.help($help))?,)+
                })
            }
        }
    };
}

value_enum!(Mode {
    Cdc => "cdc",
    Poll => "poll",
});

value_enum!(DeclareMode {
    Auto => "auto": "Declare exchanges, queues and the binding (idempotent; needs configure permission)",
    Passive => "passive": "Only check that they exist (for users without configure permission)",
    Off => "off": "Assume they exist; check nothing",
});

value_enum!(PartitionRouting {
    Headers => "headers": "The relay computes the partition (murmur2, as Kafka) and sends it as a header; a headers exchange routes on it. Placement never depends on the broker's state",
    ConsistentHash => "consistent-hash": "RabbitMQ's consistent-hash exchange (plugin `rabbitmq_consistent_hash_exchange`) hashes `x-aggregate-id`. Its ring can move keys when the broker restarts",
});

value_enum!(QueueType {
    Classic => "classic",
    Quorum => "quorum",
});

value_enum!(BodyFormat {
    Raw => "raw": "The payload column byte for byte (content type `application/json`, or the payload's own content type)",
    Envelope => "envelope": "A JSON object: id, aggregate, topic, payload, created_at, position",
    Cloudevents => "cloudevents": "A CloudEvents 1.0 event in structured mode (`application/cloudevents+json`)",
    CloudeventsBinary => "cloudevents-binary": "CloudEvents binary mode: the payload as body, the attributes as `cloudEvents:*` headers",
});

value_enum!(PositionLostPolicy {
    Fail => "fail": "Stop with exit 3 and the fix",
    Poll => "poll": "Open a fresh position and publish again, from the table, every row that may have been committed after the last confirmed one; then stream",
});

value_enum!(XaExpired {
    Stop => "stop": "Stop with the XA COMMIT / XA ROLLBACK that end it; the stored position stays before its prepare",
    Release => "release": "Move the stored position past it and log its XID: its rows are published only if it commits while this relay runs",
});

value_enum!(OnPoison {
    Halt => "halt": "Stop the consumer, leaving the message in the queue (an operator fixes the cause)",
    Park => "park": "Move it to `<queue>.dead` with the error in headers, then ack it",
    Skip => "skip": "Log it and ack it: its effect never happens",
});

value_enum!(StreamStart {
    First => "first": "The first message the stream still holds",
    Last => "last": "The last chunk the stream holds",
    Next => "next": "Only messages published after the consumer subscribed",
});

/// `16MiB`, `512KiB`, `1GiB`, `10MB`, `4096` (bytes).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 16MiB or 4096"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, kB, MB, GB)"
            ))
        }
    };
    n.checked_mul(mult)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{s:?} is out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    /// Every variant has a spelling, and parsing it gives the variant back.
    fn round_trips<T: ValueEnum + PartialEq + std::fmt::Debug>() {
        for v in T::value_variants() {
            let name = v.to_possible_value().unwrap().get_name().to_string();
            assert_eq!(&T::from_str(&name, false).unwrap(), v, "{name}");
        }
    }

    #[test]
    fn every_value_parses_back_to_its_variant() {
        round_trips::<Mode>();
        round_trips::<DeclareMode>();
        round_trips::<PartitionRouting>();
        round_trips::<QueueType>();
        round_trips::<BodyFormat>();
        round_trips::<PositionLostPolicy>();
        round_trips::<OnPoison>();
        round_trips::<StreamStart>();
        round_trips::<XaExpired>();
        assert_eq!(
            BodyFormat::from_str("cloudevents-binary", false).unwrap(),
            BodyFormat::CloudeventsBinary
        );
        assert!(QueueType::from_str("stream", false).is_err());
    }
}
