//! MariaDB global transaction ids. `mysql_common` does not parse MariaDB's GTID (162) and
//! GTID_LIST (163) events, so their bytes are read here; [`GtidState`] is the server's
//! position in every replication domain (`0-1-6,1-2-40`), the form `@@gtid_binlog_pos`,
//! `BINLOG_GTID_POS()` and `@slave_connect_state` use.

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
pub const FL_STANDALONE: u8 = 1;
pub const FL_GROUP_COMMIT_ID: u8 = 2;

/// A MariaDB GTID event (type 162): starts an event group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GtidEvent {
    pub gtid: Gtid,
    /// The group is one statement without BEGIN/COMMIT (DDL): it ends after its next event.
    pub standalone: bool,
}

/// Parses the body of a MariaDB GTID event (after the common header, without checksum):
/// `seq_no` u64 LE, `domain_id` u32 LE, `flags2` u8, then optional fields we do not need.
/// The server id comes from the event header.
pub fn parse_gtid_event(data: &[u8], server_id: u32) -> Option<GtidEvent> {
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
pub fn parse_gtid_list(data: &[u8]) -> Option<Vec<Gtid>> {
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
    pub fn from_list(list: &[Gtid]) -> GtidState {
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

#[cfg(test)]
mod tests {
    use super::*;

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
