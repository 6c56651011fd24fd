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
//! they follow commit order and a rolled-back one is never published. While one is held,
//! [`Decoder::held_checkpoint`] is where a stored position must stay (the start of its
//! prepare), so that a restart reads the prepare again. A one-phase commit (`XA COMMIT …
//! ONE PHASE`) is an ordinary transaction on MariaDB and an `XA PREPARE` event flagged
//! one-phase on MySQL: either publishes at once.
//!
//! Compressed transactions are inflated and framed one event at a time ([`PayloadEvents`]),
//! so memory holds one event of a payload, never the whole; a payload that declares more
//! than the configured limit (`--max-txn-payload-bytes`) is refused before anything is
//! inflated.

use super::gtid::{self, Gtid, GtidState, MysqlGtidSet};
use super::rows::{Mapping, OutboxTable, RowContext};
use crate::event::{Checkpoint, OutboxEvent};
use crate::Error;
use chrono::{DateTime, TimeZone, Utc};
use mysql_common::binlog::events::{
    Event, GtidEvent, PreviousGtidsEvent, QueryEvent, RotateEvent, RowsEventData, TableMapEvent,
};
use std::collections::HashMap;

// Event type codes (MySQL's and MariaDB's).
const QUERY: u8 = 2;
const STOP: u8 = 3;
const ROTATE: u8 = 4;
const FORMAT_DESCRIPTION: u8 = 15;
const XID: u8 = 16;
const EXECUTE_LOAD_QUERY: u8 = 18;
const TABLE_MAP: u8 = 19;
const WRITE_ROWS_V1: u8 = 23;
const UPDATE_ROWS_V1: u8 = 24;
const DELETE_ROWS_V1: u8 = 25;
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
pub const DEFAULT_TXN_BUFFER: usize = 16 * 1024 * 1024;
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
pub const STATE_TABLE: &str = "outboxd_state";

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
    /// The open transaction will never end (cut off by a crash): drop its rows.
    Abort { start_file: String, start_pos: u64 },
    /// The server had nothing to send for a heartbeat period.
    Heartbeat,
}

#[derive(Debug)]
enum TableKind {
    /// A table map of one outbox table (index into the decoder's tables).
    Outbox(Box<(TableMapEvent<'static>, Mapping, usize)>),
    State,
    Other,
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
}

/// An XA transaction's identity as the server writes it: format id, gtrid and bqual.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Xid {
    pub format: i64,
    pub gtrid: Vec<u8>,
    pub bqual: Vec<u8>,
}

impl std::fmt::Display for Xid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex = |b: &[u8]| b.iter().map(|c| format!("{c:02x}")).collect::<String>();
        write!(
            f,
            "X'{}',X'{}',{}",
            hex(&self.gtrid),
            hex(&self.bqual),
            self.format
        )
    }
}

/// A prepared XA transaction whose outcome has not been read yet.
#[derive(Debug)]
struct PreparedXa {
    xid: Xid,
    rows: Vec<OutboxEvent>,
    bytes: usize,
    /// The position before its prepare group: a restart must read from there at the latest.
    floor: Checkpoint,
    file: String,
    pos: u64,
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
        *self = Decoder::new(outbox, file, gtid)
            .with_mysql_gtids(mysql_gtids)
            .with_limits(self.xa_limit, self.payload_limit);
        self.prepared = prepared;
    }

    /// While an XA transaction is prepared and its outcome not read, the position before its
    /// prepare (the oldest one's): a stored position must not pass it, or a restart would
    /// never see those rows again.
    pub fn held_checkpoint(&self) -> Option<&Checkpoint> {
        self.prepared.first().map(|p| &p.floor)
    }

    /// The XA transactions prepared but not yet committed or rolled back.
    pub fn prepared_xids(&self) -> Vec<&Xid> {
        self.prepared.iter().map(|p| &p.xid).collect()
    }

    pub fn in_txn(&self) -> bool {
        self.txn.is_some()
    }

    pub fn file(&self) -> &str {
        &self.file
    }

    /// The next events come from the start of binlog file `name` (the file source): table
    /// ids are only valid within one file.
    pub fn set_file(&mut self, name: &str) {
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
    pub fn with_mysql_gtids(mut self, set: Option<MysqlGtidSet>) -> Decoder {
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

    /// The events of `ev` one at a time when it is a TRANSACTION_PAYLOAD (`None` for any other
    /// event); feed each with [`Decoder::feed_inner`]. Refuses a payload that declares more
    /// than the limit before inflating anything.
    pub fn payload_events<'e>(&self, ev: &'e Event) -> Result<Option<PayloadEvents<'e>>, Error> {
        if ev.header().event_type_raw() != TRANSACTION_PAYLOAD {
            return Ok(None);
        }
        let (start, _) = span(ev);
        match PayloadEvents::open(ev, self.payload_limit) {
            Ok(p) => Ok(Some(p)),
            Err(PayloadError::TooLarge { declared, limit }) => Err(payload_too_large(
                &format!("{}:{start}", self.file),
                declared,
                limit,
            )),
            Err(PayloadError::Corrupt(m)) => Err(self.payload_err(start, m)),
        }
    }

    /// Feeds one event of the TRANSACTION_PAYLOAD `outer` (from [`Decoder::payload_events`]):
    /// it sits at the payload's place.
    pub fn feed_inner(&mut self, inner: &Event, outer: &Event) -> Result<Vec<Step>, Error> {
        let (start, end) = span(outer);
        if inner.header().event_type_raw() == TRANSACTION_PAYLOAD {
            return Err(self.payload_err(
                start,
                "a transaction payload inside a transaction payload".into(),
            ));
        }
        self.feed_at(inner, start, end)
    }

    /// A corrupt payload error, naming its position (the stream's `feed` path and the
    /// sources' streamed path say the same).
    pub fn payload_err(&self, start: u64, m: String) -> Error {
        Error::Decode(format!("transaction payload at {}:{start}: {m}", self.file))
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
            MARIA_GTID => {
                let g = gtid::parse_gtid_event(ev.data(), header.server_id()).ok_or_else(|| {
                    Error::Decode(format!("GTID event at {}:{start} is too short", self.file))
                })?;
                self.no_open_group(start, &mut steps)?;
                self.track_gtid = true;
                steps.push(self.begin(start, Some(g.gtid), !g.standalone, header.timestamp()));
                if ev.data()[12] & MARIA_FL_PREPARED_XA != 0 {
                    if let Some(txn) = self.txn.as_mut() {
                        txn.xa = true;
                    }
                }
            }
            MYSQL_GTID | MYSQL_ANONYMOUS_GTID | MYSQL_GTID_TAGGED => {
                let mysql_gtid = if kind == MYSQL_ANONYMOUS_GTID {
                    None
                } else {
                    let g: GtidEvent = ev
                        .read_event()
                        .map_err(|e| self.decode_err("GTID event", start, e))?;
                    let tag = g.tag().map(|t| t.to_string()).unwrap_or_default();
                    Some((g.sid(), tag.to_ascii_lowercase(), g.gno()))
                };
                self.no_open_group(start, &mut steps)?;
                steps.push(self.begin(start, None, false, header.timestamp()));
                if let Some(txn) = self.txn.as_mut() {
                    txn.mysql_gtid = mysql_gtid;
                }
            }
            MYSQL_PREVIOUS_GTIDS => {
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
                        set.add_interval(
                            sid.uuid(),
                            &tag.to_ascii_lowercase(),
                            iv.start(),
                            iv.end(),
                        );
                    }
                }
            }
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
                    return self.check_load_query(ev, start).map(|_| steps);
                };
                let text = q.query_raw();
                let verb = first_word(text);
                if verb.eq_ignore_ascii_case("XA") {
                    self.xa_statement(text, start, end, header.timestamp(), &mut steps)?;
                } else if verb.eq_ignore_ascii_case("BEGIN") {
                    match self.txn.as_mut() {
                        Some(txn) => txn.begun = true,
                        None => steps.push(self.begin(start, None, true, header.timestamp())),
                    }
                } else if verb.eq_ignore_ascii_case("COMMIT")
                    || (verb.eq_ignore_ascii_case("ROLLBACK") && skip_space(text).len() <= 9)
                {
                    steps.push(self.commit(end, header.timestamp()));
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
            }
            XID => {
                self.release_held(&mut steps);
                steps.push(self.commit(end, header.timestamp()));
            }
            XA_PREPARE => self.xa_prepare(ev, start, end, header.timestamp(), &mut steps)?,
            TABLE_MAP => {
                let tme: TableMapEvent<'_> = ev
                    .read_event()
                    .map_err(|e| self.decode_err("table map event", start, e))?;
                let id = tme.table_id();
                let kind = if let Some(i) = self.outbox.iter().position(|t| t.matches(&tme)) {
                    super::rows::table_map_fits(&tme)
                        .map_err(|m| self.decode_err("table map event", start, m))?;
                    let mapping = self.outbox[i].map(&tme)?;
                    TableKind::Outbox(Box::new((tme.into_owned(), mapping, i)))
                } else if tme.database_name_raw() == self.outbox[0].database.as_bytes()
                    && tme.table_name_raw() == STATE_TABLE.as_bytes()
                {
                    TableKind::State
                } else {
                    TableKind::Other
                };
                self.tables.insert(id, kind);
            }
            WRITE_ROWS_V1 | WRITE_ROWS | UPDATE_ROWS_V1 | UPDATE_ROWS | DELETE_ROWS_V1
            | DELETE_ROWS | PARTIAL_UPDATE_ROWS => {
                if self.txn.is_none() {
                    // Servers without GTIDs or BEGIN (very old ones) still bracket rows
                    // with XID: open the group here.
                    steps.push(self.begin(start, None, true, header.timestamp()));
                }
                let data = match ev.read_data() {
                    Ok(Some(mysql_common::binlog::events::EventData::RowsEvent(r))) => r,
                    Ok(_) => return Err(self.decode_err("rows event", start, "not a rows event")),
                    Err(e) => return Err(self.decode_err("rows event", start, e)),
                };
                let table_id = data.table_id();
                let txn = self.txn.as_mut().expect("opened above");
                match self.tables.get(&table_id) {
                    Some(TableKind::State) => txn.state_rows = true,
                    Some(TableKind::Outbox(outbox)) => {
                        let (tme, mapping, i) = &**outbox;
                        txn.other = true;
                        if let RowsEventData::WriteRowsEventV1(_)
                        | RowsEventData::WriteRowsEvent(_) = data
                        {
                            let events = decode_inserts(
                                &self.outbox[*i],
                                tme,
                                mapping,
                                &data,
                                &self.file,
                                txn,
                            )
                            .map_err(|e| match e {
                                Error::Decode(m) => Error::Decode(format!(
                                    "rows event at {}:{start}: {m}",
                                    self.file
                                )),
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
            }
            k if (MARIA_ROWS_COMPRESSED_FIRST..=MARIA_ROWS_COMPRESSED_LAST).contains(&k) => {
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
            }
            // Annotations, checkpoints, intvar/rand/user vars and the like.
            _ => {}
        }
        Ok(steps)
    }

    /// An XA statement in the binlog: `XA START` opens an XA group (MySQL; MariaDB flags its
    /// GTID event instead), `XA END` is part of it, and `XA COMMIT`/`XA ROLLBACK` of a prepared
    /// transaction end a group of their own, releasing or dropping the rows held for it.
    fn xa_statement(
        &mut self,
        text: &[u8],
        start: u64,
        end: u64,
        ts: u32,
        steps: &mut Vec<Step>,
    ) -> Result<(), Error> {
        let rest = skip_space(text);
        let rest = skip_space(&rest[2..]);
        let word = first_word(rest).to_ascii_uppercase();
        let args = &rest[word.len()..];
        match word.as_str() {
            "START" | "BEGIN" => {
                match self.txn.as_mut() {
                    Some(txn) => txn.begun = true,
                    None => steps.push(self.begin(start, None, true, ts)),
                }
                if let Some(txn) = self.txn.as_mut() {
                    txn.xa = true;
                }
            }
            "COMMIT" | "ROLLBACK" => {
                let xid = parse_xid(args).ok_or_else(|| {
                    self.decode_err(
                        "XA statement",
                        start,
                        format!(
                            "cannot read the XID of: {}",
                            String::from_utf8_lossy(text)
                                .chars()
                                .take(200)
                                .collect::<String>()
                        ),
                    )
                })?;
                if self.txn.is_none() {
                    steps.push(self.begin(start, None, true, ts));
                }
                let found = self.prepared.iter().position(|p| p.xid == xid);
                match (found, word.as_str()) {
                    (Some(i), "COMMIT") => {
                        let p = self.prepared.remove(i);
                        let txn = self.txn.as_mut().expect("opened above");
                        txn.other = true;
                        let mut rows = p.rows;
                        let gtid = match (&txn.gtid, &txn.mysql_gtid) {
                            (Some(g), _) => Some(g.to_string()),
                            (None, Some((uuid, tag, gno))) => {
                                Some(gtid::mysql_gtid_text(*uuid, tag, *gno))
                            }
                            (None, None) => None,
                        };
                        let committed_at = txn
                            .committed_at
                            .max(Utc.timestamp_opt(ts as i64, 0).single());
                        // The rows take the committing group's place: its file, its end
                        // (filled in by the driver), its own row numbers.
                        for e in &mut rows {
                            e.position = crate::event::SourcePosition::Binlog {
                                file: self.file.clone(),
                                end_pos: 0,
                                index: txn.index,
                            };
                            txn.index += 1;
                            if gtid.is_some() {
                                e.gtid = gtid.clone();
                            }
                            e.committed_at = committed_at;
                        }
                        tracing::debug!(xid = %xid, prepared = %format!("{}:{}", p.file, p.pos), rows = rows.len(), "XA transaction committed");
                        if !rows.is_empty() {
                            steps.push(Step::Rows(rows));
                        }
                    }
                    (Some(i), _) => {
                        let p = self.prepared.remove(i);
                        tracing::info!(xid = %xid, prepared = %format!("{}:{}", p.file, p.pos), rows = p.rows.len(), "XA transaction rolled back: its rows are not published");
                        if let Some(txn) = self.txn.as_mut() {
                            txn.other = true;
                        }
                    }
                    (None, verb) => {
                        // Prepared before the stream's start (a first start, or a position
                        // moved by hand): its rows were never read here.
                        tracing::warn!(xid = %xid, at = %format!("{}:{start}", self.file), "XA {verb} of a transaction whose prepare was not read (it was prepared before this relay's start position): none of its rows are published");
                        if let Some(txn) = self.txn.as_mut() {
                            txn.other = true;
                        }
                    }
                }
                steps.push(self.commit(end, ts));
            }
            // XA END, XA RECOVER and the like: part of the open group.
            _ => {
                if let Some(txn) = self.txn.as_mut() {
                    txn.other = true;
                }
            }
        }
        Ok(())
    }

    /// `XA PREPARE` ends an XA group: one-phase (MySQL's `XA COMMIT … ONE PHASE`) commits it;
    /// otherwise its rows are held until its `XA COMMIT`, and the group counts as one without
    /// outbox rows.
    fn xa_prepare(
        &mut self,
        ev: &Event,
        start: u64,
        end: u64,
        ts: u32,
        steps: &mut Vec<Step>,
    ) -> Result<(), Error> {
        let (one_phase, xid) = parse_xa_prepare(ev.data())
            .ok_or_else(|| self.decode_err("XA PREPARE event", start, "corrupt XID"))?;
        if one_phase {
            self.release_held(steps);
            steps.push(self.commit(end, ts));
            return Ok(());
        }
        // Computed before the commit applies this group's GTID: the state at its start.
        let gtid_state = self.gtid_text();
        let Some(txn) = self.txn.as_mut() else {
            return Ok(());
        };
        if !txn.xa && txn.index > 0 {
            return Err(self.decode_err(
                "XA PREPARE event",
                start,
                "outbox rows of this group were read as an ordinary transaction's (the group did not start as an XA transaction)",
            ));
        }
        let rows = std::mem::take(&mut txn.held);
        let bytes = std::mem::take(&mut txn.held_bytes);
        txn.index = 0;
        txn.other = true;
        let floor = Checkpoint::Binlog {
            file: txn.start_file.clone(),
            pos: txn.start_pos,
            gtid_state,
        };
        let (file, pos) = (txn.start_file.clone(), txn.start_pos);
        if let Some(i) = self.prepared.iter().position(|p| p.xid == xid) {
            tracing::warn!(xid = %xid, "an XA transaction was prepared again before its outcome was read; the earlier prepare's rows are replaced");
            self.prepared.remove(i);
        }
        tracing::debug!(xid = %xid, rows = rows.len(), at = %format!("{file}:{pos}"), "XA transaction prepared: its rows wait for its XA COMMIT");
        self.prepared.push(PreparedXa {
            xid,
            rows,
            bytes,
            floor,
            file,
            pos,
        });
        steps.push(self.commit(end, ts));
        Ok(())
    }

    /// The rows an XA group held, handed out before its one-phase commit.
    fn release_held(&mut self, steps: &mut Vec<Step>) {
        if let Some(txn) = self.txn.as_mut() {
            let rows = std::mem::take(&mut txn.held);
            txn.held_bytes = 0;
            if !rows.is_empty() {
                steps.push(Step::Rows(rows));
            }
        }
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

    fn decode_err(&self, what: &str, pos: u64, e: impl std::fmt::Display) -> Error {
        Error::Decode(format!("{what} at {}:{pos}: {e}", self.file))
    }

    /// A statement-based INSERT/REPLACE into the outbox table: its rows are not in the log.
    fn check_statement(&self, q: &QueryEvent<'_>) -> Result<(), Error> {
        let text = q.query_raw();
        if let Some((db, table)) = insert_target(text) {
            let db = db.unwrap_or_else(|| q.schema().into_owned());
            if let Some(t) = self
                .outbox
                .iter()
                .find(|t| db == t.database && table == t.table)
            {
                return Err(statement_insert(t, &String::from_utf8_lossy(text)));
            }
        }
        Ok(())
    }

    fn check_load_query(&self, ev: &Event, _start: u64) -> Result<(), Error> {
        // LOAD DATA in statement format: look for the table name in the text.
        let text = String::from_utf8_lossy(ev.data());
        let lower = text.to_ascii_lowercase();
        if !lower.contains("load data") {
            return Ok(());
        }
        if let Some(t) = self
            .outbox
            .iter()
            .find(|t| lower.contains(&t.table.to_ascii_lowercase()))
        {
            return Err(statement_insert(t, &text));
        }
        Ok(())
    }
}

/// Why a TRANSACTION_PAYLOAD cannot be read.
#[derive(Debug)]
pub enum PayloadError {
    /// It declares more uncompressed bytes than the limit (`--max-txn-payload-bytes`).
    TooLarge { declared: u64, limit: u64 },
    /// Its header or contents are corrupt (the message says how).
    Corrupt(String),
}

impl std::fmt::Display for PayloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayloadError::TooLarge { declared, limit } => write!(
                f,
                "it declares {declared} uncompressed bytes, more than --max-txn-payload-bytes ({limit})"
            ),
            PayloadError::Corrupt(m) => f.write_str(m),
        }
    }
}

impl From<String> for PayloadError {
    fn from(m: String) -> Self {
        PayloadError::Corrupt(m)
    }
}

impl From<&str> for PayloadError {
    fn from(m: &str) -> Self {
        PayloadError::Corrupt(m.to_string())
    }
}

/// The events wrapped in one TRANSACTION_PAYLOAD event, inflated (zstd or none) and framed one
/// at a time with the same checks as a file's events (they carry no checksums): memory holds
/// the event being framed and zstd's window (at most 128 MiB, zstd's default decoder limit),
/// never the whole transaction. Nothing past the payload's declared uncompressed size is
/// inflated, and a declared size above the limit is refused before anything is.
///
/// The payload header is read here, not by `mysql_common`: its parser unwraps an unknown
/// compression type and skips unknown fields by their claimed length, and either panics on
/// corrupt input. The header is fields of (type, length, value) as length-encoded integers:
/// 1 payload size, 2 compression type (0 zstd, 255 none), 3 uncompressed size; 0 ends it and
/// the payload follows.
pub struct PayloadEvents<'a> {
    reader: mysql_common::binlog::events::TransactionPayloadReader<'a>,
    fde: mysql_common::binlog::events::FormatDescriptionEvent<'static>,
    declared: u64,
    /// Declared bytes not framed yet.
    left: u64,
}

impl<'a> PayloadEvents<'a> {
    /// Reads the header of the payload event `ev`.
    pub fn open(ev: &'a Event, limit: u64) -> Result<PayloadEvents<'a>, PayloadError> {
        use mysql_common::binlog::events::TransactionPayloadReader;
        let mut b = ev.data();
        let (mut size, mut algorithm, mut declared) = (None, None, None);
        loop {
            let field = lenenc(&mut b).ok_or("truncated header")?;
            if field == 0 {
                break;
            }
            let len = lenenc(&mut b).ok_or("truncated header")?;
            let len = usize::try_from(len).map_err(|_| "corrupt header")?;
            if len > b.len() {
                return Err(
                    format!("header field {field} claims {len} bytes, {} left", b.len()).into(),
                );
            }
            let (mut value, rest) = b.split_at(len);
            b = rest;
            match field {
                1 => size = Some(lenenc(&mut value).ok_or("corrupt payload size")?),
                2 => algorithm = Some(lenenc(&mut value).ok_or("corrupt compression type")?),
                3 => declared = Some(lenenc(&mut value).ok_or("corrupt uncompressed size")?),
                _ => {}
            }
        }
        let size = size.ok_or("no payload size in the header")?;
        if size != b.len() as u64 {
            return Err(format!("it claims {size} payload bytes, it holds {}", b.len()).into());
        }
        let declared = match (algorithm, declared) {
            (Some(255), None) => b.len() as u64,
            (_, Some(d)) => d,
            (Some(0), None) => return Err("no uncompressed size in the header".into()),
            (_, None) => 0,
        };
        if declared > limit {
            return Err(PayloadError::TooLarge { declared, limit });
        }
        let reader = match algorithm {
            Some(0) => TransactionPayloadReader::new_zstd(b)
                .map_err(|e| format!("cannot decompress: {e}"))?,
            Some(255) => TransactionPayloadReader::new_uncompressed(b),
            Some(other) => return Err(format!("unknown compression type {other}").into()),
            None => return Err("no compression type in the header".into()),
        };
        let mut fde = ev.fde().clone().into_owned();
        let mut footer = fde.footer();
        footer.set_checksum_enabled(false);
        fde = fde.with_footer(footer);
        Ok(PayloadEvents {
            reader,
            fde,
            declared,
            left: declared,
        })
    }

    /// The uncompressed size the payload declares.
    pub fn declared(&self) -> u64 {
        self.declared
    }

    /// The next event of the payload; `None` after the last. An error says what is wrong and
    /// at which offset of the unpacked payload.
    pub fn next_event(&mut self) -> Result<Option<Event>, String> {
        use std::io::Read;
        let at = self.declared - self.left;
        let inflate = |e: std::io::Error| format!("cannot decompress (at offset {at}): {e}");
        if self.left == 0 {
            let mut probe = [0u8; 1];
            return match self.reader.read(&mut probe).map_err(inflate)? {
                0 => Ok(None),
                _ => Err(format!(
                    "it holds more than the {} uncompressed bytes it declares",
                    self.declared
                )),
            };
        }
        let short = |got: u64| {
            format!(
                "it declares {} uncompressed bytes but holds {}",
                self.declared,
                at + got
            )
        };
        const HEADER: usize = 19;
        if self.left < HEADER as u64 {
            return Err(format!(
                "event at offset {at} of the unpacked payload: truncated: {} bytes left, an event header needs {HEADER}",
                self.left
            ));
        }
        let mut header = [0u8; HEADER];
        read_full(&mut self.reader, &mut header)
            .map_err(inflate)?
            .map_err(|got| short(got as u64))?;
        let size = u32::from_le_bytes(header[9..13].try_into().expect("4 bytes")) as u64;
        if size < HEADER as u64 || size > self.left {
            return Err(format!(
                "event at offset {at} of the unpacked payload: it claims {size} bytes, {} are left of the declared size",
                self.left
            ));
        }
        if header[4] == TRANSACTION_PAYLOAD {
            return Err("a transaction payload inside a transaction payload".into());
        }
        let mut raw = vec![0u8; size as usize];
        raw[..HEADER].copy_from_slice(&header);
        read_full(&mut self.reader, &mut raw[HEADER..])
            .map_err(inflate)?
            .map_err(|got| short((HEADER + got) as u64))?;
        self.left -= size;
        let mut framer = super::file::EventFramer::embedded(&raw, &self.fde);
        match framer.next_event() {
            Ok(Some((_, e))) => Ok(Some(e)),
            Ok(None) => unreachable!("a non-empty buffer"),
            Err((_, m)) => Err(format!("event at offset {at} of the unpacked payload: {m}")),
        }
    }
}

/// Fills `buf` from `r`; `Ok(Err(n))` when the input ended after `n` bytes.
fn read_full(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<Result<(), usize>> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Ok(Err(got)),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Ok(()))
}

/// Every event of a TRANSACTION_PAYLOAD at once (tests and fuzzing; the sources stream them
/// with [`PayloadEvents`]).
pub fn unpack_payload(ev: &Event, limit: u64) -> Result<Vec<Event>, PayloadError> {
    let mut p = PayloadEvents::open(ev, limit)?;
    let mut out = Vec::new();
    while let Some(e) = p.next_event()? {
        out.push(e);
    }
    Ok(out)
}

/// The error for a payload that declares more than the limit.
pub fn payload_too_large(where_: &str, declared: u64, limit: u64) -> Error {
    Error::config(
        format!(
            "the compressed transaction (TRANSACTION_PAYLOAD) at {where_} declares {declared} uncompressed bytes, more than --max-txn-payload-bytes ({limit})"
        ),
        format!(
            "raise --max-txn-payload-bytes above {declared} (e.g. --max-txn-payload-bytes {}) if the server really writes transactions that large",
            declared.next_power_of_two()
        ),
    )
}

/// The body of an XA_PREPARE event (both servers): one-phase flag (1 byte), format id (4),
/// gtrid length (4), bqual length (4), then gtrid and bqual (at most 64 bytes each).
fn parse_xa_prepare(data: &[u8]) -> Option<(bool, Xid)> {
    let one_phase = *data.first()? != 0;
    let int = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?))
    };
    let format = int(1)? as i32 as i64;
    let (g, b) = (int(5)? as usize, int(9)? as usize);
    if g > 64 || b > 64 {
        return None;
    }
    let body = data.get(13..13 + g + b)?;
    Some((
        one_phase,
        Xid {
            format,
            gtrid: body[..g].to_vec(),
            bqual: body[g..].to_vec(),
        },
    ))
}

/// The XID of an `XA COMMIT`/`XA ROLLBACK` statement's text after the verb: `gtrid [, bqual
/// [, format]]`, each string as the servers write it (`X'hex'`) or as typed (`'text'`,
/// `0xhex`); `ONE PHASE` may follow.
pub fn parse_xid(args: &[u8]) -> Option<Xid> {
    fn unhex(h: &[u8]) -> Option<Vec<u8>> {
        if !h.len().is_multiple_of(2) {
            return None;
        }
        h.chunks(2)
            .map(|c| u8::from_str_radix(std::str::from_utf8(c).ok()?, 16).ok())
            .collect()
    }
    fn string(s: &mut &[u8]) -> Option<Vec<u8>> {
        *s = skip_space(s);
        if s.len() >= 2 && (s[0] == b'X' || s[0] == b'x') && s[1] == b'\'' {
            let close = s[2..].iter().position(|&c| c == b'\'')? + 2;
            let v = unhex(&s[2..close])?;
            *s = &s[close + 1..];
            Some(v)
        } else if s.len() >= 2 && s[0] == b'0' && (s[1] == b'x' || s[1] == b'X') {
            let end = s[2..]
                .iter()
                .position(|c| !c.is_ascii_hexdigit())
                .map_or(s.len(), |e| e + 2);
            let v = unhex(&s[2..end])?;
            *s = &s[end..];
            Some(v)
        } else if let Some(&q) = s.first().filter(|&&c| c == b'\'' || c == b'"') {
            let mut out = Vec::new();
            let mut i = 1;
            while i < s.len() {
                match s[i] {
                    c if c == q && s.get(i + 1) == Some(&q) => {
                        out.push(q);
                        i += 2;
                    }
                    c if c == q => {
                        *s = &s[i + 1..];
                        return Some(out);
                    }
                    b'\\' if i + 1 < s.len() => {
                        out.push(s[i + 1]);
                        i += 2;
                    }
                    c => {
                        out.push(c);
                        i += 1;
                    }
                }
            }
            None
        } else {
            None
        }
    }
    fn comma(s: &mut &[u8]) -> bool {
        *s = skip_space(s);
        if s.first() == Some(&b',') {
            *s = &s[1..];
            true
        } else {
            false
        }
    }
    let mut s = args;
    let gtrid = string(&mut s)?;
    let mut bqual = Vec::new();
    let mut format = 1i64;
    if comma(&mut s) {
        bqual = string(&mut s)?;
        if comma(&mut s) {
            s = skip_space(s);
            let end = s
                .iter()
                .position(|c| !(c.is_ascii_digit() || *c == b'-'))
                .unwrap_or(s.len());
            format = std::str::from_utf8(&s[..end]).ok()?.parse().ok()?;
            s = &s[end..];
        }
    }
    let rest = String::from_utf8_lossy(skip_space(s)).to_ascii_uppercase();
    let rest = rest.trim_end_matches(|c: char| c == ';' || c.is_whitespace());
    if !(rest.is_empty() || rest.split_whitespace().eq(["ONE", "PHASE"])) {
        return None;
    }
    Some(Xid {
        format,
        gtrid,
        bqual,
    })
}

fn xa_too_large(file: &str, pos: u64, bytes: usize, limit: usize) -> Error {
    Error::config(
        format!(
            "XA transactions hold {bytes} bytes of outbox rows between their XA PREPARE and XA COMMIT (the one at {file}:{pos} among them), more than --txn-buffer ({limit} bytes): prepared rows are kept in memory until their commit"
        ),
        format!(
            "raise --txn-buffer above {bytes} (e.g. --txn-buffer {})",
            bytes.next_power_of_two()
        ),
    )
}

/// Where an event sits in its file: `start..end`.
pub fn span(ev: &Event) -> (u64, u64) {
    let header = ev.header();
    let end = header.log_pos() as u64;
    (end.saturating_sub(header.event_size() as u64), end)
}

/// A MySQL length-encoded integer, consumed from `b`.
fn lenenc(b: &mut &[u8]) -> Option<u64> {
    let (&first, rest) = b.split_first()?;
    let n = match first {
        0..=0xfa => {
            *b = rest;
            return Some(first as u64);
        }
        0xfc => 2,
        0xfd => 3,
        0xfe => 8,
        _ => return None,
    };
    if rest.len() < n {
        return None;
    }
    let mut raw = [0u8; 8];
    raw[..n].copy_from_slice(&rest[..n]);
    *b = &rest[n..];
    Some(u64::from_le_bytes(raw))
}

fn compressed_binlog() -> Error {
    Error::config(
        "the binlog is compressed (log_bin_compress=ON): outbox rows in compressed events cannot be read",
        "SET GLOBAL log_bin_compress = OFF; and remove log_bin_compress from the server's option file",
    )
}

fn statement_insert(table: &OutboxTable, text: &str) -> Error {
    let mut shown: String = text.chars().take(200).collect();
    if shown.len() < text.len() {
        shown.push('…');
    }
    Error::config(
        format!(
            "a statement-based INSERT into {} is in the binlog (a session ran binlog_format=STATEMENT or MIXED): its rows are not in the log, so the relay cannot publish them: {shown}",
            table.quoted()
        ),
        "SET GLOBAL binlog_format = ROW; set binlog_format=ROW in the server's option file and in any session that overrides it; \
         then publish that statement's rows by hand and move past it with `outboxd offset set`",
    )
}

fn decode_inserts(
    table: &OutboxTable,
    tme: &TableMapEvent<'static>,
    mapping: &Mapping,
    data: &RowsEventData<'_>,
    file: &str,
    txn: &mut Txn,
) -> Result<Vec<OutboxEvent>, Error> {
    let present = data
        .columns_after_image()
        .ok_or_else(|| Error::Decode("write rows event without an after image".into()))?;
    mapping.check_image(present, table)?;
    let mut out = Vec::new();
    for row in guarded_rows(data, tme)? {
        let (_, after) = row;
        let Some(after) = after else {
            return Err(Error::Decode("write rows event row without values".into()));
        };
        let event = mapping.event(
            &after,
            present,
            RowContext {
                file,
                index: txn.index,
                gtid: match (&txn.gtid, &txn.mysql_gtid) {
                    (Some(g), _) => Some(g.to_string()),
                    (None, Some((uuid, tag, gno))) => Some(gtid::mysql_gtid_text(*uuid, tag, *gno)),
                    (None, None) => None,
                },
                committed_at: txn.committed_at,
            },
            table.tz,
        );
        txn.index += 1;
        out.push(event);
    }
    Ok(out)
}

type RowImages = (
    Option<mysql_common::binlog::row::BinlogRow>,
    Option<mysql_common::binlog::row::BinlogRow>,
);

/// Every row of a rows event, decoded by `mysql_common`. The table map was checked
/// ([`super::rows::table_map_fits`]) and the image holds the mapped columns, but its value
/// decoders still index and subtract unchecked on corrupt bytes (a DECIMAL whose scale
/// exceeds its precision, …; found by tests/mysql_file.rs mutating binlog files). As the last
/// resort — and only here — a panic inside it becomes a decode error instead of a crash.
fn guarded_rows(
    data: &RowsEventData<'_>,
    tme: &TableMapEvent<'static>,
) -> Result<Vec<RowImages>, Error> {
    let decode = || -> Result<Vec<RowImages>, Error> {
        data.rows(tme)
            .map(|r| r.map_err(|e| Error::Decode(e.to_string())))
            .collect()
    };
    GUARDED.with(|g| g.set(true));
    let rows = std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode));
    GUARDED.with(|g| g.set(false));
    rows.unwrap_or_else(|_| {
        Err(Error::Decode(
            "the rows event cannot be decoded (corrupt row data: the decoder panicked)".into(),
        ))
    })
}

thread_local! {
    /// Set while [`guarded_rows`] decodes: a panic then is caught there. The fuzz targets'
    /// panic hook reads it, so that only panics nothing catches count as findings.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside the guarded row decoding (see [`guarded_rows`]).
pub fn in_guarded_rows() -> bool {
    GUARDED.with(|g| g.get())
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

/// The first keyword of a statement, after whitespace and comments.
fn first_word(text: &[u8]) -> &str {
    let rest = skip_space(text);
    let end = rest
        .iter()
        .position(|c| !c.is_ascii_alphabetic())
        .unwrap_or(rest.len());
    std::str::from_utf8(&rest[..end]).unwrap_or("")
}

fn skip_space(mut s: &[u8]) -> &[u8] {
    loop {
        while let Some((c, rest)) = s.split_first() {
            if c.is_ascii_whitespace() {
                s = rest;
            } else {
                break;
            }
        }
        if s.starts_with(b"/*") && !s.starts_with(b"/*!") && !s.starts_with(b"/*M!") {
            match s.windows(2).position(|w| w == b"*/") {
                Some(i) => s = &s[i + 2..],
                None => return &[],
            }
        } else if s.starts_with(b"/*!") || s.starts_with(b"/*M!") {
            // Versioned comments hold real SQL: skip only the opener and version digits.
            s = &s[if s.starts_with(b"/*M!") { 4 } else { 3 }..];
            while let Some((c, rest)) = s.split_first() {
                if c.is_ascii_digit() {
                    s = rest;
                } else {
                    break;
                }
            }
        } else if s.starts_with(b"-- ") || s.starts_with(b"#") {
            match s.iter().position(|&c| c == b'\n') {
                Some(i) => s = &s[i + 1..],
                None => return &[],
            }
        } else {
            return s;
        }
    }
}

/// The target table of an `INSERT`/`REPLACE` statement: `(database, table)`.
pub fn insert_target(text: &[u8]) -> Option<(Option<String>, String)> {
    let mut s = skip_space(text);
    let word = |s: &mut &[u8]| -> Option<String> {
        *s = skip_space(s);
        let end = s
            .iter()
            .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
            .unwrap_or(s.len());
        if end == 0 {
            return None;
        }
        let w = String::from_utf8_lossy(&s[..end]).to_ascii_uppercase();
        *s = &s[end..];
        Some(w)
    };
    let verb = word(&mut s)?;
    if verb != "INSERT" && verb != "REPLACE" {
        return None;
    }
    // Modifiers and INTO, then the table name.
    loop {
        let save = s;
        match word(&mut s).as_deref() {
            Some("LOW_PRIORITY" | "DELAYED" | "HIGH_PRIORITY" | "IGNORE" | "INTO") => continue,
            _ => {
                s = save;
                break;
            }
        }
    }
    let first = ident(&mut s)?;
    if s.first() == Some(&b'.') {
        s = &s[1..];
        let second = ident(&mut s)?;
        Some((Some(first), second))
    } else {
        Some((None, first))
    }
}

fn ident(s: &mut &[u8]) -> Option<String> {
    *s = skip_space(s);
    if s.first() == Some(&b'`') {
        let mut out = Vec::new();
        let mut i = 1;
        while i < s.len() {
            if s[i] == b'`' {
                if s.get(i + 1) == Some(&b'`') {
                    out.push(b'`');
                    i += 2;
                    continue;
                }
                *s = &s[i + 1..];
                return String::from_utf8(out).ok();
            }
            out.push(s[i]);
            i += 1;
        }
        None
    } else {
        let end = s
            .iter()
            .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_' || *c == b'$' || *c >= 0x80))
            .unwrap_or(s.len());
        if end == 0 {
            return None;
        }
        let w = String::from_utf8(s[..end].to_vec()).ok();
        *s = &s[end..];
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statement_targets() {
        let t = |s: &str| insert_target(s.as_bytes());
        assert_eq!(
            t("INSERT INTO outbox VALUES (1)"),
            Some((None, "outbox".into()))
        );
        assert_eq!(
            t("  /* c */ insert low_priority ignore into `app`.`out``box` (id) values (1)"),
            Some((Some("app".into()), "out`box".into()))
        );
        assert_eq!(
            t("REPLACE app.outbox SET id = 1"),
            Some((Some("app".into()), "outbox".into()))
        );
        assert_eq!(
            t("INSERT INTO other SELECT * FROM outbox"),
            Some((None, "other".into()))
        );
        assert_eq!(t("UPDATE outbox SET status = 'published'"), None);
        assert_eq!(t("CREATE TABLE outbox (id int)"), None);
        assert_eq!(first_word(b"  BEGIN"), "BEGIN");
        assert_eq!(first_word(b"/* x */COMMIT"), "COMMIT");
    }
}
