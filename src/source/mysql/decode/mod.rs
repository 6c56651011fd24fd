//! The binlog decoding path shared by every way of reading a binlog (the server's dump stream
//! now, archived binlog files next): it takes `mysql_common` events in log order and tells the
//! driver where transactions begin and end, which outbox rows they inserted, and the position
//! and GTID state after each one. It knows nothing about connections, budgets or shutdown.
//!
//! MySQL 8 specifics handled here: TRANSACTION_PAYLOAD events (`binlog_transaction_compression`)
//! are unpacked and their events fed in place, at the payload's position; the executed GTID
//! set is tracked from each file's Previous_gtids event plus every GTID event (tagged ones of
//! 8.4 included), and rides in the checkpoint for `COM_BINLOG_DUMP_GTID` resume.
//!
//! Transaction boundaries: a MariaDB GTID event (or MySQL GTID / anonymous GTID event, or a
//! `BEGIN` query) opens an event group; `XID`, a `COMMIT`/`ROLLBACK` query, `XA PREPARE` or an
//! `XA COMMIT`/`XA ROLLBACK` query closes it; a group flagged standalone (DDL), or a MySQL
//! group whose first query is not `BEGIN`, closes after its one statement.
//!
//! XA transactions: both servers write a two-phase XA transaction's rows at `XA PREPARE`, and
//! its outcome later, in a group of its own (`XA COMMIT` or `XA ROLLBACK`, with other
//! transactions in between). The rows of a prepared XA transaction are held here, keyed by
//! its XID, and handed out as rows of the group that commits it (at that group's position), so
//! they follow commit order and a rolled-back one is never published. While one that holds
//! outbox rows is prepared, [`Decoder::held_checkpoint`] is where a stored position must stay
//! (the start of its prepare), so that a restart reads the prepare again; one that wrote only
//! other tables holds nothing back (its outcome can publish nothing). The source reports
//! what holds the position back ([`Decoder::pins`]) and may give one up
//! ([`Decoder::release_prepared_before`]). A one-phase commit (`XA COMMIT …
//! ONE PHASE`) is an ordinary transaction on MariaDB and an `XA PREPARE` event flagged
//! one-phase on MySQL: either publishes at once.
//!
//! Compressed transactions are inflated and framed one event at a time ([`PayloadEvents`]),
//! so memory holds one event of a payload, never the whole; a payload that declares more
//! than the configured limit (`--max-txn-payload-bytes`) is refused before anything is
//! inflated.
//!
//! Savepoints: rows a group rolled back to a savepoint (`ROLLBACK TO` inside a committed
//! group) or whole (a group ending in `ROLLBACK`) are dropped ([`Step::Undo`]). An INCIDENT
//! event (the server lost events at that point of its binlog) stops the relay.
//!
//! The decoder itself (event groups, table maps, rows, GTIDs) is here; its parts are the
//! XA transactions it holds (`xa`), compressed transactions (`payload`), savepoints and
//! rollbacks (`savepoint`), the statement text it checks (`statement`) and the rows events it
//! decodes (`row_events`).

use super::gtid::{self, Gtid, GtidState, MysqlGtidSet};
use super::rows::{Layout, Mapping, OutboxTable};
use crate::event::{Checkpoint, OutboxEvent};
use crate::Error;
use chrono::{DateTime, TimeZone, Utc};
use mysql_common::binlog::events::{
    Event, GtidEvent, PreviousGtidsEvent, QueryEvent, RotateEvent, RowsEventData, TableMapEvent,
};
use std::collections::HashMap;

mod payload;
mod row_events;
mod savepoint;
mod statement;
mod xa;

pub use payload::{payload_too_large, unpack_payload, PayloadError, PayloadEvents};
use row_events::decode_inserts;
pub use row_events::{guarded, in_guarded_rows};
pub use savepoint::row_index;
use statement::first_word;
pub use statement::insert_target;
pub use xa::{parse_xid, XaPin, Xid};
use xa::{xa_too_large, PreparedXa};

// Event type codes (MySQL's and MariaDB's).
const QUERY: u8 = 2;
const STOP: u8 = 3;
const ROTATE: u8 = 4;
/// The Rotate event's type code.
pub const ROTATE_EVENT: u8 = ROTATE;
const FORMAT_DESCRIPTION: u8 = 15;
const XID: u8 = 16;
const EXECUTE_LOAD_QUERY: u8 = 18;
const TABLE_MAP: u8 = 19;
const WRITE_ROWS_V1: u8 = 23;
const UPDATE_ROWS_V1: u8 = 24;
const DELETE_ROWS_V1: u8 = 25;
/// The server lost events at this point of its binlog (LOST_EVENTS).
const INCIDENT: u8 = 26;
const HEARTBEAT: u8 = 27;
const WRITE_ROWS: u8 = 30;
const UPDATE_ROWS: u8 = 31;
const DELETE_ROWS: u8 = 32;
const MYSQL_GTID: u8 = 33;
const MYSQL_ANONYMOUS_GTID: u8 = 34;
const MYSQL_PREVIOUS_GTIDS: u8 = 35;
const XA_PREPARE: u8 = 38;
/// MySQL 8.0.20+: a whole transaction's events, zstd-compressed (or not), in one event.
pub const TRANSACTION_PAYLOAD: u8 = 40;
/// MariaDB GTID event flag: the group is an XA transaction that ends in `XA PREPARE`.
const MARIA_FL_PREPARED_XA: u8 = 0x40;
/// The default of `--max-txn-payload-bytes`.
pub const DEFAULT_PAYLOAD_LIMIT: u64 = 256 * 1024 * 1024;
/// The default of `--txn-buffer`.
pub(crate) const DEFAULT_TXN_BUFFER: usize = 16 * 1024 * 1024;
const PARTIAL_UPDATE_ROWS: u8 = 39;
const HEARTBEAT_V2: u8 = 41;
const MYSQL_GTID_TAGGED: u8 = 42;
const MARIA_GTID: u8 = 162;
const MARIA_GTID_LIST: u8 = 163;
const MARIA_QUERY_COMPRESSED: u8 = 165;
const MARIA_ROWS_COMPRESSED_FIRST: u8 = 166;
const MARIA_ROWS_COMPRESSED_LAST: u8 = 171;

/// The relay's own state table: transactions that write only to it (lease renewals, position
/// writes) never move the position, or each write would cause the next.
pub(crate) const STATE_TABLE: &str = "outboxd_state";

/// What one binlog event meant.
#[derive(Debug)]
pub enum Step {
    /// Nothing for the driver.
    Nothing,
    /// An event group (transaction) begins at `file:pos`.
    Begin { file: String, pos: u64 },
    /// Outbox rows inserted by the open transaction, in order. Their position's `end_pos` is
    /// not known yet (0): the driver fills it in from the commit.
    Rows(Vec<OutboxEvent>),
    /// The open transaction ended. `checkpoint` is the position after it, with the GTID state.
    /// `own` says that it only wrote the relay's state table.
    Commit {
        start_file: String,
        start_pos: u64,
        checkpoint: Checkpoint,
        own: bool,
        /// When it committed, to the second: the later of its first event's and its commit
        /// event's header timestamps (binlog timestamps have no fraction).
        committed_at: Option<DateTime<Utc>>,
    },
    /// The open transaction undid some of the outbox rows it sent (`ROLLBACK TO` a savepoint
    /// inside a group the server commits anyway) or all of them (a group that ends in
    /// `ROLLBACK`): of its rows, only those whose row index is below `keep` stand. `what`
    /// names the statement and its position.
    Undo { keep: u32, what: String },
    /// The open transaction will never end (cut off by a crash): drop its rows.
    Abort { start_file: String, start_pos: u64 },
    /// The server had nothing to send for a heartbeat period.
    Heartbeat,
}

#[derive(Debug)]
enum TableKind {
    /// A table map of one outbox table.
    Outbox(Box<OutboxMap>),
    State,
    Other,
}

/// What the decoder keeps of an outbox table's table map.
#[derive(Debug)]
struct OutboxMap {
    /// How its row images are laid out.
    layout: Layout,
    mapping: Mapping,
    /// Index into the decoder's tables.
    table: usize,
    /// The table map's bytes: the server writes the same map again before every statement's
    /// rows, and an identical one needs no new mapping.
    raw: Vec<u8>,
}

#[derive(Debug)]
struct Txn {
    start_file: String,
    start_pos: u64,
    gtid: Option<Gtid>,
    /// A MySQL GTID: source UUID, tag (8.4; `""` untagged), transaction number.
    mysql_gtid: Option<([u8; 16], String, u64)>,
    /// Inside BEGIN … COMMIT: statements do not end the group.
    begun: bool,
    index: u32,
    state_rows: bool,
    other: bool,
    committed_at: Option<DateTime<Utc>>,
    /// An XA transaction (`XA START`): its rows are held here until its prepare or its
    /// one-phase commit says what becomes of them.
    xa: bool,
    held: Vec<OutboxEvent>,
    held_bytes: usize,
    /// Savepoints set and not released or rolled past, oldest first: lower-cased name, and
    /// the row index the group had reached there.
    savepoints: Vec<(String, u32)>,
}

/// Decodes one binlog stream (or file sequence) in order.
pub struct Decoder {
    /// The outbox tables (`--table`, one or more), all in one database.
    outbox: Vec<OutboxTable>,
    file: String,
    gtid: GtidState,
    /// The server writes MariaDB GTIDs: the checkpoint carries the GTID state.
    track_gtid: bool,
    /// MySQL: the executed GTID set (from Previous_gtids and GTID events), once one was seen.
    mysql_gtids: Option<MysqlGtidSet>,
    tables: HashMap<u64, TableKind>,
    txn: Option<Txn>,
    seen_format_description: bool,
    /// Prepared XA transactions, oldest first.
    prepared: Vec<PreparedXa>,
    /// Most bytes of outbox rows held for XA transactions at once (`--txn-buffer`).
    xa_limit: usize,
    /// Largest uncompressed size a TRANSACTION_PAYLOAD may declare (`--max-txn-payload-bytes`).
    payload_limit: u64,
}

impl Decoder {
    /// A decoder that starts reading at a transaction boundary in `file` whose GTID state is
    /// `gtid` (`None` where the server has no MariaDB GTIDs).
    pub fn new(outbox: Vec<OutboxTable>, file: &str, gtid: Option<GtidState>) -> Decoder {
        assert!(!outbox.is_empty(), "at least one outbox table");
        Decoder::build(outbox, file, gtid)
    }

    /// A decoder that only follows transaction boundaries and GTIDs (the shared binlog
    /// stream's, [`super::hub`]): it is never fed table maps or rows events.
    pub fn boundaries(file: &str, gtid: Option<GtidState>) -> Decoder {
        Decoder::build(Vec::new(), file, gtid)
    }

    fn build(outbox: Vec<OutboxTable>, file: &str, gtid: Option<GtidState>) -> Decoder {
        Decoder {
            outbox,
            file: file.to_string(),
            track_gtid: gtid.is_some(),
            gtid: gtid.unwrap_or_default(),
            mysql_gtids: None,
            tables: HashMap::new(),
            txn: None,
            seen_format_description: false,
            prepared: Vec::new(),
            xa_limit: DEFAULT_TXN_BUFFER,
            payload_limit: DEFAULT_PAYLOAD_LIMIT,
        }
    }

    /// Sets the bounds: `txn_buffer` bytes of outbox rows held for XA transactions at once
    /// (`--txn-buffer`), and the largest uncompressed size a compressed transaction may
    /// declare (`--max-txn-payload-bytes`).
    pub fn with_limits(mut self, txn_buffer: usize, payload_limit: u64) -> Decoder {
        self.xa_limit = txn_buffer;
        self.payload_limit = payload_limit;
        self
    }

    /// Starts over at a transaction boundary of a new stream (a reconnect): everything the old
    /// stream taught is forgotten except the prepared XA transactions, which were read before
    /// that boundary and are not read again.
    pub fn restart(
        &mut self,
        file: &str,
        gtid: Option<GtidState>,
        mysql_gtids: Option<MysqlGtidSet>,
    ) {
        let prepared = std::mem::take(&mut self.prepared);
        let outbox = std::mem::take(&mut self.outbox);
        *self = Decoder::build(outbox, file, gtid)
            .with_mysql_gtids(mysql_gtids)
            .with_limits(self.xa_limit, self.payload_limit);
        self.prepared = prepared;
    }

    /// While an XA transaction is prepared and its outcome not read, the position before its
    /// prepare (the oldest one's): a stored position must not pass it, or a restart would
    /// never see those rows again.
    pub(crate) fn held_checkpoint(&self) -> Option<&Checkpoint> {
        self.prepared.iter().find(|p| p.pins()).map(|p| &p.floor)
    }

    pub(crate) fn in_txn(&self) -> bool {
        self.txn.is_some()
    }

    pub fn file(&self) -> &str {
        &self.file
    }

    /// The next events come from the start of binlog file `name` (the file source): table
    /// ids are only valid within one file.
    pub(crate) fn set_file(&mut self, name: &str) {
        if name != self.file {
            self.tables.clear();
        }
        self.file = name.to_string();
    }

    /// MySQL: the executed GTID set after the last transaction read (`None` before the first
    /// Previous_gtids or GTID event, and on MariaDB).
    pub fn mysql_gtids(&self) -> Option<&MysqlGtidSet> {
        self.mysql_gtids.as_ref()
    }

    /// Starts from a known MySQL executed GTID set (a resume by GTID).
    pub(crate) fn with_mysql_gtids(mut self, set: Option<MysqlGtidSet>) -> Decoder {
        self.mysql_gtids = set;
        self
    }

    pub fn gtid_state(&self) -> Option<&GtidState> {
        self.track_gtid.then_some(&self.gtid)
    }

    fn checkpoint(&self, pos: u64) -> Checkpoint {
        Checkpoint::Binlog {
            file: self.file.clone(),
            pos,
            gtid_state: self.gtid_text(),
        }
    }

    /// The GTID state a checkpoint carries now (MariaDB state or MySQL executed set).
    fn gtid_text(&self) -> Option<String> {
        if self.track_gtid && !self.gtid.is_empty() {
            Some(self.gtid.to_string())
        } else {
            self.mysql_gtids
                .as_ref()
                .filter(|s| !s.is_empty())
                .map(|s| s.to_string())
        }
    }

    fn begin(&mut self, start: u64, gtid: Option<Gtid>, begun: bool, ts: u32) -> Step {
        self.txn = Some(Txn {
            start_file: self.file.clone(),
            start_pos: start,
            gtid,
            mysql_gtid: None,
            begun,
            index: 0,
            state_rows: false,
            other: false,
            committed_at: Utc.timestamp_opt(ts as i64, 0).single(),
            xa: false,
            held: Vec::new(),
            held_bytes: 0,
            savepoints: Vec::new(),
        });
        Step::Begin {
            file: self.file.clone(),
            pos: start,
        }
    }

    fn commit(&mut self, end_pos: u64, ts: u32) -> Step {
        let Some(txn) = self.txn.take() else {
            return Step::Nothing;
        };
        let at_commit = Utc.timestamp_opt(ts as i64, 0).single();
        if let Some(g) = txn.gtid {
            self.gtid.apply(g);
        }
        // Only a complete set (from a Previous_gtids event or a resume) is tracked: a set of
        // only the GTIDs seen since a mid-file start would make a GTID resume resend the rest.
        if let (Some((uuid, tag, gno)), Some(set)) = (&txn.mysql_gtid, self.mysql_gtids.as_mut()) {
            set.add(*uuid, tag, *gno);
        }
        Step::Commit {
            start_file: txn.start_file,
            start_pos: txn.start_pos,
            checkpoint: self.checkpoint(end_pos),
            own: txn.state_rows && !txn.other,
            committed_at: txn.committed_at.max(at_commit),
        }
    }

    /// Feeds one event; returns what it meant. A transaction that begins while another is
    /// open, rows the decoder cannot read, or a statement-based INSERT into the outbox table
    /// are errors: the relay never skips what it cannot read.
    pub fn feed(&mut self, ev: &Event) -> Result<Vec<Step>, Error> {
        let (start, end) = span(ev);
        self.feed_at(ev, start, end)
    }

    /// Feeds one event that sits at `start..end` of the current file (the events inside a
    /// TRANSACTION_PAYLOAD sit at the payload's place).
    fn feed_at(&mut self, ev: &Event, start: u64, end: u64) -> Result<Vec<Step>, Error> {
        let header = ev.header();
        let kind = header.event_type_raw();
        let mut steps = Vec::new();
        match kind {
            ROTATE => {
                let name = rotate_name(ev, self.seen_format_description)?;
                if !name.is_empty() {
                    if name != self.file {
                        // A new file: table ids are only valid within one file.
                        self.tables.clear();
                    }
                    self.file = name;
                }
            }
            FORMAT_DESCRIPTION => {
                self.seen_format_description = true;
                // The server starts a new file (after a crash): an open group never finished
                // and was rolled back.
                if let Some(txn) = self.txn.take() {
                    tracing::warn!(file = %txn.start_file, pos = txn.start_pos, "an event group without its end was cut off by a new binlog file (the server crashed while writing it and rolled it back); its rows are dropped");
                    steps.push(Step::Abort {
                        start_file: txn.start_file,
                        start_pos: txn.start_pos,
                    });
                }
            }
            STOP => {}
            HEARTBEAT | HEARTBEAT_V2 => steps.push(Step::Heartbeat),
            MARIA_GTID | MYSQL_GTID | MYSQL_ANONYMOUS_GTID | MYSQL_GTID_TAGGED => {
                self.gtid(ev, kind, start, &mut steps)?
            }
            MYSQL_PREVIOUS_GTIDS => self.previous_gtids(ev, start)?,
            TRANSACTION_PAYLOAD => {
                // Whole, for callers that feed events one by one; the sources stream a
                // payload's events with `payload_events` and `feed_inner` instead.
                let mut inner = self.payload_events(ev)?.expect("a payload event");
                while let Some(e) = inner.next_event().map_err(|m| self.payload_err(start, m))? {
                    steps.extend(self.feed_at(&e, start, end)?);
                }
            }
            MARIA_GTID_LIST => {
                // A file's starting state: fills in domains we have not seen, never moves one.
                if let Some(list) = gtid::parse_gtid_list(ev.data()) {
                    let listed = GtidState::from_list(&list);
                    for g in list {
                        if self.gtid.get(g.domain).is_none() {
                            if let Some(top) = listed.get(g.domain) {
                                self.gtid.apply(top);
                            }
                        }
                    }
                }
            }
            QUERY | MARIA_QUERY_COMPRESSED | EXECUTE_LOAD_QUERY => {
                self.query(ev, kind, start, end, &mut steps)?
            }
            XID => {
                self.release_held(&mut steps);
                steps.push(self.commit(end, header.timestamp()));
            }
            XA_PREPARE => self.xa_prepare(ev, start, end, header.timestamp(), &mut steps)?,
            INCIDENT => return Err(self.incident(ev.data(), start, end, header.timestamp())),
            TABLE_MAP => self.table_map(ev, start)?,
            WRITE_ROWS_V1 | WRITE_ROWS | UPDATE_ROWS_V1 | UPDATE_ROWS | DELETE_ROWS_V1
            | DELETE_ROWS | PARTIAL_UPDATE_ROWS => self.rows(ev, start, &mut steps)?,
            k if (MARIA_ROWS_COMPRESSED_FIRST..=MARIA_ROWS_COMPRESSED_LAST).contains(&k) => {
                self.compressed_rows(ev)?
            }
            // Annotations, checkpoints, intvar/rand/user vars and the like.
            _ => {}
        }
        Ok(steps)
    }

    /// A MariaDB GTID event, or a MySQL (anonymous, tagged) GTID event: a group begins.
    fn gtid(
        &mut self,
        ev: &Event,
        kind: u8,
        start: u64,
        steps: &mut Vec<Step>,
    ) -> Result<(), Error> {
        let header = ev.header();
        if kind == MARIA_GTID {
            let g = gtid::parse_gtid_event(ev.data(), header.server_id()).ok_or_else(|| {
                Error::Decode(format!("GTID event at {}:{start} is too short", self.file))
            })?;
            self.no_open_group(start, steps)?;
            self.track_gtid = true;
            steps.push(self.begin(start, Some(g.gtid), !g.standalone, header.timestamp()));
            if ev.data()[12] & MARIA_FL_PREPARED_XA != 0 {
                if let Some(txn) = self.txn.as_mut() {
                    txn.xa = true;
                }
            }
            return Ok(());
        }
        let mysql_gtid = if kind == MYSQL_ANONYMOUS_GTID {
            None
        } else {
            let g: GtidEvent = ev
                .read_event()
                .map_err(|e| self.decode_err("GTID event", start, e))?;
            let tag = g.tag().map(|t| t.to_string()).unwrap_or_default();
            Some((g.sid(), tag.to_ascii_lowercase(), g.gno()))
        };
        self.no_open_group(start, steps)?;
        steps.push(self.begin(start, None, false, header.timestamp()));
        if let Some(txn) = self.txn.as_mut() {
            txn.mysql_gtid = mysql_gtid;
        }
        Ok(())
    }

    /// MySQL Previous_gtids: every GTID written before this file, the executed set at its start.
    fn previous_gtids(&mut self, ev: &Event, start: u64) -> Result<(), Error> {
        // Every GTID written before this file: the executed set at its start.
        if !gtid::previous_gtids_fit(ev.data()) {
            return Err(self.decode_err(
                "Previous_gtids event",
                start,
                "its counts do not fit its length (corrupt)",
            ));
        }
        let p: PreviousGtidsEvent<'_> = ev
            .read_event()
            .map_err(|e| self.decode_err("Previous_gtids event", start, e))?;
        let set = self.mysql_gtids.get_or_insert_with(MysqlGtidSet::default);
        for sid in p.sids() {
            let tag = sid.tag().map(|t| t.to_string()).unwrap_or_default();
            for iv in sid.intervals() {
                set.add_interval(sid.uuid(), &tag.to_ascii_lowercase(), iv.start(), iv.end());
            }
        }
        Ok(())
    }

    /// A statement: BEGIN, COMMIT, XA, savepoints, or one that must not touch the outbox table.
    fn query(
        &mut self,
        ev: &Event,
        kind: u8,
        start: u64,
        end: u64,
        steps: &mut Vec<Step>,
    ) -> Result<(), Error> {
        let header = ev.header();
        if kind == MARIA_QUERY_COMPRESSED {
            // Its text is compressed; a statement on the outbox table would not be
            // seen, so refuse what we cannot check.
            return Err(compressed_binlog());
        }
        let q: QueryEvent<'_> = if kind == QUERY {
            ev.read_event()
                .map_err(|e| self.decode_err("query event", start, e))?
        } else {
            // EXECUTE_LOAD_QUERY shares the query event's layout plus 13 bytes of
            // post-header; its text is checked through the generic path below.
            return self.check_load_query(ev, start);
        };
        let text = q.query_raw();
        let verb = first_word(text);
        if verb.eq_ignore_ascii_case("XA") {
            self.xa_statement(text, start, end, header.timestamp(), steps)?;
        } else if verb.eq_ignore_ascii_case("BEGIN") {
            match self.txn.as_mut() {
                Some(txn) => txn.begun = true,
                None => steps.push(self.begin(start, None, true, header.timestamp())),
            }
        } else if verb.eq_ignore_ascii_case("COMMIT") {
            steps.push(self.commit(end, header.timestamp()));
        } else if let Some(sp) = savepoint::parse(text).filter(|_| self.txn.is_some()) {
            self.savepoint_statement(sp, text, start, end, header.timestamp(), steps)?;
        } else if verb.eq_ignore_ascii_case("ROLLBACK") {
            // Outside a group: nothing to end.
        } else {
            self.check_statement(&q)?;
            let standalone = match self.txn.as_mut() {
                Some(txn) => {
                    txn.other = true;
                    !txn.begun
                }
                None => {
                    steps.push(self.begin(start, None, false, header.timestamp()));
                    true
                }
            };
            if standalone {
                steps.push(self.commit(end, header.timestamp()));
            }
        }
        Ok(())
    }

    /// A table map: which table id is an outbox table, the state table, or another.
    fn table_map(&mut self, ev: &Event, start: u64) -> Result<(), Error> {
        let tme: TableMapEvent<'_> = ev
            .read_event()
            .map_err(|e| self.decode_err("table map event", start, e))?;
        let id = tme.table_id();
        if let Some(TableKind::Outbox(known)) = self.tables.get(&id) {
            if known.raw == ev.data() {
                return Ok(());
            }
        }
        let kind = if let Some(i) = self.outbox.iter().position(|t| t.matches(&tme)) {
            super::rows::table_map_fits(&tme)
                .map_err(|m| self.decode_err("table map event", start, m))?;
            let mapping = self.outbox[i].map(&tme)?;
            let layout =
                Layout::new(&tme).map_err(|m| self.decode_err("table map event", start, m))?;
            TableKind::Outbox(Box::new(OutboxMap {
                layout,
                mapping,
                table: i,
                raw: ev.data().to_vec(),
            }))
        } else if self
            .outbox
            .first()
            .is_some_and(|o| tme.database_name_raw() == o.database.as_bytes())
            && tme.table_name_raw() == STATE_TABLE.as_bytes()
        {
            TableKind::State
        } else {
            TableKind::Other
        };
        self.tables.insert(id, kind);
        Ok(())
    }

    /// A rows event: an outbox table's inserts become events (held for an XA transaction).
    fn rows(&mut self, ev: &Event, start: u64, steps: &mut Vec<Step>) -> Result<(), Error> {
        let header = ev.header();
        if self.txn.is_none() {
            // Servers without GTIDs or BEGIN (very old ones) still bracket rows
            // with XID: open the group here.
            steps.push(self.begin(start, None, true, header.timestamp()));
        }
        // Rows of other tables are told apart by the table id alone, before anything else of
        // the event is read.
        let table_id = rows_table_id(ev)
            .ok_or_else(|| self.decode_err("rows event", start, "too short for a table id"))?;
        let txn = self.txn.as_mut().expect("opened above");
        match self.tables.get(&table_id) {
            Some(TableKind::State) => txn.state_rows = true,
            Some(TableKind::Outbox(outbox)) => {
                let OutboxMap {
                    layout,
                    mapping,
                    table: i,
                    ..
                } = &**outbox;
                txn.other = true;
                let data = match ev.read_data() {
                    Ok(Some(mysql_common::binlog::events::EventData::RowsEvent(r))) => r,
                    Ok(_) => {
                        return Err(Error::Decode(format!(
                            "rows event at {}:{start}: not a rows event",
                            self.file
                        )))
                    }
                    Err(e) => {
                        return Err(Error::Decode(format!(
                            "rows event at {}:{start}: {e}",
                            self.file
                        )))
                    }
                };
                if data.table_id() != table_id {
                    return Err(Error::Decode(format!(
                        "rows event at {}:{start}: its table id reads as {table_id} and as {}",
                        self.file,
                        data.table_id()
                    )));
                }
                if let RowsEventData::WriteRowsEventV1(_) | RowsEventData::WriteRowsEvent(_) = data
                {
                    let events =
                        decode_inserts(&self.outbox[*i], layout, mapping, &data, &self.file, txn)
                            .map_err(|e| match e {
                            Error::Decode(m) => {
                                Error::Decode(format!("rows event at {}:{start}: {m}", self.file))
                            }
                            other => other,
                        })?;
                    if txn.xa {
                        // Held until the prepare or one-phase commit, within the
                        // same bound as the relay's transaction buffer.
                        let bytes: usize = events.iter().map(OutboxEvent::size).sum();
                        let total = self.prepared.iter().map(|p| p.bytes).sum::<usize>()
                            + txn.held_bytes
                            + bytes;
                        if total > self.xa_limit {
                            return Err(xa_too_large(
                                &txn.start_file,
                                txn.start_pos,
                                total,
                                self.xa_limit,
                            ));
                        }
                        txn.held_bytes += bytes;
                        txn.held.extend(events);
                    } else if !events.is_empty() {
                        steps.push(Step::Rows(events));
                    }
                }
            }
            Some(TableKind::Other) => txn.other = true,
            None => {
                return Err(Error::Decode(format!(
                    "rows event at {}:{start} for table id {table_id} without its table map",
                    self.file
                )))
            }
        }
        Ok(())
    }

    /// MariaDB compressed rows (log_bin_compress=ON): refused on an outbox table.
    fn compressed_rows(&mut self, ev: &Event) -> Result<(), Error> {
        // Compressed rows (log_bin_compress=ON): the table id comes first, as in an
        // ordinary rows event.
        let data = ev.data();
        let table_id = data
            .get(..6)
            .map(|b| {
                let mut a = [0u8; 8];
                a[..6].copy_from_slice(b);
                u64::from_le_bytes(a)
            })
            .unwrap_or(u64::MAX);
        match self.tables.get(&table_id) {
            Some(TableKind::Outbox(_)) => return Err(compressed_binlog()),
            Some(TableKind::State) => {
                if let Some(t) = self.txn.as_mut() {
                    t.state_rows = true
                }
            }
            _ => {
                if let Some(t) = self.txn.as_mut() {
                    t.other = true
                }
            }
        }
        Ok(())
    }

    /// A new group begins: one still open never ended. Without outbox rows that is only
    /// noted (and the group dropped); with outbox rows the relay stops rather than guess.
    fn no_open_group(&mut self, start: u64, steps: &mut Vec<Step>) -> Result<(), Error> {
        match self.txn.take() {
            Some(t) if t.index > 0 => Err(Error::Decode(format!(
                "a new event group starts at {}:{start} while the group at {}:{} (with outbox rows) never ended",
                self.file, t.start_file, t.start_pos
            ))),
            Some(t) => {
                tracing::warn!(file = %t.start_file, pos = t.start_pos, next = start, "an event group without outbox rows never ended; skipping it");
                steps.push(Step::Abort {
                    start_file: t.start_file,
                    start_pos: t.start_pos,
                });
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// An INCIDENT event: the server could not write some changes to its binlog here (a
    /// replica stops at it too). What it lost cannot be read from anywhere in the binlog, so
    /// the relay stops like at a lost position, naming where and how to go on.
    fn incident(&self, data: &[u8], start: u64, end: u64, ts: u32) -> Error {
        let number = data
            .get(..2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .unwrap_or(0);
        let kind = match number {
            1 => "LOST_EVENTS".to_string(),
            n => format!("incident {n}"),
        };
        let message = data
            .get(2)
            .and_then(|&n| data.get(3..3 + n as usize))
            .map(|m| String::from_utf8_lossy(m).into_owned())
            .unwrap_or_default();
        let at = Utc
            .timestamp_opt(ts as i64, 0)
            .single()
            .map(|t| t.to_rfc3339())
            .unwrap_or_else(|| "an unknown time".into());
        Error::PositionLost {
            problem: format!(
                "the binlog holds an INCIDENT event ({kind}: {message:?}) at {}:{start}, written at {at}: the server could not write \
                 some changes to its binlog there, so outbox rows committed around then may be missing from it and cannot be published from it",
                self.file
            ),
            fix: format!(
                "either go on after it and accept what it may have lost: with the relay stopped, `outboxd offset set --binlog-position {}:{end}` \
                 (with the relay's --name and --source); or publish again from the table every row created since shortly before {at}: \
                 `outboxd teardown --name <name> --yes`, then start with `--snapshot since=<a time before {at}>` (expect duplicates). \
                 A restart without either stops here again",
                self.file
            ),
        }
    }

    fn decode_err(&self, what: &str, pos: u64, e: impl std::fmt::Display) -> Error {
        Error::Decode(format!("{what} at {}:{pos}: {e}", self.file))
    }
}

/// Which table an event is about, read from as little of it as possible: what the shared
/// binlog stream ([`super::hub`]) routes by, before any row is decoded.
#[derive(Debug, PartialEq, Eq)]
pub enum TableRef {
    /// A table map: `id` names the table `schema`.`table` until the next file.
    Map { id: u64, schema: Vec<u8> },
    /// A rows event (plain or MariaDB-compressed) of table `id`.
    Rows { id: u64 },
    /// Any other event.
    None,
}

/// See [`TableRef`]. A table map that does not parse is `None` (every tenant gets it, and its
/// decoder names the problem).
pub fn table_ref(ev: &Event) -> TableRef {
    match ev.header().event_type_raw() {
        TABLE_MAP => match ev.read_event::<TableMapEvent<'_>>() {
            Ok(t) => TableRef::Map {
                id: t.table_id(),
                schema: t.database_name_raw().to_vec(),
            },
            Err(_) => TableRef::None,
        },
        WRITE_ROWS_V1 | WRITE_ROWS | UPDATE_ROWS_V1 | UPDATE_ROWS | DELETE_ROWS_V1
        | DELETE_ROWS | PARTIAL_UPDATE_ROWS => {
            rows_table_id(ev).map_or(TableRef::None, |id| TableRef::Rows { id })
        }
        k if (MARIA_ROWS_COMPRESSED_FIRST..=MARIA_ROWS_COMPRESSED_LAST).contains(&k) => {
            ev.data().get(..6).map_or(TableRef::None, |b| {
                let mut a = [0u8; 8];
                a[..6].copy_from_slice(b);
                TableRef::Rows {
                    id: u64::from_le_bytes(a),
                }
            })
        }
        _ => TableRef::None,
    }
}

/// The table id a rows event starts with: 6 bytes, 4 from servers whose format description
/// gives rows events a 6-byte post-header (before MySQL 5.1.x's final format).
fn rows_table_id(ev: &Event) -> Option<u64> {
    let narrow = ev
        .header()
        .event_type()
        .map(|t| ev.fde().get_event_type_header_length(t) == 6)
        .unwrap_or(false);
    let b = ev.data().get(..if narrow { 4 } else { 6 })?;
    let mut a = [0u8; 8];
    a[..b.len()].copy_from_slice(b);
    Some(u64::from_le_bytes(a))
}

/// Where an event sits in its file: `start..end`.
pub fn span(ev: &Event) -> (u64, u64) {
    let header = ev.header();
    let end = header.log_pos() as u64;
    (end.saturating_sub(header.event_size() as u64), end)
}

fn compressed_binlog() -> Error {
    Error::config(
        "the binlog is compressed (log_bin_compress=ON): outbox rows in compressed events cannot be read",
        "SET GLOBAL log_bin_compress = OFF; and remove log_bin_compress from the server's option file",
    )
}

/// The file name of a Rotate event. MariaDB sends the first (fake) Rotate of a dump before
/// the format description, so the reader does not know yet that events carry a CRC32, and
/// the 4 checksum bytes end up in the name (mysql_async issue #189): when they check out as
/// the event's CRC32, they are cut off.
fn rotate_name(ev: &Event, seen_fde: bool) -> Result<String, Error> {
    let data = ev.data();
    let mut name_bytes: &[u8] = data.get(8..).unwrap_or(&[]);
    if !seen_fde && name_bytes.len() > 4 {
        let h = ev.header();
        let mut hdr = Vec::with_capacity(19);
        hdr.extend_from_slice(&h.timestamp().to_le_bytes());
        hdr.push(h.event_type_raw());
        hdr.extend_from_slice(&h.server_id().to_le_bytes());
        hdr.extend_from_slice(&h.event_size().to_le_bytes());
        hdr.extend_from_slice(&h.log_pos().to_le_bytes());
        hdr.extend_from_slice(&h.flags_raw().to_le_bytes());
        let (body, crc) = data.split_at(data.len() - 4);
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&hdr);
        hasher.update(body);
        if hasher.finalize().to_le_bytes() == crc {
            name_bytes = &name_bytes[..name_bytes.len() - 4];
        }
    } else {
        // Parse through mysql_common as a sanity check of the layout.
        let _: RotateEvent<'_> = ev
            .read_event()
            .map_err(|e| Error::Decode(format!("rotate event: {e}")))?;
    }
    String::from_utf8(name_bytes.to_vec())
        .map_err(|_| Error::Decode("rotate event: the file name is not UTF-8".into()))
}
