//! Global transaction ids of both flavours. MariaDB: `mysql_common` does not parse MariaDB's
//! GTID (162) and GTID_LIST (163) events, so their bytes are read here; [`GtidState`] is the
//! server's position in every replication domain (`0-1-6,1-2-40`), the form
//! `@@gtid_binlog_pos`, `BINLOG_GTID_POS()` and `@slave_connect_state` use. MySQL: a
//! [`MysqlGtidSet`] is the executed GTID set (`uuid:1-5:7,uuid:tag:1-3`), built from a file's
//! Previous_gtids event plus every GTID event after it, and sent with `COM_BINLOG_DUMP_GTID`.

use std::collections::BTreeMap;
use std::fmt;

/// One MariaDB GTID: `domain-server-sequence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gtid {
    pub domain: u32,
    pub server: u32,
    pub seq: u64,
}

impl fmt::Display for Gtid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}-{}", self.domain, self.server, self.seq)
    }
}

impl Gtid {
    pub fn parse(s: &str) -> Option<Gtid> {
        let mut parts = s.trim().splitn(3, '-');
        let domain = parts.next()?.parse().ok()?;
        let server = parts.next()?.parse().ok()?;
        let seq = parts.next()?.parse().ok()?;
        Some(Gtid {
            domain,
            server,
            seq,
        })
    }
}

/// GTID event flags (MariaDB `Gtid_log_event::flags2`).
pub(crate) const FL_STANDALONE: u8 = 1;

/// A MariaDB GTID event (type 162): starts an event group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GtidEvent {
    pub gtid: Gtid,
    /// The group is one statement without BEGIN/COMMIT (DDL): it ends after its next event.
    pub(crate) standalone: bool,
}

/// Parses the body of a MariaDB GTID event (after the common header, without checksum):
/// `seq_no` u64 LE, `domain_id` u32 LE, `flags2` u8, then optional fields we do not need.
/// The server id comes from the event header.
pub(crate) fn parse_gtid_event(data: &[u8], server_id: u32) -> Option<GtidEvent> {
    if data.len() < 13 {
        return None;
    }
    let seq = u64::from_le_bytes(data[0..8].try_into().ok()?);
    let domain = u32::from_le_bytes(data[8..12].try_into().ok()?);
    let flags = data[12];
    Some(GtidEvent {
        gtid: Gtid {
            domain,
            server: server_id,
            seq,
        },
        standalone: flags & FL_STANDALONE != 0,
    })
}

/// Parses the body of a MariaDB GTID_LIST event (type 163): a count (low 28 bits) and that many
/// `domain` u32, `server` u32, `seq` u64, all little endian.
pub(crate) fn parse_gtid_list(data: &[u8]) -> Option<Vec<Gtid>> {
    if data.len() < 4 {
        return None;
    }
    let count = (u32::from_le_bytes(data[0..4].try_into().ok()?) & 0x0fff_ffff) as usize;
    let body = &data[4..];
    if body.len() < count.checked_mul(16)? {
        return None;
    }
    Some(
        body.chunks_exact(16)
            .take(count)
            .map(|c| Gtid {
                domain: u32::from_le_bytes(c[0..4].try_into().expect("4 bytes")),
                server: u32::from_le_bytes(c[4..8].try_into().expect("4 bytes")),
                seq: u64::from_le_bytes(c[8..16].try_into().expect("8 bytes")),
            })
            .collect(),
    )
}

/// The position in every domain: the last GTID applied per domain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GtidState {
    domains: BTreeMap<u32, Gtid>,
}

impl GtidState {
    /// Parses `0-1-6,1-2-40` (spaces and newlines allowed, as the server prints long lists).
    /// An empty string is the empty state.
    pub fn parse(s: &str) -> Option<GtidState> {
        let mut state = GtidState::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let g = Gtid::parse(part)?;
            state.domains.insert(g.domain, g);
        }
        Some(state)
    }

    pub fn is_empty(&self) -> bool {
        self.domains.is_empty()
    }

    /// Records a transaction's GTID.
    pub fn apply(&mut self, g: Gtid) {
        self.domains.insert(g.domain, g);
    }

    /// The state from a GTID_LIST event (a binlog file's starting state). The list may name
    /// several servers per domain; the highest sequence number is the domain's position.
    pub(crate) fn from_list(list: &[Gtid]) -> GtidState {
        let mut state = GtidState::default();
        for g in list {
            match state.domains.get(&g.domain) {
                Some(cur) if cur.seq >= g.seq => {}
                _ => {
                    state.domains.insert(g.domain, *g);
                }
            }
        }
        state
    }

    pub fn get(&self, domain: u32) -> Option<Gtid> {
        self.domains.get(&domain).copied()
    }

    /// The last GTID of every domain, by domain.
    pub(crate) fn domains(&self) -> impl Iterator<Item = Gtid> + '_ {
        self.domains.values().copied()
    }
}

impl fmt::Display for GtidState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for g in self.domains.values() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{g}")?;
        }
        Ok(())
    }
}

/// A MySQL executed GTID set: per source UUID and tag (MySQL 8.4 tagged GTIDs; `""` untagged),
/// sorted, merged half-open intervals `[start, end)` of transaction numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MysqlGtidSet {
    sids: BTreeMap<SidKey, Vec<(u64, u64)>>,
}

/// A source UUID and a tag.
type SidKey = ([u8; 16], String);

impl MysqlGtidSet {
    pub fn is_empty(&self) -> bool {
        self.sids.values().all(Vec::is_empty)
    }

    /// Adds the interval `[start, end)` (merging with its neighbours).
    pub(crate) fn add_interval(&mut self, uuid: [u8; 16], tag: &str, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let v = self.sids.entry((uuid, tag.to_string())).or_default();
        v.push((start, end));
        v.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        for &(s, e) in v.iter() {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        *v = merged;
    }

    /// Records one transaction `uuid[:tag]:gno`.
    pub fn add(&mut self, uuid: [u8; 16], tag: &str, gno: u64) {
        self.add_interval(uuid, tag, gno, gno.saturating_add(1));
    }

    /// Whether `uuid[:tag]:gno` is in the set.
    pub fn contains(&self, uuid: [u8; 16], tag: &str, gno: u64) -> bool {
        self.sids
            .get(&(uuid, tag.to_string()))
            .is_some_and(|v| v.iter().any(|&(s, e)| s <= gno && gno < e))
    }

    /// Adds every transaction of `other`.
    pub(crate) fn union(&mut self, other: &MysqlGtidSet) {
        for ((uuid, tag), v) in &other.sids {
            for &(s, e) in v {
                self.add_interval(*uuid, tag, s, e);
            }
        }
    }

    /// `(uuid, tag, intervals)` per entry, in order: what `COM_BINLOG_DUMP_GTID` sends.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8; 16], &str, &[(u64, u64)])> {
        self.sids
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|((u, t), v)| (u, t.as_str(), v.as_slice()))
    }

    /// The set as `COM_BINLOG_DUMP_GTID` sends it (tagged entries switch the request to the
    /// 8.4 tagged format).
    pub(crate) fn to_sids(&self) -> Vec<mysql_common::packets::Sid<'static>> {
        use mysql_common::packets::{GnoInterval, Sid, Tag};
        self.entries()
            .map(|(uuid, tag, intervals)| {
                let sid = Sid::new(*uuid).with_intervals(
                    intervals
                        .iter()
                        .map(|&(s, e)| GnoInterval::new(s, e))
                        .collect(),
                );
                match Tag::new(tag.to_string()) {
                    Ok(t) if !tag.is_empty() => sid.with_tag(t),
                    _ => sid,
                }
            })
            .collect()
    }

    /// Parses MySQL's text form (`@@gtid_executed`): `uuid:1-5:7[:tag:1-3],uuid2:…`, with
    /// spaces and newlines allowed. An empty string is the empty set. Tags (8.4) name the
    /// intervals that follow them, up to the next tag.
    pub fn parse(s: &str) -> Option<MysqlGtidSet> {
        let mut set = MysqlGtidSet::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let mut fields = part.split(':').map(str::trim);
            let uuid = uuid::Uuid::parse_str(fields.next()?).ok()?.into_bytes();
            let mut tag = String::new();
            let mut any = false;
            for f in fields {
                if f.starts_with(|c: char| c.is_ascii_digit()) {
                    let (a, b) = match f.split_once('-') {
                        Some((a, b)) => (a.parse::<u64>().ok()?, b.parse::<u64>().ok()?),
                        None => {
                            let n = f.parse::<u64>().ok()?;
                            (n, n)
                        }
                    };
                    if a == 0 || b < a {
                        return None;
                    }
                    set.add_interval(uuid, &tag, a, b.checked_add(1)?);
                    any = true;
                } else if valid_tag(f) {
                    tag = f.to_ascii_lowercase();
                } else {
                    return None;
                }
            }
            if !any {
                return None;
            }
        }
        Some(set)
    }
}

/// Whether the body of a MySQL Previous_gtids event (type 35) is consistent with its length:
/// every count it holds must fit the bytes that follow. `mysql_common` reserves memory for
/// the counts before reading, and a corrupt count aborts the process (an allocation failure
/// is no panic to catch), so the relay checks first. Layout: a u64 header (format in the top
/// byte, 8.4 tagged format when not 0: the count in bits 8..56; else the count in the low
/// 56 bits), then per source: UUID (16 bytes), in the tagged format a tag (a variable-length
/// length, then its bytes), an interval count (u64) and 16 bytes per interval.
pub fn previous_gtids_fit(data: &[u8]) -> bool {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (head, rest) = b.split_at(n);
        *b = rest;
        Some(head)
    }
    fn varlen(b: &mut &[u8]) -> Option<u64> {
        let first = *b.first()?;
        let ones = first.trailing_ones() as usize;
        if ones == 8 {
            take(b, 1)?;
            return Some(u64::from_le_bytes(take(b, 8)?.try_into().ok()?));
        }
        let bytes = take(b, ones + 1)?;
        let mut raw = [0u8; 8];
        raw[..bytes.len()].copy_from_slice(bytes);
        Some(u64::from_le_bytes(raw) >> (ones + 1))
    }
    let walk = || -> Option<()> {
        let mut b = data;
        let header = u64::from_le_bytes(take(&mut b, 8)?.try_into().ok()?);
        let tagged = header >> 56 != 0;
        let n_sids = if tagged {
            (header >> 8) & ((1 << 48) - 1)
        } else {
            header & ((1 << 56) - 1)
        };
        if n_sids > (b.len() / 24) as u64 {
            return None;
        }
        for _ in 0..n_sids {
            take(&mut b, 16)?;
            if tagged {
                let len = varlen(&mut b)?;
                take(&mut b, usize::try_from(len).ok()?)?;
            }
            let n = u64::from_le_bytes(take(&mut b, 8)?.try_into().ok()?);
            take(&mut b, usize::try_from(n.checked_mul(16)?).ok()?)?;
        }
        Some(())
    };
    walk().is_some()
}

/// A MySQL 8.4 GTID tag: a letter or `_`, then up to 31 letters, digits or `_`.
fn valid_tag(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 32
        && t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl fmt::Display for MysqlGtidSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (uuid, tag, intervals) in self.entries() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{}", uuid::Uuid::from_bytes(*uuid).as_hyphenated())?;
            if !tag.is_empty() {
                write!(f, ":{tag}")?;
            }
            for &(s, e) in intervals {
                if e == s + 1 {
                    write!(f, ":{s}")?;
                } else {
                    write!(f, ":{s}-{}", e - 1)?;
                }
            }
        }
        Ok(())
    }
}

/// The GTID text of one MySQL transaction: `uuid:gno` or `uuid:tag:gno`.
pub(crate) fn mysql_gtid_text(uuid: [u8; 16], tag: &str, gno: u64) -> String {
    let u = uuid::Uuid::from_bytes(uuid);
    if tag.is_empty() {
        format!("{}:{gno}", u.as_hyphenated())
    } else {
        format!("{}:{tag}:{gno}", u.as_hyphenated())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mysql_gtid_sets_parse_merge_and_render() {
        let u = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
        let s = MysqlGtidSet::parse(&format!(" {u}:1-5:7,\n{u}:6 ")).unwrap();
        assert_eq!(s.to_string(), format!("{u}:1-7"));
        let tagged = MysqlGtidSet::parse(&format!("{u}:1-3:Blue:1-2:5")).unwrap();
        assert_eq!(tagged.to_string(), format!("{u}:1-3,{u}:blue:1-2:5"));
        let uuid = uuid::Uuid::parse_str(u).unwrap().into_bytes();
        assert!(tagged.contains(uuid, "blue", 5) && !tagged.contains(uuid, "blue", 3));
        assert!(tagged.contains(uuid, "", 3) && !tagged.contains(uuid, "", 4));
        let mut all = s.clone();
        all.union(&tagged);
        all.add(uuid, "", 8);
        assert_eq!(all.to_string(), format!("{u}:1-8,{u}:blue:1-2:5"));
        assert!(MysqlGtidSet::parse("").unwrap().is_empty());
        for bad in [
            "x:1-2",
            u,
            &format!("{u}:0"),
            &format!("{u}:5-3"),
            &format!("{u}:9bad:1"),
        ] {
            assert!(MysqlGtidSet::parse(bad).is_none(), "{bad}");
        }
        // MariaDB positions are no MySQL sets, and the other way round.
        assert!(MysqlGtidSet::parse("0-1-6").is_none());
        assert!(GtidState::parse(&s.to_string()).is_none());
        assert_eq!(mysql_gtid_text(uuid, "", 4), format!("{u}:4"));
        assert_eq!(mysql_gtid_text(uuid, "blue", 4), format!("{u}:blue:4"));

        // Previous_gtids bodies: counts must fit the bytes.
        let mut body = 1u64.to_le_bytes().to_vec();
        body.extend_from_slice(&uuid);
        body.extend_from_slice(&1u64.to_le_bytes());
        body.extend_from_slice(&1u64.to_le_bytes());
        body.extend_from_slice(&8u64.to_le_bytes());
        assert!(previous_gtids_fit(&body));
        assert!(previous_gtids_fit(&0u64.to_le_bytes()));
        for n in 0..body.len() {
            assert!(!previous_gtids_fit(&body[..n]), "{n}");
        }
        let mut huge = body.clone();
        huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(!previous_gtids_fit(&huge));
        let mut intervals = body.clone();
        intervals[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!previous_gtids_fit(&intervals));
    }

    #[test]
    fn states_parse_render_and_advance() {
        let mut s = GtidState::parse(" 1-2-40,\n0-1-6 ").unwrap();
        assert_eq!(s.to_string(), "0-1-6,1-2-40");
        s.apply(Gtid::parse("0-3-7").unwrap());
        assert_eq!(s.to_string(), "0-3-7,1-2-40");
        assert!(GtidState::parse("").unwrap().is_empty());
        assert!(GtidState::parse("0-1").is_none());
        assert!(GtidState::parse("a-b-c").is_none());
    }

    #[test]
    fn gtid_events_and_lists_decode_and_refuse_short_input() {
        let mut data = 42u64.to_le_bytes().to_vec();
        data.extend_from_slice(&3u32.to_le_bytes());
        data.push(FL_STANDALONE | 8);
        let ev = parse_gtid_event(&data, 7).unwrap();
        assert_eq!(ev.gtid.to_string(), "3-7-42");
        assert!(ev.standalone);
        for n in 0..data.len() {
            assert!(parse_gtid_event(&data[..n], 7).is_none());
        }

        let mut list = 2u32.to_le_bytes().to_vec();
        for (d, s, q) in [(0u32, 1u32, 9u64), (0, 2, 11)] {
            list.extend_from_slice(&d.to_le_bytes());
            list.extend_from_slice(&s.to_le_bytes());
            list.extend_from_slice(&q.to_le_bytes());
        }
        let gtids = parse_gtid_list(&list).unwrap();
        assert_eq!(gtids.len(), 2);
        assert_eq!(GtidState::from_list(&gtids).to_string(), "0-2-11");
        for n in 0..list.len() {
            assert!(parse_gtid_list(&list[..n]).is_none());
        }
    }
}
