//! The binlog transaction assembler: fed what the [`Decoder`] made of each binlog event
//! ([`Step`]s), it holds a transaction's outbox rows until its commit (up to `--txn-buffer`;
//! a larger one is scanned to its end once, then re-read from its start and streamed with the
//! end known), drops rows rolled back inside the group, and returns the events to forward and
//! the checkpoint after each transaction. A reconnect resumes at the last transaction boundary
//! read, so only a transaction cut off while it was streamed repeats, and [`Redelivery`]
//! (keyed by where it starts) skips what of it went out.
//!
//! Checkpoints: one after every transaction with outbox events; for others (and the relay's
//! own state writes) at most every [`IDLE_CHECKPOINT_INTERVAL`] (every
//! [`OWN_CHECKPOINT_INTERVAL`] for state writes only, or each write would cause the next);
//! never past a prepared XA transaction's prepare ([`Assembler::held`]). No I/O, and no clock
//! of its own: the run loop passes the time in.

use super::decode::{row_index, Decoder, Step};
use super::rows::OutboxTable;
use super::xa_pin::{XaExpired, XaWatch};
use super::{MySqlSourceConfig, Resume};
use crate::event::{Checkpoint, OutboxEvent, SourcePosition};
use crate::source::assemble::{Output, Redelivery, Replay};
use crate::Error;
use std::time::{Duration, Instant};

/// How often a checkpoint for transactions without outbox events is sent at most. Each is a
/// position write, a binlog transaction every other relay of the server reads as someone else's
/// (and checkpoints in turn): at 200 ms two idle relays of one server kept each other storing
/// five times a second. At this pace a store adds no write beyond the lease's renewal each
/// second by much, and the position still follows a busy server within seconds.
pub(crate) const IDLE_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(5);

/// When only the relay's own state writes follow the last checkpoint for this long, one of
/// them becomes a checkpoint anyway: on a quiet server the stored position would otherwise
/// stay behind until its binlog file is purged. One write per interval is no loop.
pub(crate) const OWN_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(300);

/// How the open transaction's rows are handled.
#[derive(Debug, PartialEq, Eq)]
enum Mode {
    /// Held until the commit (the end position is not known before).
    Buffer,
    /// The end position is known (from an earlier scan): sent as they come.
    Stream { end: u64 },
    /// Too large to hold: read to the end to learn the end position, then re-read.
    Scan,
}

struct Open {
    start_file: String,
    start_pos: u64,
    mode: Mode,
    buffered: Vec<OutboxEvent>,
    buffered_bytes: usize,
    /// What of it went out before a reconnect (streamed mode): skipped.
    replay: Replay,
    seen: u32,
    /// The earliest `created_at` among its rows (for the commit-vs-created gap).
    min_created: Option<chrono::DateTime<chrono::Utc>>,
    /// The first statement that rolled back some of its rows (to a savepoint), in any mode:
    /// streaming it would send those rows before the rollback is read again, so a scan that
    /// ends with one set stops the relay instead.
    undone: Option<String>,
    /// Bytes of every outbox row read of it, undone ones included: what a buffer holding it
    /// whole needs at most.
    total_bytes: usize,
}

/// What the run loop does after a step.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Go on reading.
    Read,
    /// The end of a transaction too large to hold was found: open the stream again at its
    /// start (the resume position) and stream it.
    Reread,
}

/// See the module doc.
pub(crate) struct Assembler {
    dec: Decoder,
    resume: Resume,
    mariadb: bool,
    txn_buffer_bytes: usize,
    /// A transaction whose end position was learnt by scanning: (file, start, end).
    known_end: Option<(String, u64, u64)>,
    redelivery: Redelivery<(String, u64)>,
    open: Option<Open>,
    /// A checkpoint held back by the rate limit.
    pending: Option<Checkpoint>,
    last_sent: Instant,
    /// What holds the stored position back (prepared XA transactions).
    xa_watch: XaWatch,
}

impl Assembler {
    /// An assembler reading `tables` from `start`, with `cfg`'s limits, at `now`.
    pub(crate) fn new(
        tables: Vec<OutboxTable>,
        start: Resume,
        cfg: &MySqlSourceConfig,
        now: Instant,
    ) -> Self {
        Assembler {
            dec: Decoder::new(tables, &start.file, None)
                .with_limits(cfg.txn_buffer_bytes, cfg.max_payload_bytes),
            resume: start,
            mariadb: cfg.mariadb,
            txn_buffer_bytes: cfg.txn_buffer_bytes,
            known_end: None,
            redelivery: Redelivery::default(),
            open: None,
            pending: None,
            last_sent: now,
            xa_watch: XaWatch::default(),
        }
    }

    /// Where the next stream starts: the last transaction boundary read.
    pub(crate) fn resume(&self) -> &Resume {
        &self.resume
    }

    /// The decoder, for the events of a compressed transaction (fed one at a time).
    pub(crate) fn decoder(&mut self) -> &mut Decoder {
        &mut self.dec
    }

    /// Inside a transaction: a stop waits for its end.
    pub(crate) fn in_txn(&self) -> bool {
        self.dec.in_txn()
    }

    /// A new stream at [`Assembler::resume`]: the decoder keeps only the prepared XA
    /// transactions it holds, the open transaction starts again.
    pub(crate) fn restart(&mut self) {
        let r = &self.resume;
        self.dec.restart(
            &r.file,
            self.mariadb.then(|| r.gtid.clone().unwrap_or_default()),
            if self.mariadb {
                None
            } else {
                r.mysql_gtids.clone()
            },
        );
        self.open = None;
    }

    /// The checkpoint to send instead of `cp` while an XA transaction is prepared and its
    /// outcome not read: the position before its prepare. Its rows live only in this process
    /// until its XA COMMIT; a stored position past the prepare would lose them on a restart.
    /// Holding the position there means a restart reads the transactions after the prepare
    /// again (duplicates, never a loss).
    fn held(&self, cp: Checkpoint) -> Checkpoint {
        match self.dec.held_checkpoint() {
            Some(floor) => floor.clone(),
            None => cp,
        }
    }

    fn send(&mut self, cp: Checkpoint, now: Instant) -> Output {
        self.last_sent = now;
        Output::Checkpoint(self.held(cp))
    }

    /// When a checkpoint held back by the rate limit is due (none held: `None`).
    pub(crate) fn flush_at(&self) -> Option<Instant> {
        self.pending
            .as_ref()
            .map(|_| self.last_sent + IDLE_CHECKPOINT_INTERVAL)
    }

    /// The checkpoint held back, now that the stream paused.
    pub(crate) fn flush(&mut self, now: Instant) -> Option<Output> {
        let cp = self.pending.take()?;
        Some(self.send(cp, now))
    }

    /// One look at the prepared XA transactions (every second): when prepares were given up,
    /// the position read so far goes out now, no longer held before them (on a quiet server
    /// no commit would send it). An error under `--xa-prepare-expired stop`.
    pub(crate) fn xa_check(
        &mut self,
        limit: Duration,
        policy: XaExpired,
        now: Instant,
    ) -> Result<Option<Output>, Error> {
        if !self.xa_watch.check(&mut self.dec, limit, policy)? {
            return Ok(None);
        }
        let cp = self
            .pending
            .take()
            .unwrap_or_else(|| self.resume.checkpoint());
        Ok(Some(self.send(cp, now)))
    }

    /// The stream stops: the checkpoint still held back, and a warning for each prepared XA
    /// transaction that holds the position back.
    pub(crate) fn finish(&mut self, now: Instant) -> Option<Output> {
        for p in self.dec.pins() {
            // The next start reads everything since this prepare again: said at the level
            // that gets read.
            tracing::warn!(xid = %p.xid, prepared_at = %p.prepared_at.to_rfc3339(), held_at = %p.floor, rows = p.rows, "an XA transaction is prepared but not committed: the stored position stays before its prepare, so the next start reads it again and publishes again everything committed since (end it: XA COMMIT {0}; or XA ROLLBACK {0};)", p.xid);
        }
        self.flush(now)
    }

    /// Takes one step of the decoder; what to hand on goes to `out`, in order.
    pub(crate) fn step(
        &mut self,
        step: Step,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Result<Next, Error> {
        match step {
            Step::Nothing => {}
            Step::Begin { file, pos } => self.begin(file, pos),
            Step::Rows(events) => self.rows(events, out)?,
            Step::Undo { keep, what } => self.undo(keep, &what)?,
            Step::Abort { .. } => self.open = None,
            Step::Commit {
                start_file,
                start_pos,
                checkpoint,
                own,
                committed_at,
            } => {
                return self.commit(
                    (start_file, start_pos),
                    checkpoint,
                    own,
                    committed_at,
                    now,
                    out,
                )
            }
            Step::Heartbeat => out.extend(self.flush(now)),
        }
        Ok(Next::Read)
    }

    fn begin(&mut self, file: String, pos: u64) {
        let mode = match &self.known_end {
            Some((f, s, end)) if *f == file && *s == pos => Mode::Stream { end: *end },
            _ => Mode::Buffer,
        };
        let replay = self.redelivery.begin(&(file.clone(), pos));
        self.open = Some(Open {
            start_file: file,
            start_pos: pos,
            mode,
            buffered: Vec::new(),
            buffered_bytes: 0,
            replay,
            seen: 0,
            min_created: None,
            undone: None,
            total_bytes: 0,
        });
    }

    fn rows(&mut self, events: Vec<OutboxEvent>, out: &mut Vec<Output>) -> Result<(), Error> {
        let Some(o) = self.open.as_mut() else {
            return Err(Error::Decode("rows outside a transaction".into()));
        };
        for mut event in events {
            o.seen += 1;
            o.min_created = Some(
                o.min_created
                    .map_or(event.created_at, |m| m.min(event.created_at)),
            );
            o.total_bytes += event.size();
            match o.mode {
                Mode::Buffer => {
                    o.buffered_bytes += event.size();
                    o.buffered.push(event);
                    if o.buffered_bytes > self.txn_buffer_bytes {
                        tracing::info!(
                            file = %o.start_file, pos = o.start_pos, bytes = o.buffered_bytes,
                            "a transaction larger than the buffer: reading to its end, then streaming it from its start"
                        );
                        o.buffered = Vec::new();
                        o.mode = Mode::Scan;
                    }
                }
                Mode::Stream { end } => {
                    if o.replay.skips(o.seen - 1) {
                        continue;
                    }
                    set_end(&mut event, end);
                    out.push(Output::Event(Box::new(event)));
                    self.redelivery
                        .sent(&(o.start_file.clone(), o.start_pos), o.seen);
                }
                Mode::Scan => {}
            }
        }
        Ok(())
    }

    fn undo(&mut self, keep: u32, what: &str) -> Result<(), Error> {
        let Some(o) = self.open.as_mut() else {
            return Ok(());
        };
        o.undone.get_or_insert(what.to_string());
        match o.mode {
            Mode::Buffer => {
                o.buffered.retain(|e| row_index(e) < keep);
                o.buffered_bytes = o.buffered.iter().map(OutboxEvent::size).sum();
                o.min_created = o.buffered.iter().map(|e| e.created_at).min();
                o.seen = o.buffered.len() as u32;
            }
            Mode::Scan if keep == 0 => {
                // All of it undone and nothing of it sent: what follows is held again.
                // (Should it outgrow the buffer again, its scan ends in the error: `undone`
                // stays set.)
                o.mode = Mode::Buffer;
                o.buffered_bytes = 0;
                o.min_created = None;
                o.seen = 0;
            }
            Mode::Scan => {
                // Nothing sent yet: read on to learn its whole size for the fix, then stop at
                // its end.
            }
            Mode::Stream { .. } => {
                // Every row this stream read of it went out (or went out before a reconnect):
                // the undone ones among them.
                return Err(undone_in_stream(o, what, self.txn_buffer_bytes, true));
            }
        }
        Ok(())
    }

    fn commit(
        &mut self,
        start: (String, u64),
        checkpoint: Checkpoint,
        own: bool,
        committed_at: Option<chrono::DateTime<chrono::Utc>>,
        now: Instant,
        out: &mut Vec<Output>,
    ) -> Result<Next, Error> {
        let Checkpoint::Binlog { pos: end, .. } = &checkpoint else {
            unreachable!("binlog checkpoints only")
        };
        let end = *end;
        let mut had_events = false;
        let mut min_created = None;
        if let Some(o) = self.open.take() {
            min_created = o.min_created;
            match o.mode {
                Mode::Scan => {
                    if let Some(what) = &o.undone {
                        return Err(undone_in_stream(&o, what, self.txn_buffer_bytes, false));
                    }
                    self.known_end = Some((start.0, start.1, end));
                    tracing::info!(
                        end,
                        "end of the large transaction found; re-reading it from its start"
                    );
                    return Ok(Next::Reread);
                }
                Mode::Stream { .. } => {
                    had_events = o.seen > 0;
                    self.known_end = None;
                }
                Mode::Buffer => {
                    had_events = !o.buffered.is_empty();
                    for mut event in o.buffered.into_iter().skip(o.replay.sent as usize) {
                        set_end(&mut event, end);
                        out.push(Output::Event(Box::new(event)));
                    }
                }
            }
            self.redelivery.finished();
        }
        self.resume = Resume {
            file: self.dec.file().to_string(),
            pos: end,
            gtid: self.dec.gtid_state().cloned(),
            mysql_gtids: self.dec.mysql_gtids().cloned(),
            by_position: self.resume.by_position,
        };
        if had_events {
            self.pending = None;
            self.last_sent = now;
            out.push(Output::Committed {
                checkpoint: self.held(checkpoint.clone()),
                end: checkpoint,
                commit_at: committed_at,
                // Whole seconds: the commit may be up to 1 s later.
                gap: committed_at
                    .map(|at| at + chrono::Duration::seconds(1))
                    .zip(min_created),
            });
        } else if !own {
            self.pending = Some(checkpoint);
            if now.duration_since(self.last_sent) >= IDLE_CHECKPOINT_INTERVAL {
                out.extend(self.flush(now));
            }
        } else if self.pending.is_none()
            && now.duration_since(self.last_sent) >= OWN_CHECKPOINT_INTERVAL
        {
            out.push(self.send(checkpoint, now));
        }
        Ok(Next::Read)
    }
}

/// A transaction too large for `--txn-buffer` (so streamed, not held to its commit) rolled
/// back some of its outbox rows inside its group. `sent`: rows of it already went to the sink.
fn undone_in_stream(o: &Open, what: &str, limit: usize, sent: bool) -> Error {
    let bytes = o.total_bytes.max(limit + 1);
    Error::config(
        format!(
            "the transaction at {}:{} has more outbox rows than --txn-buffer holds ({} bytes of them, the limit is {limit}), so the relay streams it \
             instead of holding it until its commit, and {what} rolls back some of them; {}",
            o.start_file,
            o.start_pos,
            o.total_bytes,
            if sent {
                "rows of it were handed to the sink before the rollback was read and may have been published \
                 (the stored position stays before this transaction)"
            } else {
                "nothing of it was published: the relay stops rather than publish rows that were rolled back"
            }
        ),
        format!(
            "raise --txn-buffer above {bytes} bytes (e.g. --txn-buffer {}) so that the transaction is held until its commit and only the rows it kept are published; then start the relay again",
            bytes.next_power_of_two()
        ),
    )
}

fn set_end(event: &mut OutboxEvent, end: u64) {
    if let SourcePosition::Binlog { end_pos, .. } = &mut event.position {
        *end_pos = end;
    }
}

#[cfg(test)]
mod tests;
