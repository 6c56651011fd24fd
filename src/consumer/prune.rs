//! `outboxd prune`: deletes `processed_messages` or outbox rows older than a window, in small
//! batches, on Postgres and MySQL/MariaDB.
//!
//! Why batches: one `DELETE` of millions of rows holds its locks and its undo for the whole
//! statement, bloats the replication stream in one burst and stalls replicas. Each batch here
//! is one short statement (its own transaction), followed by a pause. The cutoff is computed
//! once, from the database clock, so rows written while the prune runs are never candidates.
//!
//! - Postgres: `DELETE … WHERE ctid = ANY(ARRAY(SELECT ctid … LIMIT n)) AND <condition>`; the
//!   condition is checked again on the row being deleted, so a row changed meanwhile (a poll
//!   relay marking it) is never deleted on stale information.
//! - MySQL: `DELETE … WHERE <condition> [ORDER BY time] LIMIT n`.
//!
//! One pruner per table at a time: `pg_try_advisory_lock` / `GET_LOCK` on a name derived from
//! the table; a second one stops with the holder's session.
//!
//! Which rows: for a dedupe table (columns `consumer`, `message_id`, `processed_at`) those
//! processed before the cutoff (optionally of one consumer); for an outbox table those created
//! before it — in poll mode only rows already `published` (a pending one is still to be sent).

use super::ConsumerError;
use crate::dsn::DbDsn;
#[cfg(feature = "postgres")]
use crate::outbox::pg_ident;
use crate::outbox::Mode;
use crate::outbox::{ColumnMap, TableName};
use std::fmt;
use std::time::{Duration, Instant};
#[cfg(feature = "postgres")]
use tokio_postgres::types::Type;
use tokio_util::sync::CancellationToken;

/// The shortest window pruned without `--force`: the relay's replay horizon.
pub const MIN_WINDOW: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Clone)]
pub struct PruneOptions {
    pub table: TableName,
    /// Column renames of an outbox table (`--column`).
    pub columns: ColumnMap,
    pub older_than: Duration,
    pub batch: u64,
    pub pause: Duration,
    pub dry_run: bool,
    pub force: bool,
    /// Poll mode: only `published` outbox rows are deleted.
    pub mode: Mode,
    /// Only this consumer's `processed_messages` rows.
    pub consumer: Option<String>,
}

/// What kind of table is pruned, found from its columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableKind {
    Processed,
    Outbox,
}

impl fmt::Display for TableKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TableKind::Processed => "processed_messages",
            TableKind::Outbox => "outbox",
        })
    }
}

/// Progress so far, and at the end the summary.
#[derive(Debug, Clone)]
pub struct PruneReport {
    pub table: String,
    pub kind: TableKind,
    /// The cutoff as the database printed it: rows older than this are deleted.
    pub cutoff: String,
    /// Rows deleted (with `--dry-run`: rows that would be).
    pub rows: u64,
    pub batches: u64,
    pub elapsed: Duration,
    pub dry_run: bool,
    /// Stopped by SIGINT/SIGTERM between batches.
    pub interrupted: bool,
    /// The planner's estimate of the rows to delete, read before the first batch (`None`:
    /// it could not say); for progress, never a promise.
    pub estimated: Option<u64>,
}

impl PruneReport {
    pub fn rows_per_sec(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.rows as f64 / s
        } else {
            0.0
        }
    }
}

/// "1 batch", "30 batches".
pub fn batches_text(n: u64) -> String {
    format!("{n} batch{}", if n == 1 { "" } else { "es" })
}

impl fmt::Display for PruneReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dry_run {
            return write!(
                f,
                "dry run: would delete {} rows from {} ({}) older than {} in {}; nothing deleted",
                self.rows,
                self.table,
                self.kind,
                self.cutoff,
                batches_text(self.batches)
            );
        }
        write!(
            f,
            "{}: deleted {} rows from {} ({}) older than {} in {}, {:.1}s, {:.0} rows/s",
            if self.interrupted {
                "interrupted"
            } else {
                "done"
            },
            self.rows,
            self.table,
            self.kind,
            self.cutoff,
            batches_text(self.batches),
            self.elapsed.as_secs_f64(),
            self.rows_per_sec()
        )
    }
}

/// Refuses a window shorter than [`MIN_WINDOW`] unless forced, saying why.
pub fn check_window(
    kind: TableKind,
    older_than: Duration,
    force: bool,
) -> Result<(), ConsumerError> {
    if older_than >= MIN_WINDOW || force {
        return Ok(());
    }
    let shown = humanize(older_than);
    let replay = "the relay can deliver an event again long after the first time: after a crash it republishes what the broker had not confirmed, recovery through the table (--on-position-lost poll) republishes rows created since the last confirmed commit minus --recovery-margin (or the largest commit gap seen), --snapshot since=TIME and `offset set --replay-since TIME` republish every row since TIME, and the broker redelivers whatever was unacked";
    let problem = match kind {
        TableKind::Processed => format!(
            "--older-than {shown} is shorter than the 1 day replay horizon: refusing to prune processed_messages rows this young. A message redelivered after its row is pruned runs its effect twice, and {replay}"
        ),
        TableKind::Outbox => format!(
            "--older-than {shown} is shorter than the 1 day replay horizon: refusing to prune outbox rows this young. Recovery through the table and replays read these rows; pruned, an event cannot be published again, and one republished after the consumers pruned its processed_messages row runs its effect twice ({replay})"
        ),
    };
    Err(ConsumerError::config(
        problem,
        "keep rows longer than any redelivery can come, e.g. --older-than 7d; add --force only if no replay or redelivery can reach back that far",
    ))
}

fn humanize(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 86400 && s.is_multiple_of(86400) {
        format!("{}d", s / 86400)
    } else if s >= 3600 && s.is_multiple_of(3600) {
        format!("{}h", s / 3600)
    } else if s >= 60 && s.is_multiple_of(60) {
        format!("{}m", s / 60)
    } else if d.subsec_millis() == 0 {
        format!("{s}s")
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// The kind from the table's columns (lowercase names).
fn kind_of(cols: &[String], opts: &PruneOptions, shown: &str) -> Result<TableKind, ConsumerError> {
    let has = |c: &str| cols.iter().any(|x| x.eq_ignore_ascii_case(c));
    if cols.is_empty() {
        return Err(ConsumerError::config(
            format!("table {shown} does not exist"),
            "name an existing table: --table processed_messages or --table outbox (schema- or database-qualified if needed)",
        ));
    }
    let kind = if has("consumer") && has("message_id") && has("processed_at") {
        TableKind::Processed
    } else if has(opts.columns.get(crate::names::Column::CreatedAt)) {
        TableKind::Outbox
    } else {
        return Err(ConsumerError::config(
            format!("table {shown} is neither a processed_messages table (consumer, message_id, processed_at) nor an outbox table (created_at)"),
            "name the dedupe table or the outbox table; map a renamed outbox column with --column created_at=…",
        ));
    };
    if kind == TableKind::Outbox && opts.consumer.is_some() {
        return Err(ConsumerError::config(
            "--consumer applies to processed_messages tables",
            "drop --consumer when pruning the outbox",
        ));
    }
    if kind == TableKind::Outbox
        && opts.mode == Mode::Poll
        && !has(opts.columns.get(crate::names::Column::Status))
    {
        return Err(ConsumerError::config(
            format!("--mode poll prunes only published rows, but {shown} has no status column"),
            "map it with --column status=…, or use --mode cdc (the relay never updates rows in CDC mode)",
        ));
    }
    Ok(kind)
}

/// The time column and the extra condition for `kind`.
fn time_column(kind: TableKind, opts: &PruneOptions) -> &str {
    match kind {
        TableKind::Processed => "processed_at",
        TableKind::Outbox => opts.columns.get(crate::names::Column::CreatedAt),
    }
}

fn batches_for(rows: u64, batch: u64) -> u64 {
    rows.div_ceil(batch.max(1))
}

/// Sleeps `d` unless the shutdown comes first (then `false`).
async fn pause(d: Duration, shutdown: &CancellationToken) -> bool {
    if d.is_zero() {
        return !shutdown.is_cancelled();
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = shutdown.cancelled() => false,
    }
}

fn lock_name(qualified: &str) -> String {
    let name = format!("outboxd_prune:{qualified}");
    // MySQL lock names are at most 64 characters.
    if name.len() <= 64 {
        return name;
    }
    let k = super::IdempotencyKey::derive(uuid::Uuid::nil(), "outboxd_prune", qualified);
    format!("outboxd_prune:{}", &k.hex()[..40])
}

/// The rows a prune deletes: older than the cutoff by the time column, of one consumer
/// (`--consumer`), and in poll mode only published ones. Names unquoted: each database quotes
/// them and writes the placeholders its own way.
struct Filter {
    time: String,
    consumer: bool,
    /// The status column, when only `published` rows may go (poll mode).
    status: Option<String>,
}

impl Filter {
    fn new(kind: TableKind, opts: &PruneOptions) -> Filter {
        Filter {
            time: time_column(kind, opts).to_string(),
            consumer: opts.consumer.is_some(),
            status: (kind == TableKind::Outbox && opts.mode == Mode::Poll)
                .then(|| opts.columns.get(crate::names::Column::Status).to_string()),
        }
    }

    /// `time < P1 [AND consumer = P2] [AND status = 'published']`, with `quote` quoting a name
    /// and `param(i)` the i-th (1-based) placeholder.
    fn sql(&self, quote: impl Fn(&str) -> String, param: impl Fn(usize) -> String) -> String {
        let mut cond = format!("{} < {}", quote(&self.time), param(1));
        if self.consumer {
            cond.push_str(&format!(" AND consumer = {}", param(2)));
        }
        if let Some(status) = &self.status {
            cond.push_str(&format!(" AND {} = 'published'", quote(status)));
        }
        cond
    }
}

/// What one database does for a prune; [`prune`] owns the order, the same for both: the kind
/// from the table's columns, the window check, the cutoff from the database's clock, then a
/// count (`--dry-run`) or the lock, the batch statement, the batches and the unlock.
trait Backend {
    /// The table as messages name it.
    fn shown(&self) -> &str;
    /// The table's column names, lowercase; empty when it does not exist.
    async fn columns(&mut self) -> Result<Vec<String>, ConsumerError>;
    /// Reads the database's clock minus `older_than` and keeps it to bind (with `consumer`);
    /// returns it as the database prints it.
    async fn cutoff(
        &mut self,
        older_than: Duration,
        consumer: Option<&str>,
    ) -> Result<String, ConsumerError>;
    /// How many rows `filter` selects.
    async fn count(&mut self, filter: &Filter) -> Result<u64, ConsumerError>;
    /// The planner's estimate of that count (`EXPLAIN`, no scan); `None` when it cannot say.
    async fn estimate(&mut self, filter: &Filter) -> Option<u64>;
    /// Takes the table's prune lock; refused, naming the holder, while another prune has it.
    async fn lock(&mut self) -> Result<(), ConsumerError>;
    /// The statement deleting one batch of `batch` rows, after the index checks the database
    /// needs (the lock is held; an error here is returned after the unlock).
    async fn batch_statement(
        &mut self,
        filter: &Filter,
        batch: u64,
    ) -> Result<String, ConsumerError>;
    /// Runs one batch; the rows it deleted.
    async fn delete(&mut self, sql: &str) -> Result<u64, ConsumerError>;
    /// Gives the lock up (and the session).
    async fn unlock(&mut self);
}

/// The refusal of a second prune of `shown` while `holder` holds `lock`.
fn already_pruning(shown: &str, holder: &str, lock: &str) -> ConsumerError {
    ConsumerError::Database {
        message: format!(
            "another outboxd prune of {shown} is running: {holder} holds {lock}; one pruner at a time"
        ),
        retryable: false,
    }
}

/// Prunes through `db` (see the module's documentation). `progress` sees the report after
/// every batch.
async fn prune<B: Backend>(
    db: &mut B,
    opts: &PruneOptions,
    progress: &mut (dyn FnMut(&PruneReport) + Send),
    shutdown: &CancellationToken,
) -> Result<PruneReport, ConsumerError> {
    let cols = db.columns().await?;
    let kind = kind_of(&cols, opts, db.shown())?;
    if !opts.dry_run {
        check_window(kind, opts.older_than, opts.force)?;
    }
    let filter = Filter::new(kind, opts);
    let cutoff = db.cutoff(opts.older_than, opts.consumer.as_deref()).await?;
    let mut report = PruneReport {
        table: db.shown().to_string(),
        kind,
        cutoff,
        rows: 0,
        batches: 0,
        elapsed: Duration::ZERO,
        dry_run: opts.dry_run,
        interrupted: false,
        estimated: None,
    };
    let start = Instant::now();
    if opts.dry_run {
        report.rows = db.count(&filter).await?;
        report.batches = batches_for(report.rows, opts.batch);
        report.elapsed = start.elapsed();
        return Ok(report);
    }
    db.lock().await?;
    report.estimated = db.estimate(&filter).await;
    let result = async {
        let sql = db.batch_statement(&filter, opts.batch).await?;
        loop {
            let n = db.delete(&sql).await?;
            if n == 0 {
                break;
            }
            report.rows += n;
            report.batches += 1;
            report.elapsed = start.elapsed();
            progress(&report);
            if !pause(opts.pause, shutdown).await {
                report.interrupted = true;
                break;
            }
        }
        Ok::<_, ConsumerError>(())
    }
    .await;
    db.unlock().await;
    result?;
    report.elapsed = start.elapsed();
    Ok(report)
}

#[cfg(feature = "postgres")]
/// Prunes a Postgres table. `progress` sees the report after every batch.
pub async fn prune_postgres(
    dsn: &DbDsn,
    opts: &PruneOptions,
    progress: &mut (dyn FnMut(&PruneReport) + Send),
    shutdown: &CancellationToken,
) -> Result<PruneReport, ConsumerError> {
    let client = crate::db::postgres::connect_sql(dsn, "outboxd_prune").await?;
    let mut db = PgPrune {
        client,
        shown: opts.table.pg_quoted(),
        schema: opts.table.pg_schema().to_string(),
        table: opts.table.name.clone(),
        key: String::new(),
        cutoff: chrono::DateTime::<chrono::Utc>::MIN_UTC,
        consumer: None,
        batch: 0,
    };
    db.key = lock_name(&format!("{}.{}", db.schema, db.table));
    prune(&mut db, opts, progress, shutdown).await
}

/// A prune's Postgres session: `DELETE … WHERE ctid = ANY(ARRAY(SELECT ctid … LIMIT n)) AND
/// <condition>`, under `pg_try_advisory_lock`.
#[cfg(feature = "postgres")]
struct PgPrune {
    client: tokio_postgres::Client,
    shown: String,
    schema: String,
    table: String,
    /// The advisory lock's name.
    key: String,
    cutoff: chrono::DateTime<chrono::Utc>,
    consumer: Option<String>,
    /// The batch size, bound as the DELETE's last parameter.
    batch: i64,
}

#[cfg(feature = "postgres")]
type PgParam<'a> = (&'a (dyn tokio_postgres::types::ToSql + Sync), Type);

#[cfg(feature = "postgres")]
impl PgPrune {
    /// The filter's parameters: the cutoff, then the consumer when there is one.
    fn params(&self) -> Vec<PgParam<'_>> {
        let mut params: Vec<PgParam<'_>> = vec![(&self.cutoff, Type::TIMESTAMPTZ)];
        if let Some(c) = &self.consumer {
            params.push((c, Type::TEXT));
        }
        params
    }

    fn condition(&self, filter: &Filter) -> String {
        filter.sql(pg_ident, |i| format!("${i}"))
    }

    /// The holder of the advisory lock, as a refusal can name it.
    async fn lock_holder(&self) -> Result<String, ConsumerError> {
        Ok(self
            .client
            .query_opt(
                "SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.client_addr::text, 'local')
                   FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                  WHERE l.locktype = 'advisory' AND l.granted
                    AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                    AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended($1, 0)
                  LIMIT 1",
                &[&self.key],
            )
            .await?
            .map(|r| {
                format!(
                    "backend pid {} ({}, from {})",
                    r.get::<_, i32>(0),
                    r.get::<_, String>(1),
                    r.get::<_, String>(2)
                )
            })
            .unwrap_or_else(|| "another session".into()))
    }
}

#[cfg(feature = "postgres")]
impl Backend for PgPrune {
    fn shown(&self) -> &str {
        &self.shown
    }

    async fn columns(&mut self) -> Result<Vec<String>, ConsumerError> {
        Ok(self.client
            .query(
                "SELECT column_name::text FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2",
                &[&self.schema, &self.table],
            )
            .await?
            .iter()
            .map(|r| r.get::<_, String>(0).to_lowercase())
            .collect())
    }

    async fn cutoff(
        &mut self,
        older_than: Duration,
        consumer: Option<&str>,
    ) -> Result<String, ConsumerError> {
        self.cutoff = self
            .client
            .query_one(
                "SELECT now() - $1::float8 * interval '1 second'",
                &[&older_than.as_secs_f64()],
            )
            .await?
            .get(0);
        self.consumer = consumer.map(str::to_string);
        Ok(self
            .cutoff
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
    }

    async fn count(&mut self, filter: &Filter) -> Result<u64, ConsumerError> {
        let sql = format!(
            "SELECT count(*) FROM {} WHERE {}",
            self.shown,
            self.condition(filter)
        );
        let n: i64 = self.client.query_typed(&sql, &self.params()).await?[0].get(0);
        Ok(n as u64)
    }

    async fn estimate(&mut self, filter: &Filter) -> Option<u64> {
        let sql = format!(
            "EXPLAIN (FORMAT JSON) SELECT 1 FROM {} WHERE {}",
            self.shown,
            self.condition(filter)
        );
        let rows = self.client.query_typed(&sql, &self.params()).await.ok()?;
        let plan: serde_json::Value = rows.first()?.try_get(0).ok()?;
        let n = plan.get(0)?.get("Plan")?.get("Plan Rows")?.as_f64()?;
        Some(n.max(0.0) as u64)
    }

    async fn lock(&mut self) -> Result<(), ConsumerError> {
        let locked: bool = self
            .client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                &[&self.key],
            )
            .await?
            .get(0);
        if locked {
            return Ok(());
        }
        let holder = self.lock_holder().await?;
        Err(already_pruning(
            &self.shown,
            &holder,
            &format!("the advisory lock {:?}", self.key),
        ))
    }

    async fn batch_statement(
        &mut self,
        filter: &Filter,
        batch: u64,
    ) -> Result<String, ConsumerError> {
        self.batch = batch as i64;
        let (shown, time) = (&self.shown, pg_ident(&filter.time));
        // ORDER BY the time column only when a full (not partial) index leads with it (poll
        // mode: (status, time) also serves); without one, a sort per batch would read every
        // candidate each time.
        let indexed: bool = self.client
            .query_one(
                "SELECT EXISTS (
                   SELECT 1 FROM pg_index i
                     JOIN pg_attribute a0 ON a0.attrelid = i.indrelid AND a0.attnum = i.indkey[0]
                     LEFT JOIN pg_attribute a1 ON a1.attrelid = i.indrelid AND a1.attnum = i.indkey[1]
                    WHERE i.indrelid = $1::text::regclass AND i.indpred IS NULL
                      AND (a0.attname = $2 OR ($3 AND a0.attname = $4 AND a1.attname = $2)))",
                &[
                    shown,
                    &filter.time,
                    &filter.status.is_some(),
                    &filter.status.as_deref().unwrap_or_default(),
                ],
            )
            .await?
            .get(0);
        if !indexed {
            tracing::warn!(
                "{shown} has no index on {time}: every batch scans for candidates; CREATE INDEX CONCURRENTLY ON {shown} ({time}) makes pruning cheaper"
            );
        }
        let order = if indexed {
            format!(" ORDER BY {time}")
        } else {
            String::new()
        };
        let cond = self.condition(filter);
        // The batch size is the last parameter.
        let limit = format!("${}", self.params().len() + 1);
        Ok(format!(
            "DELETE FROM {shown} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {shown} WHERE {cond}{order} LIMIT {limit})) AND {cond}"
        ))
    }

    async fn delete(&mut self, sql: &str) -> Result<u64, ConsumerError> {
        let mut params = self.params();
        params.push((&self.batch, Type::INT8));
        Ok(self.client.execute_typed(sql, &params).await?)
    }

    async fn unlock(&mut self) {
        let _ = self
            .client
            .execute(
                "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
                &[&self.key],
            )
            .await;
    }
}

#[cfg(feature = "mysql")]
/// Prunes a MySQL/MariaDB table (see [`prune_postgres`]).
pub async fn prune_mysql(
    dsn: &DbDsn,
    opts: &PruneOptions,
    progress: &mut (dyn FnMut(&PruneReport) + Send),
    shutdown: &CancellationToken,
) -> Result<PruneReport, ConsumerError> {
    use mysql_async::prelude::Queryable;
    let mut conn = super::mysql::connect(dsn).await?;
    let db: Option<String> = match &opts.table.schema {
        Some(s) => Some(s.clone()),
        None => conn.query_first("SELECT DATABASE()").await?.flatten(),
    };
    let Some(db) = db else {
        return Err(ConsumerError::config(
            "no database: the DSN names none and --table is not qualified",
            "write mysql://user@host:3306/app or --table app.processed_messages",
        ));
    };
    let mut my = MyPrune {
        conn: Some(conn),
        shown: super::mysql::quoted(&opts.table),
        key: lock_name(&format!("{db}.{}", opts.table.name)),
        db,
        table: opts.table.name.clone(),
        params: Vec::new(),
    };
    let r = prune(&mut my, opts, progress, shutdown).await;
    if let Some(conn) = my.conn.take() {
        let _ = conn.disconnect().await;
    }
    r
}

/// A prune's MySQL/MariaDB session: `DELETE … WHERE <condition> ORDER BY time LIMIT n`, under
/// `GET_LOCK`.
#[cfg(feature = "mysql")]
struct MyPrune {
    /// Taken only at the end (to disconnect).
    conn: Option<mysql_async::Conn>,
    shown: String,
    db: String,
    table: String,
    /// The `GET_LOCK` name.
    key: String,
    /// The filter's parameters: the cutoff, then the consumer when there is one.
    params: Vec<mysql_async::Value>,
}

#[cfg(feature = "mysql")]
impl MyPrune {
    fn conn(&mut self) -> &mut mysql_async::Conn {
        self.conn.as_mut().expect("open until the prune ends")
    }

    fn condition(filter: &Filter) -> String {
        filter.sql(crate::outbox::my_ident, |_| "?".to_string())
    }
}

#[cfg(feature = "mysql")]
impl Backend for MyPrune {
    fn shown(&self) -> &str {
        &self.shown
    }

    async fn columns(&mut self) -> Result<Vec<String>, ConsumerError> {
        use mysql_async::prelude::Queryable;
        let (db, table) = (self.db.clone(), self.table.clone());
        Ok(self.conn()
            .exec::<String, _, _>(
                "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
                (db, table),
            )
            .await?
            .into_iter()
            .map(|c| c.to_lowercase())
            .collect())
    }

    async fn cutoff(
        &mut self,
        older_than: Duration,
        consumer: Option<&str>,
    ) -> Result<String, ConsumerError> {
        use mysql_async::prelude::Queryable;
        let micros = older_than.as_micros() as u64;
        let (cutoff, cutoff_text): (mysql_async::Value, String) = self
            .conn()
            .exec_first(
                "SELECT NOW(6) - INTERVAL ? MICROSECOND, CAST(NOW(6) - INTERVAL ? MICROSECOND AS CHAR)",
                (micros, micros),
            )
            .await?
            .ok_or_else(|| ConsumerError::Database {
                message: "the server returned no clock".into(),
                retryable: true,
            })?;
        self.params = vec![cutoff];
        if let Some(c) = consumer {
            self.params.push(c.into());
        }
        Ok(cutoff_text)
    }

    async fn count(&mut self, filter: &Filter) -> Result<u64, ConsumerError> {
        use mysql_async::prelude::Queryable;
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE {}",
            self.shown,
            Self::condition(filter)
        );
        let params = self.params.clone();
        let n: Option<u64> = self.conn().exec_first(sql, params).await?;
        Ok(n.unwrap_or(0))
    }

    async fn estimate(&mut self, filter: &Filter) -> Option<u64> {
        use mysql_async::prelude::Queryable;
        let sql = format!(
            "EXPLAIN SELECT 1 FROM {} WHERE {}",
            self.shown,
            Self::condition(filter)
        );
        let params = self.params.clone();
        let rows: Vec<mysql_async::Row> = self.conn().exec(sql, params).await.ok()?;
        rows.first()?.get_opt::<Option<u64>, _>("rows")?.ok()?
    }

    async fn lock(&mut self) -> Result<(), ConsumerError> {
        use mysql_async::prelude::Queryable;
        let key = self.key.clone();
        let got: Option<Option<i64>> = self
            .conn()
            .exec_first("SELECT GET_LOCK(?, 0)", (key.as_str(),))
            .await?;
        if got.flatten() == Some(1) {
            return Ok(());
        }
        let holder: Option<Option<u64>> = self
            .conn()
            .exec_first("SELECT IS_USED_LOCK(?)", (key.as_str(),))
            .await?;
        let holder = match holder.flatten() {
            Some(id) => format!("connection {id}"),
            None => "another session".into(),
        };
        Err(already_pruning(
            &self.shown,
            &holder,
            &format!("GET_LOCK({key:?})"),
        ))
    }

    async fn batch_statement(
        &mut self,
        filter: &Filter,
        batch: u64,
    ) -> Result<String, ConsumerError> {
        use mysql_async::prelude::Queryable;
        let q = crate::outbox::my_ident;
        let (db, table) = (self.db.clone(), self.table.clone());
        let status = filter.status.clone().unwrap_or_default();
        let indexed: Option<u64> = self.conn()
            .exec_first(
                "SELECT COUNT(*) FROM information_schema.STATISTICS s
                  WHERE s.TABLE_SCHEMA = ? AND s.TABLE_NAME = ?
                    AND ((s.SEQ_IN_INDEX = 1 AND s.COLUMN_NAME = ?)
                      OR (? AND s.SEQ_IN_INDEX = 2 AND s.COLUMN_NAME = ? AND EXISTS (
                            SELECT 1 FROM information_schema.STATISTICS f
                             WHERE f.TABLE_SCHEMA = s.TABLE_SCHEMA AND f.TABLE_NAME = s.TABLE_NAME
                               AND f.INDEX_NAME = s.INDEX_NAME AND f.SEQ_IN_INDEX = 1 AND f.COLUMN_NAME = ?)))",
                (
                    db.as_str(),
                    table.as_str(),
                    filter.time.as_str(),
                    filter.status.is_some(),
                    filter.time.as_str(),
                    status.as_str(),
                ),
            )
            .await?;
        let (shown, time) = (&self.shown, q(&filter.time));
        if indexed.unwrap_or(0) == 0 {
            // Without it each batch's DELETE scans the whole clustered index under next-key
            // locks: it waits for every producer's open transaction it meets and, meanwhile,
            // holds the gaps it passed against every other producer's insert (under READ
            // COMMITTED too: a DELETE takes no semi-consistent reads). With it, the range
            // stays on old rows.
            let columns = match &filter.status {
                Some(status) => format!("{}, {time}", q(status)),
                None => time.clone(),
            };
            return Err(ConsumerError::config(
                format!("{shown} has no index starting with ({columns}): pruning it would scan the table under locks that block producers"),
                format!("ALTER TABLE {shown} ADD INDEX ({columns}) (once; migrations/mysql/001_outbox.sql has it), then prune again"),
            ));
        }
        Ok(format!(
            "DELETE FROM {shown} WHERE {} ORDER BY {time} LIMIT {batch}",
            Self::condition(filter)
        ))
    }

    async fn delete(&mut self, sql: &str) -> Result<u64, ConsumerError> {
        use mysql_async::prelude::Queryable;
        let params = self.params.clone();
        let conn = self.conn();
        conn.exec_drop(sql, params).await?;
        Ok(conn.affected_rows())
    }

    async fn unlock(&mut self) {
        use mysql_async::prelude::Queryable;
        let key = self.key.clone();
        let _ = self
            .conn()
            .exec_drop("SELECT RELEASE_LOCK(?)", (key.as_str(),))
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_windows_are_refused_with_the_reason() {
        let day = Duration::from_secs(86400);
        assert!(check_window(TableKind::Processed, day * 7, false).is_ok());
        assert!(check_window(TableKind::Processed, day, false).is_ok());
        let e = check_window(TableKind::Processed, Duration::from_secs(3600), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--older-than 1h"), "{e}");
        assert!(e.contains("runs its effect twice"), "{e}");
        assert!(
            e.contains("--recovery-margin") && e.contains("--snapshot since"),
            "{e}"
        );
        assert!(e.contains("--force"), "{e}");
        let e = check_window(TableKind::Outbox, Duration::from_secs(60), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("outbox rows"), "{e}");
        assert!(check_window(TableKind::Outbox, Duration::from_secs(60), true).is_ok());
    }

    #[test]
    fn summaries() {
        let r = PruneReport {
            table: "\"public\".\"processed_messages\"".into(),
            kind: TableKind::Processed,
            cutoff: "2026-01-01T00:00:00Z".into(),
            rows: 20_000,
            batches: 2,
            elapsed: Duration::from_secs(2),
            dry_run: false,
            interrupted: false,
            estimated: None,
        };
        let s = r.to_string();
        assert!(s.starts_with("done: deleted 20000 rows"), "{s}");
        assert!(s.contains("10000 rows/s"), "{s}");
        let d = PruneReport { dry_run: true, ..r };
        assert!(d.to_string().contains("nothing deleted"));
        assert_eq!(batches_for(20_001, 10_000), 3);
        assert_eq!(humanize(Duration::from_secs(7 * 86400)), "7d");
        assert_eq!(humanize(Duration::from_millis(1500)), "1500ms");
        assert!(lock_name(&"x".repeat(100)).len() <= 64);
    }
}
