//! Which sources this fleet process runs when several share one directory: each process owns
//! the sources that rendezvous hashing over the live members gives it ([`owner`]), so a
//! member joining or leaving moves only the sources it gains or loses. Who is live is a
//! [`Share`]'s business (`members`: heartbeat rows in a coordination database). Owning decides
//! only which process tries first: every run still takes its source's lease with its fence, so
//! two processes that disagree for a moment (one has not seen a member leave yet) never both
//! publish — the second waits as a standby until the lease is free.

use tokio::sync::watch;

/// Which sources this process runs now.
pub trait Share: Send + Sync {
    /// Whether this process owns `source`.
    fn owns(&self, source: &str) -> bool;
    /// Changes whenever the answer of [`Share::owns`] may have changed (a member came or went).
    fn changed(&self) -> watch::Receiver<u64>;
}

/// The member of `members` that owns `source`: the highest hash of (member, source). Every
/// process computes the same owner from the same members; removing a member moves only its
/// own sources, each to the member that scored next.
pub(crate) fn owner<'m>(source: &str, members: &'m [String]) -> Option<&'m str> {
    members
        .iter()
        .max_by_key(|m| (score(m, source), m.as_str()))
        .map(|m| m.as_str())
}

/// FNV-1a of member, a separator and source, then a 64-bit finaliser (splitmix64) so that
/// similar names spread: stable across processes, builds and platforms (std's hasher is not).
fn score(member: &str, source: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in member.bytes().chain([0xff]).chain(source.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share_of(members: &[String], sources: &[String]) -> Vec<usize> {
        members
            .iter()
            .map(|m| {
                sources
                    .iter()
                    .filter(|s| owner(s, members) == Some(m.as_str()))
                    .count()
            })
            .collect()
    }

    #[test]
    fn sources_spread_over_members_and_a_leaving_member_moves_only_its_own() {
        let sources: Vec<String> = (0..200).map(|i| format!("tenant_{i}")).collect();
        let three: Vec<String> = ["a:1", "b:2", "c:3"].map(String::from).to_vec();
        let counts = share_of(&three, &sources);
        assert_eq!(counts.iter().sum::<usize>(), 200);
        // Fair within a wide margin: each of three holds between a fifth and a half.
        assert!(
            counts.iter().all(|&c| (40..=100).contains(&c)),
            "{counts:?}"
        );
        let two: Vec<String> = three[..2].to_vec();
        for s in &sources {
            let before = owner(s, &three).unwrap();
            let after = owner(s, &two).unwrap();
            if before != "c:3" {
                assert_eq!(before, after, "{s} moved though its owner stayed");
            }
        }
        assert_eq!(owner("x", &[]), None);
    }
}
