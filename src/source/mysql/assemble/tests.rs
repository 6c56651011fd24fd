//! The binlog assembler fed decoder steps (synthetic, and decoded from the binlog fixtures in
//! `tests/fixtures/mysql-binlogs`): every reconnect case (before a begin, inside a held or a
//! streamed transaction, after a forwarded commit, a commit without its transaction), the
//! large-transaction scan and re-read, rollbacks to a savepoint, and the idle checkpoints.

use super::*;
use crate::dsn::SourceDsn;
use crate::event::SourcePosition;
use crate::source::mysql::rows::SourceTz;

fn table(database: &str) -> OutboxTable {
    OutboxTable {
        database: database.into(),
        table: "outbox".into(),
        columns: Default::default(),
        tz: SourceTz::Utc,
        label: None,
    }
}

fn cfg(txn_buffer_bytes: usize) -> MySqlSourceConfig {
    let SourceDsn::Mysql(dsn) = SourceDsn::parse("mysql://u@localhost:3306/app").unwrap() else {
        panic!("a MySQL DSN")
    };
    MySqlSourceConfig {
        dsn,
        name: "asm".into(),
        tables: vec![table("app")],
        server_id: 1,
        heartbeat: Duration::from_secs(1),
        read_timeout: Duration::from_secs(5),
        txn_buffer_bytes,
        max_payload_bytes: crate::source::mysql::decode::DEFAULT_PAYLOAD_LIMIT,
        mariadb: false,
        xa_prepare_limit: Duration::from_secs(3600),
        xa_prepare_expired: XaExpired::Stop,
        sync_replicas: Vec::new(),
    }
}

fn start() -> Resume {
    Resume {
        file: "binlog.000001".into(),
        pos: 4,
        gtid: None,
        mysql_gtids: None,
        by_position: true,
    }
}

fn assembler(txn_buffer_bytes: usize, now: Instant) -> Assembler {
    let c = cfg(txn_buffer_bytes);
    Assembler::new(c.tables.clone(), start(), &c, now)
}

/// Row `index` of the transaction, aggregate id `a<n>`.
fn row(n: u32, index: u32) -> OutboxEvent {
    let mut e = crate::sink::test_event();
    e.aggregate_id = format!("a{n}");
    e.position = SourcePosition::Binlog {
        file: "binlog.000001".into(),
        end_pos: 0,
        index,
    };
    e
}

fn begin(pos: u64) -> Step {
    Step::Begin {
        file: "binlog.000001".into(),
        pos,
    }
}

/// Rows `ns` of a transaction, their indexes from `first`.
fn rows(ns: std::ops::Range<u32>, first: u32) -> Step {
    Step::Rows(
        ns.enumerate()
            .map(|(i, n)| row(n, first + i as u32))
            .collect(),
    )
}

/// A whole transaction from `start` to `end` with rows `ns`.
fn txn(start: u64, ns: std::ops::Range<u32>, end: u64) -> Vec<Step> {
    vec![begin(start), rows(ns, 0), commit(start, end, false)]
}

fn commit(start: u64, end: u64, own: bool) -> Step {
    Step::Commit {
        start_file: "binlog.000001".into(),
        start_pos: start,
        checkpoint: Checkpoint::Binlog {
            file: "binlog.000001".into(),
            pos: end,
            gtid_state: None,
        },
        own,
        committed_at: chrono::DateTime::from_timestamp(1_800_000_000, 0),
    }
}

/// Feeds steps; what came out as `e<aggregate id>@<end>`, `c<end>` (a transaction's
/// checkpoint) or `i<end>` (an idle one), and whether a re-read was asked for.
fn feed(a: &mut Assembler, steps: Vec<Step>, now: Instant) -> (Vec<String>, bool) {
    let mut out = Vec::new();
    let mut reread = false;
    for s in steps {
        reread |= a.step(s, now, &mut out).unwrap() == Next::Reread;
    }
    let shown = out
        .into_iter()
        .map(|o| match o {
            Output::Event(e) => match &e.position {
                SourcePosition::Binlog { end_pos, .. } => format!("e{}@{end_pos}", e.aggregate_id),
                p => panic!("{p:?}"),
            },
            Output::Committed {
                checkpoint,
                end,
                commit_at,
                gap,
            } => {
                assert_eq!(checkpoint, end, "no XA prepare holds it back");
                assert!(
                    commit_at.is_some() && gap.is_some(),
                    "commit time and gap noted"
                );
                format!("c{}", pos_of(&end))
            }
            Output::Checkpoint(cp) => format!("i{}", pos_of(&cp)),
        })
        .collect();
    (shown, reread)
}

fn pos_of(cp: &Checkpoint) -> u64 {
    match cp {
        Checkpoint::Binlog { pos, .. } => *pos,
        other => panic!("{other:?}"),
    }
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_held_transaction_goes_out_at_its_commit_with_its_end_position() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    let (got, _) = feed(&mut a, vec![begin(4), rows(0..1, 0)], now);
    assert!(got.is_empty(), "held until the commit: {got:?}");
    let (got, _) = feed(&mut a, vec![rows(1..2, 1), commit(4, 300, false)], now);
    assert_eq!(got, strs(&["ea0@300", "ea1@300", "c300"]));
    assert_eq!(a.resume().pos, 300, "the next stream starts after it");
}

#[test]
fn a_reconnect_before_a_begin_repeats_nothing() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    feed(&mut a, txn(4, 0..1, 300), now);
    a.restart();
    let (got, _) = feed(&mut a, txn(300, 1..2, 500), now);
    assert_eq!(got, strs(&["ea1@500", "c500"]));
}

#[test]
fn a_reconnect_inside_a_held_transaction_reads_it_again_whole() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    let (got, _) = feed(&mut a, vec![begin(4), rows(0..2, 0)], now);
    assert!(got.is_empty());
    // The stream broke before the commit: nothing of it went out, all of it comes again.
    a.restart();
    assert_eq!(a.resume().pos, 4);
    let (got, _) = feed(&mut a, txn(4, 0..3, 300), now);
    assert_eq!(got, strs(&["ea0@300", "ea1@300", "ea2@300", "c300"]));
}

#[test]
fn a_transaction_larger_than_the_buffer_is_scanned_then_streamed_and_resumed_inside() {
    let now = Instant::now();
    // Room for one row only.
    let mut a = assembler(row(0, 0).size() + 1, now);
    let (got, reread) = feed(&mut a, txn(4, 0..4, 900), now);
    assert!(
        got.is_empty() && reread,
        "scanned to its end, nothing sent: {got:?}"
    );
    assert_eq!(a.resume().pos, 4, "re-read from its start");
    a.restart();
    // Streamed with the end known; the stream breaks after two rows.
    let (got, _) = feed(&mut a, vec![begin(4), rows(0..2, 0)], now);
    assert_eq!(got, strs(&["ea0@900", "ea1@900"]));
    a.restart();
    // The server sends it again from its start: only the rest goes out.
    let (got, _) = feed(&mut a, txn(4, 0..4, 900), now);
    assert_eq!(got, strs(&["ea2@900", "ea3@900", "c900"]));
    // The next transaction is held again, and a reconnect after it repeats nothing.
    a.restart();
    let (got, _) = feed(&mut a, txn(900, 4..5, 1000), now);
    assert_eq!(got, strs(&["ea4@1000", "c1000"]));
}

#[test]
fn a_reconnect_after_a_forwarded_commit_resumes_past_it() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    feed(&mut a, txn(4, 0..1, 300), now);
    let before = a.resume().clone();
    a.restart();
    assert_eq!(a.resume(), &before, "a restart keeps the boundary");
    assert_eq!(before.checkpoint().to_string(), "binlog.000001:300");
}

#[test]
fn a_commit_without_its_transaction_sends_no_event() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    let (got, _) = feed(&mut a, txn(4, 0..1, 300), now);
    assert_eq!(got, strs(&["ea0@300", "c300"]));
    // The same commit again (no open transaction): a position only, rate-limited.
    let later = now + IDLE_CHECKPOINT_INTERVAL;
    let (got, _) = feed(&mut a, vec![commit(4, 300, false)], later);
    assert_eq!(got, strs(&["i300"]));
}

#[test]
fn rows_rolled_back_to_a_savepoint_are_dropped_and_a_streamed_one_stops_the_relay() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    let undo = |keep| Step::Undo {
        keep,
        what: "ROLLBACK TO sp at binlog.000001:200".into(),
    };
    let (got, _) = feed(
        &mut a,
        vec![begin(4), rows(0..3, 0), undo(1), commit(4, 300, false)],
        now,
    );
    assert_eq!(got, strs(&["ea0@300", "c300"]));

    let mut b = assembler(row(0, 0).size() + 1, now);
    let (_, reread) = feed(&mut b, txn(4, 0..3, 900), now);
    assert!(reread);
    b.restart();
    let mut out = Vec::new();
    for s in [begin(4), rows(0..3, 0)] {
        b.step(s, now, &mut out).unwrap();
    }
    let err = b.step(undo(1), now, &mut out).unwrap_err().to_string();
    assert!(err.contains("--txn-buffer"), "{err}");
}

#[test]
fn idle_positions_are_rate_limited_and_the_relays_own_writes_move_nothing() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    // Another table's transaction right after the start: held back.
    let (got, _) = feed(&mut a, vec![begin(4), commit(4, 100, false)], now);
    assert!(got.is_empty());
    assert_eq!(a.flush_at(), Some(now + IDLE_CHECKPOINT_INTERVAL));
    // A later one replaces it; the pause sends it.
    feed(&mut a, vec![begin(100), commit(100, 200, false)], now);
    let out = a
        .flush(now + IDLE_CHECKPOINT_INTERVAL)
        .map(|o| format!("{o:?}"));
    assert!(out.is_some_and(|o| o.contains("pos: 200")));
    assert_eq!(a.flush_at(), None);
    // The relay's own state write: nothing, until OWN_CHECKPOINT_INTERVAL has passed.
    let (got, _) = feed(
        &mut a,
        vec![begin(200), commit(200, 300, true)],
        now + IDLE_CHECKPOINT_INTERVAL,
    );
    assert!(got.is_empty());
    let late = now + OWN_CHECKPOINT_INTERVAL + IDLE_CHECKPOINT_INTERVAL;
    let (got, _) = feed(&mut a, vec![begin(300), commit(300, 400, true)], late);
    assert_eq!(got, strs(&["i400"]));
    // A heartbeat sends a held position at once.
    feed(&mut a, vec![begin(400), commit(400, 500, false)], late);
    let (got, _) = feed(&mut a, vec![Step::Heartbeat], late);
    assert_eq!(got, strs(&["i500"]));
}

/// Every event of a binlog fixture, in order, with where it starts.
fn fixture(name: &str) -> Vec<crate::source::mysql::file::FileEvent> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mysql-binlogs");
    let bytes = std::fs::read(dir.join(name)).unwrap();
    crate::source::mysql::file::events_from_bytes(name, &bytes).unwrap()
}

/// Feeds `events` from index `from` (an idle interval apart, so every position goes out);
/// stops after `until` events when given. What came out, and the time reached.
fn feed_fixture(
    a: &mut Assembler,
    events: &[crate::source::mysql::file::FileEvent],
    from: usize,
    until: Option<usize>,
    mut now: Instant,
) -> (Vec<String>, Instant) {
    let mut got = Vec::new();
    for e in &events[from..until.unwrap_or(events.len())] {
        now += IDLE_CHECKPOINT_INTERVAL;
        let steps = a.decoder().feed(&e.event).unwrap();
        let (mut shown, reread) = feed(a, steps, now);
        assert!(!reread);
        got.append(&mut shown);
    }
    (got, now)
}

/// The binlog fixtures (MariaDB GTIDs; a MySQL 8 compressed transaction) through decoder and
/// assembler: a position after each transaction; and a stream broken inside a transaction,
/// resumed at the boundary the assembler kept, gives the same positions, none twice.
#[test]
fn binlog_fixtures_resumed_inside_a_transaction_give_each_position_once() {
    for name in ["mariadb-bin.000001", "transaction_compression.000001"] {
        let events = fixture(name);
        let t0 = Instant::now();
        let mut whole = assembler(1 << 20, t0);
        whole.decoder().set_file(name);
        let (all, _) = feed_fixture(&mut whole, &events, 0, None, t0);
        assert!(!all.is_empty(), "{name}: positions after its transactions");
        let mut sorted = all.clone();
        sorted.dedup();
        assert_eq!(sorted, all, "{name}: no position twice");

        // Break inside the last transaction: after the event that opens it.
        let mut a = assembler(1 << 20, t0);
        a.decoder().set_file(name);
        let mut cut = None;
        for (i, e) in events.iter().enumerate() {
            let steps = a.decoder().feed(&e.event).unwrap();
            feed(&mut a, steps, t0);
            if a.in_txn() {
                cut = Some(i + 1);
            }
        }
        let cut = cut.expect("a transaction");
        let mut a = assembler(1 << 20, t0);
        a.decoder().set_file(name);
        let (first, now) = feed_fixture(&mut a, &events, 0, Some(cut), t0);
        assert!(a.in_txn(), "{name}: cut inside a transaction");
        a.restart();
        a.decoder().set_file(name);
        let at = a.resume().pos;
        let from = if at == 4 {
            0
        } else {
            events.iter().position(|e| e.offset >= at).unwrap()
        };
        let (rest, _) = feed_fixture(&mut a, &events, from, None, now);
        let joined: Vec<String> = first.into_iter().chain(rest).collect();
        assert_eq!(joined, all, "{name}: resumed at {at}");
    }
}

/// While a prepared XA transaction with outbox rows is open, every checkpoint is the position
/// before its prepare (the commit's own end is still noted for recovery); given up under
/// `--xa-prepare-expired release`, the position read so far goes out at once.
#[test]
fn a_prepared_xa_holds_every_checkpoint_before_it_until_given_up() {
    let now = Instant::now();
    let mut a = assembler(1 << 20, now);
    a.decoder().hold_prepared("x1", 200, 1, 7200);
    let mut out = Vec::new();
    for s in txn(300, 0..1, 400) {
        a.step(s, now, &mut out).unwrap();
    }
    let Some(Output::Committed {
        checkpoint, end, ..
    }) = out.pop()
    else {
        panic!("a forwarded transaction")
    };
    assert_eq!((pos_of(&checkpoint), pos_of(&end)), (200, 400));
    // An idle position is held too.
    a.step(
        commit(400, 500, false),
        now + IDLE_CHECKPOINT_INTERVAL,
        &mut out,
    )
    .unwrap();
    assert!(matches!(out.pop(), Some(Output::Checkpoint(cp)) if pos_of(&cp) == 200));
    // Within the limit nothing changes; past it, `release` sends the position read so far.
    let limit = Duration::from_secs(3600 * 3);
    assert!(a
        .xa_check(limit, XaExpired::Release, now)
        .unwrap()
        .is_none());
    let limit = Duration::from_secs(60);
    let sent = a.xa_check(limit, XaExpired::Release, now).unwrap();
    assert!(matches!(sent, Some(Output::Checkpoint(cp)) if pos_of(&cp) == 500));
    // `stop` ends the relay instead.
    let mut b = assembler(1 << 20, now);
    b.decoder().hold_prepared("x2", 200, 1, 7200);
    let err = b
        .xa_check(limit, XaExpired::Stop, now)
        .unwrap_err()
        .to_string();
    assert!(err.contains("XA"), "{err}");
}
