//! The kit's setup of the inbox tables (`processed_messages`, `consumer_aggregate_versions`):
//! the migration files' `CREATE TABLE IF NOT EXISTS`, then an in-place migration of tables an
//! earlier release created, checked against the catalog first so that running it again
//! changes nothing. What the migration brings: the stale gate keys on the aggregate's outbox
//! table and type as well as its id (order 42 and invoice 42 are different aggregates, and so
//! are aggregate 7 of one outbox table and aggregate 7 of another), and on MySQL/MariaDB
//! consumer names and ids become `VARBINARY`, compared byte for byte (a `VARCHAR`'s default
//! collation merges `Billing` with `billing`, `ORD-a` with `ord-A`, `café` with `cafe `).
//! Postgres compares text exactly already (a deterministic collation), so there only the key
//! changes.
//!
//! Rows are kept: a version stored before the migration becomes the version of the aggregate
//! of table `''` and type `''`, which is what messages without `x-outbox-table` and
//! `x-aggregate-type` are gated on.

use super::ConsumerError;
#[cfg(feature = "mysql")]
use mysql_async::prelude::Queryable;

#[cfg(feature = "postgres")]
const PG_DDL: &str = include_str!("../../migrations/postgres/003_processed_messages.sql");
#[cfg(feature = "mysql")]
const MY_DDL: &str = include_str!("../../migrations/mysql/003_processed_messages.sql");

#[cfg(feature = "postgres")]
/// Creates the inbox tables on Postgres (in the session's schema), or migrates the ones there;
/// returns what it changed (empty when nothing was to do). One transaction; the table lock is
/// taken only when there is something to migrate (running consumers are not held up by a
/// setup that finds nothing to do), and a concurrent setup waiting on it then finds the work
/// done.
pub async fn postgres(client: &mut tokio_postgres::Client) -> Result<Vec<String>, ConsumerError> {
    // The key's columns an earlier release did not have, oldest first.
    const KEY_COLUMNS: [&str; 2] = ["aggregate_type", "outbox_table"];
    const MISSING: &str = "SELECT c FROM unnest($1::text[]) AS c
          WHERE NOT EXISTS (SELECT 1 FROM pg_attribute
                             WHERE attrelid = 'consumer_aggregate_versions'::regclass
                               AND attname = c AND NOT attisdropped)";
    let wanted: Vec<&str> = KEY_COLUMNS.to_vec();
    let tx = client.transaction().await?;
    tx.batch_execute(PG_DDL).await?;
    let mut done = Vec::new();
    if !tx.query(MISSING, &[&wanted]).await?.is_empty() {
        tx.batch_execute("LOCK TABLE consumer_aggregate_versions IN ACCESS EXCLUSIVE MODE")
            .await?;
        let missing: Vec<String> = tx
            .query(MISSING, &[&wanted])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        if !missing.is_empty() {
            let pk: Option<String> = tx
                .query_opt(
                    "SELECT conname::text FROM pg_constraint
                      WHERE conrelid = 'consumer_aggregate_versions'::regclass AND contype = 'p'",
                    &[],
                )
                .await?
                .map(|r| r.get(0));
            let drop_pk = pk
                .map(|n| format!("DROP CONSTRAINT {}, ", crate::names::pg_ident(&n)))
                .unwrap_or_default();
            let add: String = missing
                .iter()
                .map(|c| format!("ADD COLUMN {c} text COLLATE \"C\" NOT NULL DEFAULT '', "))
                .collect();
            tx.batch_execute(&format!(
                "ALTER TABLE consumer_aggregate_versions
                     {add}{drop_pk}ADD PRIMARY KEY (consumer, outbox_table, aggregate_type, aggregate_id)"
            ))
            .await?;
            done.push(format!(
                "consumer_aggregate_versions: added {}, keyed on (consumer, outbox_table, aggregate_type, aggregate_id)",
                missing.join(", ")
            ));
        }
    }
    tx.commit().await?;
    Ok(done)
}

#[cfg(feature = "mysql")]
/// Creates the inbox tables on MySQL/MariaDB (in the session's database), or migrates the
/// ones there; returns what it changed (empty when nothing was to do). A setup running at the
/// same moment may win the race to an `ALTER TABLE`; the catalog is read again then, and
/// finding the work done is success.
pub async fn mysql(conn: &mut mysql_async::Conn) -> Result<Vec<String>, ConsumerError> {
    conn.query_drop(MY_DDL).await?;
    match my_migrate(conn).await {
        Ok(done) => Ok(done),
        Err(e) => {
            if my_steps(conn).await?.is_empty() {
                Ok(Vec::new())
            } else {
                Err(e)
            }
        }
    }
}

#[cfg(feature = "mysql")]
async fn my_migrate(conn: &mut mysql_async::Conn) -> Result<Vec<String>, ConsumerError> {
    let steps = my_steps(conn).await?;
    let mut done = Vec::new();
    for (what, sql) in steps {
        conn.query_drop(sql).await?;
        done.push(what);
    }
    Ok(done)
}

#[cfg(feature = "mysql")]
/// The `ALTER TABLE`s still to run, with what each does, from the catalog.
async fn my_steps(conn: &mut mysql_async::Conn) -> Result<Vec<(String, String)>, ConsumerError> {
    let cols: Vec<(String, String, String)> = conn
        .query(
            "SELECT TABLE_NAME, COLUMN_NAME, DATA_TYPE FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = DATABASE()
                AND TABLE_NAME IN ('processed_messages', 'consumer_aggregate_versions')",
        )
        .await?;
    let ty = |t: &str, c: &str| {
        cols.iter()
            .find(|(tn, cn, _)| tn == t && cn == c)
            .map(|(_, _, d)| d.to_ascii_lowercase())
    };
    let mut steps = Vec::new();
    if ty("processed_messages", "consumer").as_deref() != Some("varbinary") {
        steps.push((
            "processed_messages: consumer compared byte for byte (VARBINARY)".to_string(),
            "ALTER TABLE processed_messages MODIFY consumer VARBINARY(100) NOT NULL".to_string(),
        ));
    }
    let v = "consumer_aggregate_versions";
    let mut alter = Vec::new();
    if ty(v, "consumer").as_deref() != Some("varbinary") {
        alter.push("MODIFY consumer VARBINARY(100) NOT NULL");
    }
    if ty(v, "aggregate_id").as_deref() != Some("varbinary") {
        alter.push("MODIFY aggregate_id VARBINARY(1024) NOT NULL");
    }
    // The key's columns an earlier release did not have, each after `consumer` in this order.
    let added: Vec<&str> = [
        (
            "aggregate_type",
            "ADD COLUMN aggregate_type VARBINARY(255) NOT NULL DEFAULT '' AFTER consumer",
        ),
        (
            "outbox_table",
            "ADD COLUMN outbox_table VARBINARY(255) NOT NULL DEFAULT '' AFTER consumer",
        ),
    ]
    .into_iter()
    .filter(|(c, _)| ty(v, c).is_none())
    .map(|(_, sql)| sql)
    .collect();
    if !added.is_empty() {
        alter.extend(added);
        alter.extend([
            "DROP PRIMARY KEY",
            "ADD PRIMARY KEY (consumer, outbox_table, aggregate_type, aggregate_id)",
        ]);
    }
    if !alter.is_empty() {
        steps.push((
            format!("{v}: {}", alter.join(", ")),
            format!("ALTER TABLE {v} {}", alter.join(", ")),
        ));
    }
    Ok(steps)
}
