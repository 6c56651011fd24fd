//! Partitions (docs/partitions.md, `--partitions N`): which of N queues an aggregate's events go to.
//!
//! The partition is Kafka's default partitioner applied to the aggregate id, so a consumer in
//! any language can recompute it from the `x-aggregate-id` header:
//!
//! ```text
//! partition = (murmur2(utf8(aggregate_id)) & 0x7fffffff) % N
//! ```
//!
//! where `murmur2` is Kafka's `Utils.murmur2` (MurmurHash2, 32 bit, seed `0x9747b28c`, little
//! endian 4-byte blocks, the tail folded in before the final mix) and `& 0x7fffffff` is Kafka's
//! `Utils.toPositive` (not `abs`). It depends on nothing but the id and N, never on the broker's
//! state, so a broker restart cannot move an aggregate; changing N moves most of them.
//!
//! The relay sends the partition as the header `x-partition` (for its own `--partitions N`)
//! and as `x-partition-<N>` for its own N and every N in `--group-partitions` (for consumer
//! groups declared with `outboxd topology --group NAME --partitions N`), each a decimal string.
//! A headers exchange routes on them with `x-match = all-with-x`: RabbitMQ's plain `all`
//! ignores every binding argument that starts with `x-`, so it would send every message to
//! every partition queue.

#[cfg(feature = "rabbitmq")]
use lapin::types::{AMQPValue, ShortString};

/// Most partitions a layout may have (queues per layout).
pub const MAX_PARTITIONS: u32 = 1024;
/// Most distinct partition counts the relay computes headers for (`--group-partitions`).
pub(crate) const MAX_GROUP_COUNTS: usize = 16;
/// The relay's own partition header (docs/message-format.md).
pub const PARTITION_HEADER: &str = "x-partition";

/// Kafka's `Utils.murmur2`: MurmurHash2 (32 bit) with seed `0x9747b28c`, as Java computes it
/// (wrapping `int` arithmetic, unsigned shifts).
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ (len as u32);
    let mut blocks = data.chunks_exact(4);
    for b in &mut blocks {
        let mut k = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = blocks.remainder();
    // Java's switch falls through: 3 → 2 → 1.
    if tail.len() >= 3 {
        h ^= (tail[2] as u32) << 16;
    }
    if tail.len() >= 2 {
        h ^= (tail[1] as u32) << 8;
    }
    if !tail.is_empty() {
        h ^= tail[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// Kafka's `Utils.toPositive`: clears the sign bit (so `i32::MIN` becomes 0, unlike `abs`).
pub(crate) fn to_positive(n: i32) -> u32 {
    (n & 0x7fff_ffff) as u32
}

/// The partition of an aggregate among `n` (`n` ≥ 1): Kafka's default partitioner.
pub fn partition_of(aggregate_id: &str, n: u32) -> u32 {
    debug_assert!(n >= 1);
    to_positive(murmur2(aggregate_id.as_bytes())) % n.max(1)
}

/// `x-partition-<n>`: the header a consumer group with `n` partitions routes on.
pub fn group_header(n: u32) -> String {
    format!("{PARTITION_HEADER}-{n}")
}

/// How partition queues are fed (`--partition-routing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PartitionRouting {
    /// The relay computes the partition (murmur2, as Kafka) and sends it as a header; a
    /// headers exchange routes on it. Placement never depends on the broker's state.
    #[default]
    Headers,
    /// RabbitMQ's consistent-hash exchange (plugin `rabbitmq_consistent_hash_exchange`)
    /// hashes `x-aggregate-id`. Its ring can move keys when the broker restarts.
    ConsistentHash,
}

/// `x-queue-type` of partition queues (`--queue-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    #[default]
    Classic,
    Quorum,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// The partition settings as given (`--partitions`, `--group-partitions`, `--queue-type`,
/// `--partition-routing`), before [`PartitionSpec::validate`] checks them.
#[derive(Debug, Clone, Default)]
pub struct PartitionSpec {
    pub partitions: u32,
    pub group_partitions: Vec<u32>,
    pub queue_type: QueueType,
    pub partition_routing: PartitionRouting,
}

/// Validated partition settings of the relay.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Partitioning {
    /// The relay's own partition count (0 = off).
    pub partitions: u32,
    /// Counts with an `x-partition-<N>` header: the relay's own N (when on) and
    /// `--group-partitions`, sorted, without duplicates.
    pub(crate) header_counts: Vec<u32>,
    pub queue_type: QueueType,
    pub routing: PartitionRouting,
}

fn check_count(n: u32, flag: &str) -> Result<(), crate::Error> {
    if n == 0 || n > MAX_PARTITIONS {
        return Err(crate::Error::config(
            format!("{flag} {n} is out of range"),
            format!("use 1 to {MAX_PARTITIONS} partitions, e.g. {flag} 4"),
        ));
    }
    Ok(())
}

impl PartitionSpec {
    pub fn validate(&self) -> Result<Partitioning, crate::Error> {
        if self.partitions > MAX_PARTITIONS {
            check_count(self.partitions, "--partitions")?;
        }
        let mut counts = Vec::new();
        for &n in &self.group_partitions {
            check_count(n, "--group-partitions")?;
            counts.push(n);
        }
        if self.partitions > 0 {
            counts.push(self.partitions);
        }
        counts.sort_unstable();
        counts.dedup();
        if counts.len() > MAX_GROUP_COUNTS {
            return Err(crate::Error::config(
                format!("--group-partitions names {} partition counts", counts.len()),
                format!("use at most {MAX_GROUP_COUNTS} (each adds a header to every message)"),
            ));
        }
        if self.partition_routing == PartitionRouting::ConsistentHash {
            if self.partitions == 0 {
                return Err(crate::Error::config(
                    "--partition-routing consistent-hash needs --partitions",
                    "add --partitions N, or drop --partition-routing",
                ));
            }
            if !self.group_partitions.is_empty() {
                return Err(crate::Error::config(
                    "--group-partitions is for headers routing: with consistent-hash the broker hashes x-aggregate-id and groups need no header",
                    "drop --group-partitions, or use --partition-routing headers",
                ));
            }
            // The broker places aggregates: the relay computes and sends no partition.
            counts.clear();
        }
        Ok(Partitioning {
            partitions: self.partitions,
            header_counts: counts,
            queue_type: self.queue_type,
            routing: self.partition_routing,
        })
    }
}

impl Partitioning {
    /// Whether the relay computes partition headers at all.
    pub(crate) fn sends_headers(&self) -> bool {
        !self.header_counts.is_empty()
    }

    /// The partition headers of one event: `x-partition` for the relay's own N (headers
    /// routing), and `x-partition-<N>` for every count in [`Partitioning::header_counts`].
    /// The hash is computed once.
    #[cfg(feature = "rabbitmq")]
    pub fn headers(&self, aggregate_id: &str) -> Vec<(ShortString, AMQPValue)> {
        if self.header_counts.is_empty() {
            return Vec::new();
        }
        let hash = to_positive(murmur2(aggregate_id.as_bytes()));
        let value = |n: u32| AMQPValue::LongString((hash % n).to_string().into());
        let mut out = Vec::with_capacity(self.header_counts.len() + 1);
        if self.partitions > 0 && self.routing == PartitionRouting::Headers {
            out.push((PARTITION_HEADER.into(), value(self.partitions)));
        }
        for &n in &self.header_counts {
            out.push((group_header(n).into(), value(n)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kafka's `UtilsTest.testMurmur2` (clients/src/test/java/org/apache/kafka/common/utils).
    #[test]
    fn murmur2_matches_kafkas_test_vectors() {
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ];
        for (input, expected) in cases {
            assert_eq!(
                murmur2(input),
                expected,
                "murmur2({:?})",
                String::from_utf8_lossy(input)
            );
        }
    }

    #[test]
    fn to_positive_clears_the_sign_bit_like_kafka() {
        assert_eq!(
            to_positive(-973_932_308),
            (-973_932_308i32 & 0x7fff_ffff) as u32
        );
        assert_eq!(to_positive(i32::MIN), 0);
        assert_eq!(to_positive(-1), 0x7fff_ffff);
        assert_eq!(to_positive(5), 5);
        // "21" hashes negative: toPositive, not abs.
        assert_eq!(to_positive(murmur2(b"21")), 1_173_551_340);
        assert_eq!(partition_of("21", 1000), 340);
    }

    #[test]
    fn every_tail_length_and_non_ascii_ids() {
        // The tail handling for 0–3 remaining bytes, and UTF-8 bytes above 0x7f.
        for id in ["", "a", "ab", "abc", "abcd", "Ayşe", "🧾", "agg-199"] {
            let p = partition_of(id, 4);
            assert!(p < 4);
            assert_eq!(p, partition_of(id, 4), "deterministic");
        }
    }

    #[test]
    #[cfg(feature = "rabbitmq")]
    fn headers_for_own_and_group_counts() {
        let p = PartitionSpec {
            partitions: 4,
            group_partitions: vec![8, 4, 3],
            ..Default::default()
        }
        .validate()
        .unwrap();
        assert_eq!(p.header_counts, vec![3, 4, 8]);
        let h = p.headers("agg-7");
        let get = |k: &str| {
            h.iter()
                .find(|(n, _)| n.as_str() == k)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        let hash = to_positive(murmur2(b"agg-7"));
        assert_eq!(
            get("x-partition"),
            AMQPValue::LongString((hash % 4).to_string().into())
        );
        assert_eq!(get("x-partition-4"), get("x-partition"));
        assert_eq!(
            get("x-partition-3"),
            AMQPValue::LongString((hash % 3).to_string().into())
        );
        assert_eq!(
            get("x-partition-8"),
            AMQPValue::LongString((hash % 8).to_string().into())
        );
        assert_eq!(h.len(), 4);

        let off = PartitionSpec::default().validate().unwrap();
        assert!(off.headers("agg-7").is_empty());
        assert!(!off.sends_headers());

        let groups_only = PartitionSpec {
            group_partitions: vec![5],
            ..Default::default()
        }
        .validate()
        .unwrap();
        let h = groups_only.headers("agg-7");
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].0.as_str(), "x-partition-5");

        let ch = PartitionSpec {
            partitions: 4,
            partition_routing: PartitionRouting::ConsistentHash,
            ..Default::default()
        }
        .validate()
        .unwrap();
        assert!(
            ch.headers("agg-7").is_empty(),
            "the broker places aggregates"
        );
    }

    #[test]
    fn invalid_counts_are_refused() {
        let bad = |partitions, groups: Vec<u32>, routing| {
            PartitionSpec {
                partitions,
                group_partitions: groups,
                queue_type: QueueType::Classic,
                partition_routing: routing,
            }
            .validate()
            .is_err()
        };
        assert!(bad(MAX_PARTITIONS + 1, vec![], PartitionRouting::Headers));
        assert!(bad(0, vec![0], PartitionRouting::Headers));
        assert!(bad(0, (1..=17).collect(), PartitionRouting::Headers));
        assert!(bad(0, vec![], PartitionRouting::ConsistentHash));
        assert!(bad(4, vec![8], PartitionRouting::ConsistentHash));
        assert!(!bad(4, vec![8], PartitionRouting::Headers));
    }
}
