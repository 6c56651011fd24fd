//! XA transactions in the binlog: their identity (`Xid`), the rows held from `XA PREPARE`
//! until the group that commits them, and the `XA` statements and XA_PREPARE events that
//! decide what becomes of those rows.

use super::statement::{first_word, skip_space};
use super::{Decoder, Step};
use crate::event::{Checkpoint, OutboxEvent};
use crate::source::mysql::gtid;
use crate::Error;
use chrono::{DateTime, TimeZone, Utc};
use mysql_common::binlog::events::Event;

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
pub(super) struct PreparedXa {
    pub(super) xid: Xid,
    pub(super) rows: Vec<OutboxEvent>,
    pub(super) bytes: usize,
    /// The position before its prepare group: a restart must read from there at the latest.
    pub(super) floor: Checkpoint,
    pub(super) file: String,
    pub(super) pos: u64,
    /// When the server prepared it (its prepare event's time, whole seconds): a restart that
    /// reads the prepare again knows its age.
    pub(super) prepared_at: DateTime<Utc>,
    /// Given up (`--xa-prepare-expired release`): it no longer holds the position back. Its
    /// rows are still published if its XA COMMIT is read before this process ends.
    pub(super) released: bool,
}

impl PreparedXa {
    /// Whether it holds the stored position back: only one that holds outbox rows (one that
    /// wrote only other tables can publish nothing, whatever its outcome) and was not given up.
    pub(super) fn pins(&self) -> bool {
        !self.rows.is_empty() && !self.released
    }
}

/// A prepared XA transaction that holds the stored position back, as the source reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XaPin {
    pub xid: Xid,
    pub prepared_at: DateTime<Utc>,
    /// The position before its prepare group (where the stored position stays).
    pub floor: Checkpoint,
    /// The outbox rows it holds.
    pub rows: usize,
}

impl Decoder {
    /// For the source's in-process tests: an XA transaction with `rows` outbox rows, prepared
    /// at `pos` `age_s` seconds ago and not ended (as a prepare event read earlier leaves it).
    #[cfg(test)]
    pub(crate) fn hold_prepared(&mut self, gtrid: &str, pos: u64, rows: usize, age_s: i64) {
        self.prepared.push(tests::prepared(gtrid, pos, rows, age_s));
    }

    /// An XA statement in the binlog: `XA START` opens an XA group (MySQL; MariaDB flags its
    /// GTID event instead), `XA END` is part of it, and `XA COMMIT`/`XA ROLLBACK` of a prepared
    /// transaction end a group of their own, releasing or dropping the rows held for it.
    pub(super) fn xa_statement(
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
    pub(super) fn xa_prepare(
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
            prepared_at: Utc
                .timestamp_opt(ts as i64, 0)
                .single()
                .unwrap_or_else(Utc::now),
            released: false,
        });
        steps.push(self.commit(end, ts));
        Ok(())
    }

    /// The prepared XA transactions that hold the stored position back, oldest first.
    pub fn pins(&self) -> Vec<XaPin> {
        self.prepared
            .iter()
            .filter(|p| p.pins())
            .map(|p| XaPin {
                xid: p.xid.clone(),
                prepared_at: p.prepared_at,
                floor: p.floor.clone(),
                rows: p.rows.len(),
            })
            .collect()
    }

    /// Stops holding the position back for the transactions prepared before `cutoff`
    /// (`--xa-prepare-expired release`); returns them. Their rows stay here: a commit read
    /// before this process ends still publishes them.
    pub fn release_prepared_before(&mut self, cutoff: DateTime<Utc>) -> Vec<XaPin> {
        let mut out = Vec::new();
        for p in self.prepared.iter_mut() {
            if p.pins() && p.prepared_at < cutoff {
                p.released = true;
                out.push(XaPin {
                    xid: p.xid.clone(),
                    prepared_at: p.prepared_at,
                    floor: p.floor.clone(),
                    rows: p.rows.len(),
                });
            }
        }
        out
    }

    /// The rows an XA group held, handed out before its one-phase commit.
    pub(super) fn release_held(&mut self, steps: &mut Vec<Step>) {
        if let Some(txn) = self.txn.as_mut() {
            let rows = std::mem::take(&mut txn.held);
            txn.held_bytes = 0;
            if !rows.is_empty() {
                steps.push(Step::Rows(rows));
            }
        }
    }
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

pub(super) fn xa_too_large(file: &str, pos: u64, bytes: usize, limit: usize) -> Error {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::ColumnMap;
    use crate::source::mysql::rows::{OutboxTable, SourceTz};

    fn decoder() -> Decoder {
        let table = OutboxTable {
            database: "db".into(),
            table: "outbox".into(),
            columns: ColumnMap::default(),
            tz: SourceTz::Utc,
            label: None,
        };
        Decoder::new(vec![table], "bin.000001", None)
    }

    pub(super) fn prepared(gtrid: &str, pos: u64, rows: usize, age_s: i64) -> PreparedXa {
        PreparedXa {
            xid: Xid {
                format: 1,
                gtrid: gtrid.as_bytes().to_vec(),
                bqual: Vec::new(),
            },
            rows: (0..rows).map(|_| crate::sink::test_event()).collect(),
            bytes: 0,
            floor: Checkpoint::Binlog {
                file: "bin.000001".into(),
                pos,
                gtid_state: None,
            },
            file: "bin.000001".into(),
            pos,
            prepared_at: Utc::now() - chrono::Duration::seconds(age_s),
            released: false,
        }
    }

    fn held_pos(dec: &Decoder) -> Option<u64> {
        match dec.held_checkpoint()? {
            Checkpoint::Binlog { pos, .. } => Some(*pos),
            _ => None,
        }
    }

    #[test]
    fn only_prepares_with_outbox_rows_hold_the_position_and_release_moves_it_forward() {
        let mut dec = decoder();
        // Oldest first: one without outbox rows, then two with.
        dec.prepared.push(prepared("other", 100, 0, 7200));
        dec.prepared.push(prepared("old", 200, 2, 3600));
        dec.prepared.push(prepared("new", 300, 1, 5));
        assert_eq!(
            held_pos(&dec),
            Some(200),
            "the rowless prepare holds nothing"
        );
        let pins = dec.pins();
        assert_eq!(pins.len(), 2);
        assert_eq!(pins[0].xid.gtrid, b"old");
        assert_eq!(pins[0].rows, 2);

        // Prepared more than a minute ago: only "old" is given up; the position moves to "new".
        let given_up = dec.release_prepared_before(Utc::now() - chrono::Duration::seconds(60));
        assert_eq!(given_up.len(), 1);
        assert_eq!(given_up[0].xid.gtrid, b"old");
        assert_eq!(held_pos(&dec), Some(300));
        assert!(
            dec.release_prepared_before(Utc::now() - chrono::Duration::seconds(60))
                .is_empty(),
            "given up once"
        );
        // Its rows are kept: a commit read in this process still publishes them.
        assert_eq!(
            dec.prepared
                .iter()
                .find(|p| p.xid.gtrid == b"old")
                .unwrap()
                .rows
                .len(),
            2
        );
        dec.release_prepared_before(Utc::now());
        assert_eq!(held_pos(&dec), None);
        assert!(dec.pins().is_empty());
    }
}
