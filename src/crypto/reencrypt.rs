//! Re-encryption of stored outbox rows (Postgres): walks the table by id (keyset pagination on
//! the primary key, so each batch is an index range scan however large the table is), one short
//! transaction per batch, and rewrites the payloads that still use an older key or hold a
//! sensitive field in clear. Rows already up to date are left alone, so a run that stops can
//! simply be started again (or resumed with `--after`, which skips what was already scanned).
//!
//! With a keystore ([`Encryptor::with_keystore`]) every value outside a data key — clear
//! marked fields and values under any keyring key — is sealed under the row's aggregate's data
//! key instead, so that `keys forget` erases old rows too.
//!
//! Rows still `pending` (the status column poll mode claims by) are left alone unless
//! [`Options::include_pending`] says no poll relay reads the table: a poll relay's claim
//! (`FOR UPDATE SKIP LOCKED`, in `(created_at, seq)` order) passes over every row another
//! transaction holds, so a rewrite that held an aggregate's earlier version while the relay
//! claimed would have it publish the later versions first. Skipped rows are counted; a later
//! run re-seals them once they are published.
//!
//! In CDC mode the relay keeps INSERTs only, so these UPDATEs are never published again; the
//! messages already sent keep their old ciphertext, which is why an old key may be retired only
//! once consumers no longer need it either.

use super::envelope::KeyBytes;
use super::{key_ids_in, outside_data_keys, reencrypt_payload, reencrypt_payload_with};
use super::{Encryptor, SealingKey};
use crate::names::{pg_ident, ColumnMap, TableName};
use crate::Error;
use std::collections::BTreeMap;
use std::collections::{HashMap, HashSet};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How to walk the table.
#[derive(Debug, Clone)]
pub struct Options {
    /// Rows per transaction.
    pub batch: i64,
    /// Start after this id (resume).
    pub after: Option<Uuid>,
    /// Stop after this many rows were scanned (tests, trial runs).
    pub limit: Option<u64>,
    /// Rewrite rows whose status is still `pending` too. Only for a table no poll relay reads
    /// (CDC mode never changes the status, so there every row stays `pending`).
    pub include_pending: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            batch: 500,
            after: None,
            limit: None,
            include_pending: false,
        }
    }
}

/// Where a run is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Progress {
    pub batches: u64,
    pub scanned: u64,
    pub rewritten: u64,
    /// Rows left alone because their status was `pending` (see the module paragraph).
    pub skipped_pending: u64,
    /// Rows that could not be decrypted (each is named in `failures`); left as they were.
    pub failed: u64,
    pub failures: Vec<(Uuid, String)>,
    pub last_id: Option<Uuid>,
    /// Whether the run stopped on a signal before the end of the table.
    pub interrupted: bool,
}

/// Rewrites the rows of `table` that need it. `report` is called after every batch.
pub async fn run(
    client: &mut tokio_postgres::Client,
    table: &TableName,
    columns: &ColumnMap,
    enc: &Encryptor,
    opts: &Options,
    shutdown: &CancellationToken,
    mut report: impl FnMut(&Progress),
) -> Result<Progress, Error> {
    let t = table.pg_quoted();
    let id = pg_ident(columns.get(crate::names::Column::Id));
    let payload = pg_ident(columns.get(crate::names::Column::Payload));
    let aggregate = pg_ident(columns.get(crate::names::Column::AggregateId));
    // Pending rows are left alone (module paragraph) when the table has a status column at all;
    // without one no poll relay can read it.
    let skip_pending = !opts.include_pending
        && client
            .query_opt(
                "SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = $2 \
                 AND attnum > 0 AND NOT attisdropped",
                &[&t, &columns.get(crate::names::Column::Status)],
            )
            .await?
            .is_some();
    let pending = if skip_pending {
        // NULL is no status a poll relay claims: such a row is rewritten.
        format!(
            "COALESCE({}::text = 'pending', false)",
            pg_ident(columns.get(crate::names::Column::Status))
        )
    } else {
        "false".to_string()
    };
    // The page (the next `batch` ids) is read without a lock: locking a pending row, even for
    // a moment, would make a poll relay's claim pass over it.
    let page = format!("SELECT {id}, {pending} FROM {t} WHERE {id} > $1 ORDER BY {id} LIMIT $2");
    // FOR UPDATE: a row is not changed under us (a pruner) between the read and the rewrite;
    // the lock lasts one short batch. The status test sits in the locking query's WHERE, which
    // Postgres applies before it locks a row: a row pending in that statement's snapshot (a
    // relay's uncommitted mark included) is passed over, never locked, never waited for.
    let select = format!(
        "SELECT {id}, {payload}::text, {aggregate}::text FROM {t} WHERE {id} = ANY($1) \
         AND NOT ({pending}) ORDER BY {id} FOR UPDATE"
    );
    // Data keys by aggregate, looked up (or created) once per run.
    let mut data_keys: HashMap<String, (String, KeyBytes)> = HashMap::new();
    let update = format!("UPDATE {t} SET {payload} = $2 WHERE {id} = $1");
    let mut p = Progress {
        last_id: opts.after,
        ..Progress::default()
    };
    let batch = opts.batch.max(1);
    loop {
        if shutdown.is_cancelled() {
            p.interrupted = true;
            break;
        }
        let tx = client.transaction().await?;
        let page_stmt = tx.prepare(&page).await?;
        let select_stmt = tx.prepare(&select).await?;
        let update_stmt = tx.prepare(&update).await?;
        let after = p.last_id.unwrap_or(Uuid::nil());
        let page_rows = tx.query(&page_stmt, &[&after, &batch]).await?;
        let Some(last) = page_rows.last() else {
            tx.commit().await?;
            break;
        };
        let ids: Vec<Uuid> = page_rows.iter().map(|r| r.get(0)).collect();
        let pending_ids: Vec<Uuid> = page_rows
            .iter()
            .filter(|r| r.get::<_, bool>(1))
            .map(|r| r.get(0))
            .collect();
        let rows = tx.query(&select_stmt, &[&ids]).await?;
        p.scanned += ids.len() as u64;
        p.last_id = Some(last.get(0));
        // Pending at the page read and not locked since (a row a relay marked meanwhile was
        // locked, and rewritten, instead).
        let locked: HashSet<Uuid> = rows.iter().map(|r| r.get(0)).collect();
        p.skipped_pending += pending_ids.iter().filter(|i| !locked.contains(i)).count() as u64;
        for row in &rows {
            let row_id: Uuid = row.get(0);
            let text: String = row.get(1);
            let value: serde_json::Value = match serde_json::from_str(&text) {
                Ok(v) => v,
                Err(e) => {
                    p.failed += 1;
                    p.failures
                        .push((row_id, format!("payload is not JSON: {e}")));
                    continue;
                }
            };
            let result = match enc.keystore() {
                None => reencrypt_payload(enc.keyring(), enc.schema(), row_id, &value),
                Some(_) if outside_data_keys(enc.schema(), &value).is_empty() => Ok(None),
                Some(ks) => {
                    let agg: String = row.get(2);
                    if !data_keys.contains_key(&agg) {
                        let k = ks.data_key_for(enc.keyring(), &agg).await?;
                        data_keys.insert(agg.clone(), k);
                    }
                    let (key_id, material) = &data_keys[&agg];
                    let target = SealingKey {
                        id: key_id,
                        material,
                    };
                    reencrypt_payload_with(enc.keyring(), target, enc.schema(), row_id, &value)
                }
            };
            match result {
                Ok(Some(new)) => {
                    tx.execute(&update_stmt, &[&row_id, &new]).await?;
                    p.rewritten += 1;
                }
                Ok(None) => {}
                Err(e) => {
                    p.failed += 1;
                    p.failures.push((row_id, e.to_string()));
                }
            }
        }
        tx.commit().await?;
        p.batches += 1;
        report(&p);
        if opts.limit.is_some_and(|l| p.scanned >= l) {
            break;
        }
    }
    Ok(p)
}

/// How many rows hold at least one value under each key id (whether or not the keyring knows
/// it); values under per-aggregate data keys are counted together as `d-*`. One scan of the table; the pattern is that of the value format, quotes included.
pub async fn count_by_key(
    client: &tokio_postgres::Client,
    table: &TableName,
    columns: &ColumnMap,
) -> Result<BTreeMap<String, i64>, Error> {
    let sql = format!(
        "SELECT CASE WHEN m[1] LIKE 'd-%' THEN 'd-*' ELSE m[1] END, count(DISTINCT {id}) FROM {t}, \
         LATERAL regexp_matches({payload}::text, '\"enc:v1:([A-Za-z0-9_-]{{1,32}}):', 'g') AS m \
         GROUP BY 1",
        t = table.pg_quoted(),
        id = pg_ident(columns.get(crate::names::Column::Id)),
        payload = pg_ident(columns.get(crate::names::Column::Payload)),
    );
    let rows = client.query(&sql, &[]).await?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect())
}

/// The same count for one payload already in memory (tests, consumers).
pub fn count_in_payload(payload: &serde_json::Value) -> BTreeMap<String, usize> {
    key_ids_in(payload)
}
