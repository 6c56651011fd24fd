//! The Postgres assembler fed synthetic pgoutput: every reconnect case (before a begin, in the
//! middle of a transaction, after its commit went out, a commit sent twice), an insert into
//! another table, and idle keepalives.

use super::*;
use crate::outbox::{ColumnMap, TableName};
use crate::source::postgres::pgoutput::{Column, Relation, Value};
use bytes::Bytes;

const UUID_OID: u32 = 2950;
const TEXT_OID: u32 = 25;

fn relation(id: u32, name: &str) -> Input {
    let col = |name: &str, type_oid| Column {
        flags: 0,
        name: name.into(),
        type_oid,
        type_modifier: -1,
    };
    Input::Message(pgoutput::Message::Relation(Relation {
        id,
        namespace: "public".into(),
        name: name.into(),
        replica_identity: b'd',
        columns: vec![
            col("id", UUID_OID),
            col("aggregate_id", TEXT_OID),
            col("topic", TEXT_OID),
            col("payload", TEXT_OID),
        ],
    }))
}

fn insert(relation_id: u32, n: u32) -> Input {
    let text = |s: String| Value::Text(Bytes::from(s));
    Input::Message(pgoutput::Message::Insert {
        relation_id,
        tuple: vec![
            text(format!("0190b1c4-7a8e-7cc4-9c1e-{n:012x}")),
            text(format!("a{n}")),
            text("order.created".into()),
            text("{}".into()),
        ],
    })
}

fn begin(final_lsn: u64) -> Input {
    Input::Begin {
        final_lsn,
        // 2026-01-01 in pgoutput time (microseconds since 2000-01-01).
        commit_time_micros: 820_454_400_000_000,
    }
}

fn commit(end_lsn: u64) -> Input {
    Input::Commit { end_lsn }
}

fn assembler() -> Assembler {
    let mut a = Assembler::new(RowMapper::new(
        TableName::parse("outbox").unwrap(),
        ColumnMap::default(),
    ));
    a.feed(relation(1, "outbox"), 0).unwrap();
    a.feed(relation(2, "other"), 0).unwrap();
    a
}

/// What came out, in a form the tests compare: `e<aggregate id>` or `c<end lsn>` / `i<lsn>`.
fn feed(a: &mut Assembler, inputs: Vec<Input>) -> Vec<String> {
    inputs
        .into_iter()
        .filter_map(|i| a.feed(i, 0).unwrap())
        .map(|o| match o {
            Output::Event(e) => format!("e{}", e.aggregate_id),
            Output::Committed {
                checkpoint: Checkpoint::Lsn(l),
                end,
                commit_at,
                gap,
            } => {
                assert_eq!(end, Checkpoint::Lsn(l));
                assert!(commit_at.is_some(), "the commit time is noted");
                let _ = gap;
                format!("c{l}")
            }
            Output::Checkpoint(Checkpoint::Lsn(l)) => format!("i{l}"),
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

fn txn(final_lsn: u64, rows: std::ops::Range<u32>, end: Option<u64>) -> Vec<Input> {
    let mut v = vec![begin(final_lsn)];
    v.extend(rows.map(|n| insert(1, n)));
    v.extend(end.map(commit));
    v
}

#[test]
fn a_transaction_goes_out_with_its_checkpoint_and_other_tables_are_skipped() {
    let mut a = assembler();
    let mut inputs = txn(100, 0..2, None);
    inputs.push(insert(2, 9));
    inputs.push(commit(110));
    assert_eq!(feed(&mut a, inputs), ["ea0", "ea1", "c110"]);
}

#[test]
fn a_reconnect_before_a_begin_repeats_nothing() {
    let mut a = assembler();
    assert_eq!(feed(&mut a, txn(100, 0..1, Some(110))), ["ea0", "c110"]);
    // The stream broke between transactions and resumes at the next one.
    a.restart();
    assert_eq!(
        feed(&mut a, txn(200, 1..3, Some(210))),
        ["ea1", "ea2", "c210"]
    );
}

#[test]
fn a_reconnect_inside_a_transaction_sends_only_the_rest_of_it() {
    let mut a = assembler();
    assert_eq!(feed(&mut a, txn(100, 0..2, None)), ["ea0", "ea1"]);
    // Broken before the commit: the server sends the whole transaction again.
    a.restart();
    assert!(!a.in_txn());
    assert_eq!(
        feed(&mut a, txn(100, 0..4, Some(110))),
        ["ea2", "ea3", "c110"]
    );
    // Broken again inside the repeat, after its first new row: the rest only.
    let mut b = assembler();
    assert_eq!(feed(&mut b, txn(100, 0..2, None)), ["ea0", "ea1"]);
    b.restart();
    assert_eq!(feed(&mut b, txn(100, 0..3, None)), ["ea2"]);
    b.restart();
    assert_eq!(feed(&mut b, txn(100, 0..4, Some(110))), ["ea3", "c110"]);
}

#[test]
fn a_reconnect_after_a_forwarded_commit_skips_that_transaction_whole() {
    let mut a = assembler();
    assert_eq!(
        feed(&mut a, txn(100, 0..2, Some(110))),
        ["ea0", "ea1", "c110"]
    );
    // The slot was not confirmed past it yet: the server sends it again, then the next one.
    a.restart();
    let mut again = txn(100, 0..2, Some(110));
    again.extend(txn(200, 2..3, Some(210)));
    assert_eq!(feed(&mut a, again), ["ea2", "c210"]);
}

#[test]
fn a_commit_sent_twice_goes_out_once() {
    let mut a = assembler();
    let mut inputs = txn(100, 0..1, Some(110));
    // A second commit with no open transaction (a repeat the library let through).
    inputs.push(commit(110));
    assert_eq!(feed(&mut a, inputs), ["ea0", "c110"]);
    // And the transaction sent again on the same stream: skipped whole.
    assert_eq!(
        feed(&mut a, txn(100, 0..1, Some(110))),
        Vec::<String>::new()
    );
}

#[test]
fn an_insert_outside_a_transaction_is_an_error() {
    let mut a = assembler();
    let e = a.feed(insert(1, 0), 0).unwrap_err();
    assert!(e.to_string().contains("outside a transaction"), "{e}");
}

#[test]
fn an_idle_keepalive_is_a_checkpoint_once_and_never_inside_a_transaction() {
    let mut a = assembler();
    let t0 = Instant::now();
    // Each keepalive a full interval after the one before: the pace is not what is tested.
    let at = |n: u32| t0 + IDLE_CHECKPOINT_INTERVAL * n;
    let keep = |w, n| Input::KeepAlive {
        wal_end: w,
        at: at(n),
    };
    assert_eq!(
        a.feed(keep(50, 0), 60).unwrap().map(|_| ()),
        None,
        "behind the acknowledgement"
    );
    assert_eq!(
        feed(&mut a, vec![keep(500, 1), keep(500, 2), keep(600, 3)]),
        ["i500", "i600"]
    );
    assert_eq!(
        feed(&mut a, vec![begin(700), keep(800, 4)]),
        Vec::<String>::new()
    );
    assert_eq!(
        feed(&mut a, vec![commit(710), keep(900, 5)]),
        ["c710", "i900"]
    );
}

/// The relay's own store writes WAL, whose keepalive would be the next checkpoint, whose store
/// writes WAL: idle checkpoints come at most once per interval, whatever the keepalives.
#[test]
fn idle_checkpoints_come_at_most_once_per_interval() {
    let mut a = assembler();
    let t0 = Instant::now();
    let keep = |w, after: Duration| Input::KeepAlive {
        wal_end: w,
        at: t0 + after,
    };
    let ms = Duration::from_millis;
    assert_eq!(feed(&mut a, vec![keep(100, ms(0))]), ["i100"]);
    // A keepalive every 100 ms (what a store every 100 ms brought): none of them.
    let soon: Vec<Input> = (1..50).map(|i| keep(100 + i, ms(100 * i))).collect();
    assert_eq!(feed(&mut a, soon), Vec::<String>::new());
    // The first one a whole interval after the last checkpoint, with the newest end.
    assert_eq!(
        feed(
            &mut a,
            vec![
                keep(200, IDLE_CHECKPOINT_INTERVAL),
                keep(300, IDLE_CHECKPOINT_INTERVAL + ms(1))
            ]
        ),
        ["i200"]
    );
    // Event transactions keep their checkpoints in between.
    assert_eq!(
        feed(
            &mut a,
            vec![
                begin(400),
                commit(410),
                keep(500, IDLE_CHECKPOINT_INTERVAL + ms(2))
            ]
        ),
        ["c410"]
    );
}
