//! The kit's setup of the inbox tables (`processed_messages`, `consumer_aggregate_versions`):
//! the migration files' `CREATE TABLE IF NOT EXISTS`, then an in-place migration of tables an
//! earlier release created, checked against the catalog first so that running it again
//! changes nothing. What the migration brings: the stale gate keys on the aggregate's type as
//! well as its id (order 42 and invoice 42 are different aggregates), and on MySQL/MariaDB
//! consumer names and ids become `VARBINARY`, compared byte for byte (a `VARCHAR`'s default
//! collation merges `Billing` with `billing`, `ORD-a` with `ord-A`, `café` with `cafe `).
//! Postgres compares text exactly already (a deterministic collation), so there only the key
//! changes.
//!
//! Rows are kept: a version stored before the migration becomes the version of the aggregate
//! of type `''`, which is what messages without `x-aggregate-type` are gated on.

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
    const TYPED: &str = "SELECT 1 FROM pg_attribute
          WHERE attrelid = 'consumer_aggregate_versions'::regclass
            AND attname = 'aggregate_type' AND NOT attisdropped";
    let tx = client.transaction().await?;
    tx.batch_execute(PG_DDL).await?;
    let mut done = Vec::new();
    if tx.query_opt(TYPED, &[]).await?.is_none() {
        tx.batch_execute("LOCK TABLE consumer_aggregate_versions IN ACCESS EXCLUSIVE MODE")
            .await?;
        if tx.query_opt(TYPED, &[]).await?.is_none() {
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
            tx.batch_execute(&format!(
                "ALTER TABLE consumer_aggregate_versions
                     ADD COLUMN aggregate_type text COLLATE \"C\" NOT NULL DEFAULT '',
                     {drop_pk}ADD PRIMARY KEY (consumer, aggregate_type, aggregate_id)"
            ))
            .await?;
            done.push(
                "consumer_aggregate_versions: added aggregate_type, keyed on (consumer, aggregate_type, aggregate_id)"
                    .to_string(),
            );
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
    if ty(v, "aggregate_type").is_none() {
        alter.extend([
            "ADD COLUMN aggregate_type VARBINARY(255) NOT NULL DEFAULT '' AFTER consumer",
            "DROP PRIMARY KEY",
            "ADD PRIMARY KEY (consumer, aggregate_type, aggregate_id)",
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
