//! The first-start snapshot (docs/message-format.md): rows already in the outbox table when a relay first
//! starts must not be lost. The slot is created first, then the table is read in a new
//! REPEATABLE READ transaction, then the slot is streamed: a row committed in between is in
//! both (a duplicate), never in neither (a gap). The same path replays rows after a deliberate
//! `offset set --replay-since`.

use super::admin::estimate_rows;
use super::pgoutput::{Column, Relation};
use super::rows::RowMapper;
use crate::event::Checkpoint;
use crate::outbox::{pg_ident, ColumnMap, TableName};
use crate::progress::Progress;
use crate::source::Outlet;
use crate::Error;
// The snapshot types both databases share live in `source::snapshot`; named here too, where
// they were first defined.
pub use crate::source::snapshot::SnapshotMode;
pub(crate) use crate::source::snapshot::{and_where, SnapshotKey, SnapshotPlan};
use futures::{pin_mut, TryStreamExt};
use tokio_postgres::Client;

/// A Postgres string literal (standard_conforming_strings: only quotes are doubled).
fn pg_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The table's columns as a pgoutput Relation would announce them, so the snapshot maps and
/// validates rows exactly as the stream does.
pub(crate) async fn table_relation(client: &Client, table: &TableName) -> Result<Relation, Error> {
    let rows = client
        .query(
            "SELECT a.attname::text, a.atttypid::int8, a.atttypmod
               FROM pg_attribute a
              WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
              ORDER BY a.attnum",
            &[&table.pg_quoted()],
        )
        .await?;
    Ok(Relation {
        id: 0,
        namespace: table.pg_schema().to_string(),
        name: table.name.clone(),
        replica_identity: b'd',
        columns: rows
            .iter()
            .map(|r| Column {
                flags: 0,
                name: r.get(0),
                type_oid: r.get::<_, i64>(1) as u32,
                type_modifier: r.get(2),
            })
            .collect(),
    })
}

/// What a first start (or a replay) publishes of each table's existing rows, [`plan`] per
/// table in their order.
pub(crate) async fn plan_tables(
    client: &Client,
    tables: &[TableName],
    columns: &ColumnMap,
    mode: &SnapshotMode,
) -> Result<Vec<(TableName, SnapshotPlan)>, Error> {
    let mut plans = Vec::with_capacity(tables.len());
    for t in tables {
        plans.push((t.clone(), plan(client, t, columns, mode).await?));
    }
    Ok(plans)
}

/// Decides what a first start publishes. `auto` on a table without a status column refuses
/// (exit 2) when rows exist, saying how many and which options there are.
pub async fn plan(
    client: &Client,
    table: &TableName,
    columns: &ColumnMap,
    mode: &SnapshotMode,
) -> Result<SnapshotPlan, Error> {
    let rel = table_relation(client, table).await?;
    let created = pg_ident(columns.get(crate::names::Column::CreatedAt));
    if !rel
        .columns
        .iter()
        .any(|c| c.name == columns.get(crate::names::Column::CreatedAt))
    {
        crate::source::snapshot::require_created_at(
            mode,
            &table.pg_quoted(),
            columns.get(crate::names::Column::CreatedAt),
        )?;
    }
    let status = columns.get(crate::names::Column::Status);
    Ok(match mode {
        SnapshotMode::Never => SnapshotPlan::Nothing,
        SnapshotMode::All => SnapshotPlan::Rows {
            filter: String::new(),
            what: "every row".into(),
        },
        SnapshotMode::Since(ts) => SnapshotPlan::Rows {
            filter: format!("WHERE {created} >= '{}'::timestamptz", ts.to_rfc3339()),
            what: format!("rows created since {}", ts.to_rfc3339()),
        },
        SnapshotMode::Auto if rel.columns.iter().any(|c| c.name == status) => SnapshotPlan::Rows {
            filter: format!("WHERE {}::text = 'pending'", pg_ident(status)),
            what: "pending rows".into(),
        },
        SnapshotMode::Auto => {
            let n: i64 = client
                .query_one(&format!("SELECT count(*) FROM {}", table.pg_quoted()), &[])
                .await?
                .get(0);
            if n == 0 {
                SnapshotPlan::Nothing
            } else {
                return Err(Error::config(
                    format!(
                        "first start: {} already holds {n} row{} and has no status column to tell which were published",
                        table.pg_quoted(),
                        if n == 1 { "" } else { "s" }
                    ),
                    "choose: --snapshot all (publish them all), --snapshot never (publish none), \
                     or --snapshot since=<RFC 3339 time> (publish rows created since then)",
                ));
            }
        }
    })
}

/// `auto` on a table without a status column, looked at again once the stream's position
/// exists (`plans` as [`plan_tables`] made them for `--snapshot auto`; their `Nothing` are those
/// tables). The first look, before the slot, found the table empty; creating the slot waits for
/// the transactions running then, which commit before its consistent point, so the stream does
/// not carry their rows. Every row there now was committed after the first look, so each is
/// new: a table no longer empty is published whole (a row also in the stream, committed after
/// the slot's point, is a duplicate, never a gap).
pub(crate) async fn look_again(
    client: &Client,
    plans: &mut [(TableName, SnapshotPlan)],
) -> Result<(), Error> {
    for (table, plan) in plans.iter_mut() {
        if *plan != SnapshotPlan::Nothing {
            continue;
        }
        let n: i64 = client
            .query_one(&format!("SELECT count(*) FROM {}", table.pg_quoted()), &[])
            .await?
            .get(0);
        if n > 0 {
            tracing::info!(table = %table.pg_quoted(), rows = n, "first start: rows committed while the slot was created (the table was empty before): publishing them");
            *plan = SnapshotPlan::Rows {
                filter: String::new(),
                what: "rows committed while the relay started on the empty table".into(),
            };
        }
    }
    Ok(())
}

/// Reads the planned rows of `table` (one of the relay's `tables`) in a REPEATABLE READ
/// transaction, in `created_at` order, a batch at a time (memory stays bounded), and sends them
/// as events positioned at `at.0` (the slot's position: every streamed commit comes after it)
/// with indexes from `at.1` on. After each row a [`Checkpoint::Snapshot`] mark with its key
/// (`table` is the table's index in the plan); with `after`, only rows after that key are read.
/// Returns how many rows were sent.
#[allow(clippy::too_many_arguments)]
pub async fn publish(
    client: &mut Client,
    tables: &[TableName],
    table: &TableName,
    columns: &ColumnMap,
    plan: &SnapshotPlan,
    at: (u64, u64),
    outlet: &Outlet,
    (table_index, after): (usize, Option<&SnapshotKey>),
) -> Result<u64, Error> {
    let SnapshotPlan::Rows { filter, what } = plan else {
        return Ok(0);
    };
    let (at, first_index) = at;
    let rel = table_relation(client, table).await?;
    let position_of = |name: &str| rel.columns.iter().position(|c| c.name == name);
    // Debezium's table has no `created_at`: its rows are read in `id` order.
    let created_column = position_of(columns.get(crate::names::Column::CreatedAt));
    let created = created_column.map(|_| pg_ident(columns.get(crate::names::Column::CreatedAt)));
    let id = pg_ident(columns.get(crate::names::Column::Id));
    // Untyped literals in a row comparison take the columns' types.
    let filter = match (after, &created) {
        (Some(k), Some(created)) => and_where(
            filter,
            &format!(
                "({created}, {id}) > ({}, {})",
                pg_literal(k.created_at.as_deref().unwrap_or_default()),
                pg_literal(&k.id)
            ),
        ),
        (Some(k), None) => and_where(filter, &format!("{id} > {}", pg_literal(&k.id))),
        (None, _) => filter.clone(),
    };
    let mut mapper = RowMapper::for_tables(tables.to_vec(), columns.clone());
    mapper.relation(rel.clone())?;
    let select: Vec<String> = rel
        .columns
        .iter()
        .map(|c| format!("{}::text", pg_ident(&c.name)))
        .collect();
    // NULLs first (Postgres sorts them last by default): a row whose key column is NULL has no
    // key to store, so it must come before every key. Sorted last, it would follow the last
    // stored key, and a resume's `(created, id) > key` filter, NULL for it, would skip it for
    // good. (MySQL sorts NULLs first already.)
    let order = match &created {
        Some(created) => format!("{created} NULLS FIRST, {id} NULLS FIRST"),
        None => format!("{id} NULLS FIRST"),
    };
    let sql = format!(
        "SELECT {} FROM {} {filter} ORDER BY {order}",
        select.join(", "),
        table.pg_quoted(),
    );
    let id_column = position_of(columns.get(crate::names::Column::Id));
    let mut progress = Progress::table(
        table.pg_quoted(),
        estimate_rows(client, table, &filter).await,
    );
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    // The text forms must be the ones the stream carries: ISO dates in UTC.
    tx.batch_execute("SET LOCAL datestyle = ISO; SET LOCAL timezone = 'UTC'")
        .await?;
    match after {
        Some(k) => {
            tracing::info!(table = %table.pg_quoted(), what = %what, after_created_at = k.created_at.as_deref().unwrap_or("-"), after_id = %k.id, next_index = k.seq, "first start: publishing existing rows after the last durable one of an interrupted snapshot")
        }
        None => {
            tracing::info!(table = %table.pg_quoted(), what = %what, "first start: publishing existing rows")
        }
    }
    let stream = tx.query_raw(&sql, std::iter::empty::<i32>()).await?;
    pin_mut!(stream);
    let mut n: u64 = 0;
    while let Some(row) = stream.try_next().await? {
        let tuple = super::rows::text_tuple(&row);
        let index = u32::try_from(first_index + n).unwrap_or(u32::MAX);
        if let Some(mut event) = mapper.insert(0, &tuple, at, index, 0)? {
            event.committed_at = None;
            outlet.send_event(event).await?;
            n += 1;
            progress.add(1);
            // A row whose key column is NULL has no key to resume after (and sorts first).
            let created_at = match created_column {
                Some(c) => row.get::<_, Option<String>>(c).map(Some),
                None => Some(None),
            };
            let key = created_at
                .zip(id_column.and_then(|i| row.get::<_, Option<String>>(i)))
                .map(|(created_at, id)| SnapshotKey {
                    table: table_index,
                    created_at,
                    id,
                    seq: first_index + n,
                });
            if let Some(key) = key {
                outlet
                    .send_checkpoint(Checkpoint::Snapshot {
                        seq: first_index + n,
                        key: key.encode(),
                    })
                    .await?;
            }
        }
    }
    tx.commit().await?;
    progress.finish();
    tracing::info!(rows = n, "first start: existing rows handed to the sink");
    Ok(n)
}
