//! Taking over Debezium's Postgres replication slot (`outboxd offset set --from-debezium` with
//! `--slot`/`--publication` naming the connector's): the slot, moved to where the connector's
//! stored offset says its published events end, so that outboxd streams from there with
//! nothing repeated and nothing missed.
//!
//! The connector confirms to its slot the end of the last transaction it *completed*
//! (`lsn_commit`); its records inside the next transaction carry the offset of the change they
//! came from (`lsn`), so a connector stopped after a transaction's last outbox row leaves the
//! slot before that transaction, which it would skip on its own restart by its offset. Here the
//! slot's pending changes are read without consuming them (`pg_logical_slot_peek_binary_changes`,
//! decoded with outboxd's pgoutput decoder): a transaction whose outbox inserts all sit at or
//! before `lsn` (or that ended by `lsn_commit`) was published; the slot moves past it. One the
//! connector stopped inside is refused with both choices.

use super::admin;
use super::pgoutput::{self, Message};
use crate::event::{format_lsn, parse_lsn};
use crate::outbox::TableName;
use crate::Error;
use bytes::Bytes;
use tokio_postgres::Client;

/// Changes read from the slot at most (a connector far behind its slot is refused).
const PEEK_LIMIT: i32 = 1_000_000;

/// One transaction the slot still holds: its end and the LSNs of its outbox inserts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PendingTx {
    pub end_lsn: u64,
    pub outbox: Vec<u64>,
}

/// What the connector's offset says about the transactions the slot holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Move the slot to this LSN (its current position when nothing was published past it).
    At(u64),
    /// The connector stopped inside a transaction.
    Inside {
        start: u64,
        end_lsn: u64,
        emitted: usize,
        total: usize,
    },
}

/// Where the slot goes, from the transactions it holds in commit order, its current position
/// and the connector's offset (`lsn_commit`, `lsn`).
pub(crate) fn decide(
    txs: &[PendingTx],
    confirmed: u64,
    lsn_commit: Option<u64>,
    lsn: Option<u64>,
) -> Decision {
    let mut at = confirmed;
    for tx in txs {
        if lsn_commit.is_some_and(|c| tx.end_lsn <= c) {
            at = tx.end_lsn;
            continue;
        }
        let emitted = tx
            .outbox
            .iter()
            .filter(|l| lsn.is_some_and(|last| **l <= last))
            .count();
        if emitted == tx.outbox.len() && (emitted > 0 || lsn.is_some_and(|l| tx.end_lsn <= l)) {
            at = tx.end_lsn;
        } else if emitted == 0 {
            break;
        } else {
            return Decision::Inside {
                start: at,
                end_lsn: tx.end_lsn,
                emitted,
                total: tx.outbox.len(),
            };
        }
    }
    Decision::At(at)
}

/// The transactions `slot` holds past its position, read through `publication` without
/// consuming them: each transaction's end and the LSNs of its inserts into `tables`.
async fn pending(
    client: &Client,
    slot: &str,
    publication: &str,
    tables: &[TableName],
) -> Result<Vec<PendingTx>, Error> {
    let rows = client
        .query(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, NULL, $2,
                 'proto_version', '1', 'publication_names', $3)",
            &[&slot, &PEEK_LIMIT, &crate::outbox::pg_ident(publication)],
        )
        .await
        .map_err(|e| {
            let in_use = e.code() == Some(&tokio_postgres::error::SqlState::OBJECT_IN_USE);
            if in_use {
                Error::config(
                    format!("replication slot {slot:?} is in use: {e}"),
                    "stop the Debezium connector (its task holds the slot) before taking over",
                )
            } else {
                e.into()
            }
        })?;
    if rows.len() as i64 >= i64::from(PEEK_LIMIT) {
        return Err(Error::config(
            format!("slot {slot:?} holds more than {PEEK_LIMIT} changes past its position: too far behind the connector's offset to read"),
            "let the connector catch up (or run it until its slot follows), stop it, and take its offset again",
        ));
    }
    let mut outbox_relations = std::collections::HashSet::new();
    let mut txs = Vec::new();
    let mut open: Option<Vec<u64>> = None;
    for r in rows {
        let lsn = parse_lsn(r.get::<_, &str>(0)).unwrap_or(0);
        let data: Vec<u8> = r.get(1);
        let msg = pgoutput::decode(Bytes::from(data))
            .map_err(|e| Error::Decode(format!("slot {slot:?}: {e}")))?;
        match msg {
            Message::Relation(rel)
                if tables
                    .iter()
                    .any(|t| t.pg_schema() == rel.namespace && t.name == rel.name) =>
            {
                outbox_relations.insert(rel.id);
            }
            Message::Begin { .. } => open = Some(Vec::new()),
            Message::Insert { relation_id, .. } if outbox_relations.contains(&relation_id) => {
                if let Some(o) = open.as_mut() {
                    o.push(lsn);
                }
            }
            Message::Commit { end_lsn, .. } => {
                if let Some(outbox) = open.take() {
                    txs.push(PendingTx { end_lsn, outbox });
                }
            }
            _ => {}
        }
    }
    Ok(txs)
}

/// Resolves the connector's offset against `slot` (see the module's documentation): the LSN
/// to move the slot to, and what it came to.
pub async fn resolve(
    client: &Client,
    slot: &str,
    publication: &str,
    tables: &[TableName],
    lsn_commit: Option<u64>,
    lsn: Option<u64>,
) -> Result<(u64, String), Error> {
    let info = admin::slot(client, slot).await?.ok_or_else(|| {
        Error::config(
            format!("replication slot {slot:?} does not exist"),
            "name the connector's slot with --slot (Debezium's slot.name, default debezium) and its publication with --publication (publication.name, default dbz_publication)",
        )
    })?;
    if info.plugin.as_deref() != Some("pgoutput") {
        return Err(Error::config(
            format!("slot {slot:?} uses the {:?} plugin: outboxd reads pgoutput slots", info.plugin.unwrap_or_default()),
            "a decoderbufs slot cannot be taken over: start outboxd on a slot of its own with --snapshot since=<time of the last event Debezium published>",
        ));
    }
    let confirmed = info.confirmed_flush_lsn.unwrap_or(0);
    let newest = lsn.max(lsn_commit).unwrap_or(0);
    if newest < confirmed {
        return Err(Error::config(
            format!(
                "slot {slot:?} is at {}, past the connector's offset ({}): the offset is older than the slot, or something else consumed the slot",
                format_lsn(confirmed),
                format_lsn(newest)
            ),
            "take the connector's newest offset (the last record of its key in the offsets topic, or its offset file after it stopped)",
        ));
    }
    let txs = pending(client, slot, publication, tables).await?;
    match decide(&txs, confirmed, lsn_commit, lsn) {
        Decision::At(at) => {
            let skipped = txs.iter().filter(|t| t.end_lsn <= at).count();
            Ok((
                at,
                format!(
                    "slot {slot:?} at {}; the connector's offset (lsn_commit {}, lsn {}) covers {skipped} more transaction{} it holds",
                    format_lsn(confirmed),
                    lsn_commit.map_or("-".into(), format_lsn),
                    lsn.map_or("-".into(), format_lsn),
                    if skipped == 1 { "" } else { "s" }
                ),
            ))
        }
        Decision::Inside {
            start,
            end_lsn,
            emitted,
            total,
        } => Err(Error::config(
            format!(
                "the connector stopped inside the transaction ending at {}: {emitted} of its {total} outbox rows were published, and outboxd resumes at transaction boundaries",
                format_lsn(end_lsn)
            ),
            format!(
                "either publish the whole transaction again ({emitted} repeated): outboxd offset set --slot {slot} --lsn {}; or skip the rest of it ({} never published): outboxd offset set --slot {slot} --lsn {}; or let the connector run until it has published the transaction and take its offset again",
                format_lsn(start),
                total - emitted,
                format_lsn(end_lsn)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx(end_lsn: u64, outbox: &[u64]) -> PendingTx {
        PendingTx {
            end_lsn,
            outbox: outbox.to_vec(),
        }
    }

    /// The slot at 100; transactions ending at 200 (rows 150, 160), 300 (no outbox row), 400
    /// (rows 350, 360).
    fn held() -> Vec<PendingTx> {
        vec![tx(200, &[150, 160]), tx(300, &[]), tx(400, &[350, 360])]
    }

    #[test]
    fn the_slot_moves_past_what_the_connector_published() {
        // Stopped after the last row of the first transaction: its slot still before it.
        assert_eq!(
            decide(&held(), 100, Some(100), Some(160)),
            Decision::At(200)
        );
        // After the last row of the third: everything.
        assert_eq!(
            decide(&held(), 100, Some(200), Some(360)),
            Decision::At(400)
        );
        // Its offset at a commit (a heartbeat's): what ended by then.
        assert_eq!(
            decide(&held(), 100, Some(300), Some(300)),
            Decision::At(300)
        );
        // Nothing past the slot was published.
        assert_eq!(
            decide(&held(), 100, Some(100), Some(100)),
            Decision::At(100)
        );
    }

    #[test]
    fn a_transaction_the_connector_stopped_inside_is_not_guessed() {
        assert_eq!(
            decide(&held(), 100, Some(300), Some(350)),
            Decision::Inside {
                start: 300,
                end_lsn: 400,
                emitted: 1,
                total: 2
            }
        );
    }
}
