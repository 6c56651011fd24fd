//! Partition tests' helpers: an interleaved multi-aggregate workload, the documented partition
//! function recomputed independently of the crate, and the checks every partitioned layout must
//! pass (each aggregate in exactly one queue, the right one, first deliveries in commit order).

use lapin::message::Delivery;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use uuid::Uuid;

/// Kafka's `Utils.murmur2`, written out again as the Java source reads (byte by byte, `int`
/// arithmetic), so the tests do not check the crate against itself.
pub fn kafka_murmur2(data: &[u8]) -> i32 {
    let length = data.len() as i32;
    let seed: i32 = 0x9747b28c_u32 as i32;
    let m: i32 = 0x5bd1e995;
    let r = 24;
    let mut h: i32 = seed ^ length;
    let length4 = length / 4;
    for i in 0..length4 {
        let i4 = (i * 4) as usize;
        let mut k: i32 = (data[i4] as i32 & 0xff)
            .wrapping_add((data[i4 + 1] as i32 & 0xff) << 8)
            .wrapping_add((data[i4 + 2] as i32 & 0xff) << 16)
            .wrapping_add((data[i4 + 3] as i32 & 0xff) << 24);
        k = k.wrapping_mul(m);
        k ^= ((k as u32) >> r) as i32;
        k = k.wrapping_mul(m);
        h = h.wrapping_mul(m);
        h ^= k;
    }
    let base = (length & !3) as usize;
    let rem = length % 4;
    if rem == 3 {
        h ^= (data[base + 2] as i32 & 0xff) << 16;
    }
    if rem >= 2 {
        h ^= (data[base + 1] as i32 & 0xff) << 8;
    }
    if rem >= 1 {
        h ^= data[base] as i32 & 0xff;
        h = h.wrapping_mul(m);
    }
    h ^= ((h as u32) >> 13) as i32;
    h = h.wrapping_mul(m);
    h ^= ((h as u32) >> 15) as i32;
    h
}

/// docs/partitions.md: `murmur2(aggregate id as UTF-8) & 0x7fffffff mod N`.
pub fn partition(aggregate_id: &str, n: u32) -> u32 {
    ((kafka_murmur2(aggregate_id.as_bytes()) & 0x7fff_ffff) as u32) % n
}

/// One written event.
#[derive(Debug, Clone)]
pub struct Written {
    pub id: Uuid,
    pub aggregate: String,
    pub topic: String,
    /// 1, 2, … per aggregate (the row's `version`).
    pub version: i64,
}

/// The aggregate ids of the workload: ASCII ones and, every tenth, one with multi-byte UTF-8.
pub fn aggregate_id(a: usize) -> String {
    if a.is_multiple_of(10) {
        format!("müşteri-🧾-{a}")
    } else {
        format!("customer-{a:04}")
    }
}

/// Writes `aggregates × per_aggregate` events, the aggregates interleaved at random (seeded)
/// across transactions of 1 to 150 events; each aggregate's events keep their own order.
/// `topic` picks the topic of an aggregate's n-th event. Returns the events in commit order.
pub async fn write_interleaved(
    client: &mut tokio_postgres::Client,
    aggregates: usize,
    per_aggregate: usize,
    seed: u64,
    topic: impl Fn(usize, usize) -> String,
) -> Vec<Written> {
    write_interleaved_paced(client, aggregates, per_aggregate, seed, topic, None).await
}

/// [`write_interleaved`] with a pause after every transaction (a producer that keeps writing
/// for a while).
pub async fn write_interleaved_paced(
    client: &mut tokio_postgres::Client,
    aggregates: usize,
    per_aggregate: usize,
    seed: u64,
    topic: impl Fn(usize, usize) -> String,
    pause: Option<std::time::Duration>,
) -> Vec<Written> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Every aggregate's slots, shuffled: the n-th occurrence of an aggregate is its n-th event.
    let mut slots: Vec<usize> = (0..aggregates)
        .flat_map(|a| std::iter::repeat_n(a, per_aggregate))
        .collect();
    slots.shuffle(&mut rng);
    let mut next = vec![0usize; aggregates];
    let mut all = Vec::with_capacity(slots.len());
    for a in slots {
        let n = next[a];
        next[a] += 1;
        all.push(Written {
            id: Uuid::now_v7(),
            aggregate: aggregate_id(a),
            topic: topic(a, n),
            version: n as i64 + 1,
        });
    }
    let mut i = 0;
    while i < all.len() {
        let size = rng.random_range(1..=150).min(all.len() - i);
        let chunk = &all[i..i + size];
        let tx = client.transaction().await.unwrap();
        let ids: Vec<Uuid> = chunk.iter().map(|w| w.id).collect();
        let aggs: Vec<String> = chunk.iter().map(|w| w.aggregate.clone()).collect();
        let topics: Vec<String> = chunk.iter().map(|w| w.topic.clone()).collect();
        let payloads: Vec<String> = chunk
            .iter()
            .map(|w| {
                serde_json::json!({"aggregate": w.aggregate, "version": w.version, "note": "x".repeat(40)})
                    .to_string()
            })
            .collect();
        let versions: Vec<i64> = chunk.iter().map(|w| w.version).collect();
        tx.execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, version)
             SELECT id, agg, topic, payload::json, version
               FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::bigint[])
                    WITH ORDINALITY AS t(id, agg, topic, payload, version, ord)
              ORDER BY ord",
            &[&ids, &aggs, &topics, &payloads, &versions],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        i += size;
        if let Some(p) = pause {
            tokio::time::sleep(p).await;
        }
    }
    all
}

/// Each aggregate's event ids in commit order.
pub fn by_aggregate<'a>(
    events: impl IntoIterator<Item = &'a Written>,
) -> HashMap<String, Vec<Uuid>> {
    let mut m: HashMap<String, Vec<Uuid>> = HashMap::new();
    for w in events {
        m.entry(w.aggregate.clone()).or_default().push(w.id);
    }
    m
}

/// What a layout's queues held.
#[derive(Debug, Default)]
pub struct LayoutReport {
    pub per_queue: Vec<usize>,
    pub duplicates: usize,
}

fn header_string(d: &Delivery, key: &str) -> Option<String> {
    super::amqp::header_str(d, key)
}

/// The checks for a partitioned layout whose queue `k` is `queues[k]` (N = `queues.len()`):
///
/// - every message carries `header` = its queue's index (unless `header` is None, for the
///   consistent-hash exchange), and that is [`partition`] of its `x-aggregate-id`
///   (when `recompute`);
/// - every aggregate is in exactly one queue, duplicates included (no aggregate moved);
/// - per aggregate, the first deliveries are exactly the expected ids in commit order (no
///   loss, no reordering); a duplicate may only repeat an id already delivered.
#[track_caller]
pub fn check_layout(
    what: &str,
    queues: &[Vec<Delivery>],
    header: Option<&str>,
    recompute: bool,
    expected: &HashMap<String, Vec<Uuid>>,
) -> LayoutReport {
    let n = queues.len() as u32;
    let mut home: HashMap<String, usize> = HashMap::new();
    let mut first: HashMap<String, Vec<Uuid>> = HashMap::new();
    let mut seen: HashSet<Uuid> = HashSet::new();
    let mut report = LayoutReport::default();
    for (k, q) in queues.iter().enumerate() {
        report.per_queue.push(q.len());
        for d in q {
            let agg = header_string(d, "x-aggregate-id").expect("x-aggregate-id");
            if let Some(h) = header {
                let got = header_string(d, h)
                    .unwrap_or_else(|| panic!("{what}: a message in queue {k} has no {h}"));
                assert_eq!(
                    got,
                    k.to_string(),
                    "{what}: {h} of a message of {agg:?} in queue {k}"
                );
            }
            if recompute {
                assert_eq!(
                    partition(&agg, n),
                    k as u32,
                    "{what}: {agg:?} is in queue {k}, but murmur2 & 0x7fffffff mod {n} says {}",
                    partition(&agg, n)
                );
            }
            let prev = *home.entry(agg.clone()).or_insert(k);
            assert_eq!(
                prev, k,
                "{what}: aggregate {agg:?} is in queues {prev} and {k}"
            );
            let id = super::amqp::message_id(d);
            if seen.insert(id) {
                first.entry(agg).or_default().push(id);
            } else {
                report.duplicates += 1;
            }
        }
    }
    for (agg, want) in expected {
        let got = first.get(agg).map(Vec::as_slice).unwrap_or(&[]);
        if got != want.as_slice() {
            let g: HashSet<&Uuid> = got.iter().collect();
            let missing = want.iter().filter(|i| !g.contains(i)).count();
            panic!(
                "{what}: aggregate {agg:?}: {} first deliveries, {} expected, {missing} missing; first difference at {:?}",
                got.len(),
                want.len(),
                got.iter().zip(want).position(|(a, b)| a != b)
            );
        }
    }
    let unexpected: Vec<&String> = first
        .keys()
        .filter(|a| !expected.contains_key(*a))
        .collect();
    assert!(
        unexpected.is_empty(),
        "{what}: aggregates that should not be here: {unexpected:?}"
    );
    report
}
