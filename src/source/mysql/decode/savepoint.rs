//! Savepoints and rollbacks inside a binlog event group. A transaction that also wrote a
//! non-transactional table (MEMORY, MyISAM, Aria without TRANSACTIONAL=1) — and any under
//! Galera streaming replication — cannot take its rolled-back work out of the binlog: the
//! server keeps those rows in the group, writes `` ROLLBACK TO `sp` `` after them and commits
//! the group; a group that ends in a `ROLLBACK` query (a temporary table written in MIXED
//! format, say) is written whole too. The rows such a statement undid are dropped here.
//!
//! Savepoints follow the server's rules: names are identifiers (backticks quote them) compared
//! without regard to case; `SAVEPOINT` with a name already set moves it; `ROLLBACK TO` keeps
//! the named savepoint and forgets the ones set after it; `RELEASE SAVEPOINT` forgets the named
//! one and those after it.

use super::statement::{ident, skip_space};
use super::{Decoder, Step};
use crate::event::OutboxEvent;
use crate::Error;

/// A statement about savepoints or the end of a transaction by rollback.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Savepoint {
    /// `SAVEPOINT name`
    Set(String),
    /// `ROLLBACK [WORK] TO [SAVEPOINT] name`
    RollbackTo(String),
    /// `RELEASE SAVEPOINT name`
    Release(String),
    /// `ROLLBACK [WORK] …`: the whole transaction.
    Rollback,
}

/// The next unquoted word (a keyword, or an unquoted name), upper-cased, and the text after
/// it.
fn keyword(s: &[u8]) -> (String, &[u8]) {
    let s = skip_space(s);
    let end = s
        .iter()
        .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_' || *c == b'$'))
        .unwrap_or(s.len());
    (
        String::from_utf8_lossy(&s[..end]).to_ascii_uppercase(),
        &s[end..],
    )
}

/// What a statement says about savepoints, if anything (`None`: not such a statement, or
/// one whose name cannot be read).
pub(super) fn parse(text: &[u8]) -> Option<Savepoint> {
    let (verb, mut rest) = keyword(text);
    // Savepoint names compare without regard to case, as the server compares them.
    let name = |s: &mut &[u8]| ident(s).map(|n| n.to_lowercase());
    match verb.as_str() {
        "SAVEPOINT" => name(&mut rest).map(Savepoint::Set),
        "RELEASE" => {
            let (w, mut rest) = keyword(rest);
            (w == "SAVEPOINT").then_some(())?;
            name(&mut rest).map(Savepoint::Release)
        }
        "ROLLBACK" => {
            let (mut w, mut after) = keyword(rest);
            if w == "WORK" {
                (w, after) = keyword(after);
            }
            if w != "TO" {
                return Some(Savepoint::Rollback);
            }
            // `ROLLBACK TO SAVEPOINT sp`, or a savepoint that is itself named `savepoint`.
            let (w, mut named) = keyword(after);
            if w == "SAVEPOINT" {
                if let Some(n) = name(&mut named) {
                    return Some(Savepoint::RollbackTo(n));
                }
            }
            name(&mut after).map(Savepoint::RollbackTo)
        }
        _ => None,
    }
}

/// The row index of a binlog event (its place in its transaction).
pub fn row_index(e: &OutboxEvent) -> u32 {
    match &e.position {
        crate::event::SourcePosition::Binlog { index, .. } => *index,
        _ => 0,
    }
}

impl Decoder {
    /// Applies a savepoint statement of the open group. `ROLLBACK` also ends it.
    pub(super) fn savepoint_statement(
        &mut self,
        sp: Savepoint,
        text: &[u8],
        start: u64,
        end: u64,
        ts: u32,
        steps: &mut Vec<Step>,
    ) -> Result<(), Error> {
        let file = self.file.clone();
        let shown = || {
            let t = String::from_utf8_lossy(skip_space(text));
            let mut s: String = t.chars().take(200).collect();
            if s.len() < t.len() {
                s.push('…');
            }
            format!("\"{s}\" at {file}:{start}")
        };
        let Some(txn) = self.txn.as_mut() else {
            return Ok(());
        };
        txn.other = true;
        match sp {
            Savepoint::Set(name) => {
                txn.savepoints.retain(|(n, _)| *n != name);
                txn.savepoints.push((name, txn.index));
            }
            Savepoint::Release(name) => {
                if let Some(i) = txn.savepoints.iter().position(|(n, _)| *n == name) {
                    txn.savepoints.truncate(i);
                }
            }
            Savepoint::RollbackTo(name) => {
                match txn.savepoints.iter().position(|(n, _)| *n == name) {
                    Some(i) => {
                        let keep = txn.savepoints[i].1;
                        txn.savepoints.truncate(i + 1);
                        self.undo(keep, shown(), steps);
                    }
                    // Nothing of the group was an outbox row: nothing to undo either way.
                    None if txn.index == 0 => {}
                    None => {
                        return Err(Error::config(
                            format!(
                                "{} rolls back to a savepoint that its event group (at {}:{}, with outbox rows) never set or already released: \
                                 the relay cannot tell which of its outbox rows were undone",
                                shown(),
                                txn.start_file,
                                txn.start_pos
                            ),
                            format!(
                                "publish the rows this transaction kept by hand (compare the outbox table with the binlog group at {}:{}), \
                                 then move past it with `outboxd offset set --binlog-position {file}:<end of that group>` while the relay is stopped",
                                txn.start_file, txn.start_pos
                            ),
                        ));
                    }
                }
            }
            Savepoint::Rollback => {
                self.undo(0, shown(), steps);
                steps.push(self.commit(end, ts));
            }
        }
        Ok(())
    }

    /// Drops the open group's outbox rows from index `keep` on: held ones (an XA group) here,
    /// sent ones by telling the driver.
    fn undo(&mut self, keep: u32, what: String, steps: &mut Vec<Step>) {
        let Some(txn) = self.txn.as_mut() else {
            return;
        };
        if txn.index <= keep {
            return;
        }
        tracing::info!(undone = txn.index - keep, statement = %what, "outbox rows rolled back inside a committed event group are not published");
        if txn.xa {
            txn.held.retain(|e| row_index(e) < keep);
            txn.held_bytes = txn.held.iter().map(OutboxEvent::size).sum();
        } else {
            steps.push(Step::Undo { keep, what });
        }
        // The rows after it take the numbers of the undone ones: a transaction's row numbers
        // stay dense, as if the undone rows had never been written.
        txn.index = keep;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn savepoint_statements() {
        let p = |s: &str| parse(s.as_bytes());
        assert_eq!(p("SAVEPOINT `sp`"), Some(Savepoint::Set("sp".into())));
        assert_eq!(p("savepoint Sp_1"), Some(Savepoint::Set("sp_1".into())));
        assert_eq!(p("SAVEPOINT `a``b`"), Some(Savepoint::Set("a`b".into())));
        assert_eq!(
            p("ROLLBACK TO `sp`"),
            Some(Savepoint::RollbackTo("sp".into()))
        );
        assert_eq!(
            p("rollback work to savepoint `SP`"),
            Some(Savepoint::RollbackTo("sp".into()))
        );
        assert_eq!(
            p("ROLLBACK TO savepoint"),
            Some(Savepoint::RollbackTo("savepoint".into())),
            "a savepoint named savepoint"
        );
        assert_eq!(
            p("ROLLBACK TO savepoint_2"),
            Some(Savepoint::RollbackTo("savepoint_2".into()))
        );
        assert_eq!(
            p("RELEASE SAVEPOINT `x`"),
            Some(Savepoint::Release("x".into()))
        );
        assert_eq!(p("ROLLBACK"), Some(Savepoint::Rollback));
        assert_eq!(p("ROLLBACK WORK AND NO CHAIN"), Some(Savepoint::Rollback));
        assert_eq!(p("ROLLBACK /* x */"), Some(Savepoint::Rollback));
        assert_eq!(p("COMMIT"), None);
        assert_eq!(p("RELEASE LOCK"), None);
        assert_eq!(p("SAVEPOINT"), None, "no name");
    }
}
