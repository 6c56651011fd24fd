//! The first-start snapshot on MySQL/MariaDB (docs/message-format.md): rows already in the outbox table
//! when a relay first starts must not be lost. A REPEATABLE READ session opens
//! `START TRANSACTION WITH CONSISTENT SNAPSHOT`; on MariaDB the server then reports the exact
//! binlog coordinates of that snapshot (`binlog_snapshot_file` / `binlog_snapshot_position`
//! status) and `BINLOG_GTID_POS` gives the GTID state there: the snapshot and the stream meet
//! without gap or overlap. On MySQL (no such status) the position is read just before the
//! snapshot opens: an overlap gives duplicates, never a gap.
//!
//! The rows are read in that transaction in `created_at, id` order, one at a time from the
//! server (memory stays bounded), mapped by the same column rules as binlog rows, and sent as
//! events positioned at the snapshot's coordinates (before every streamed event).

use super::rows::{ColumnInfo, OutboxTable, RowContext};
use super::{admin, gtid::GtidState, Resume};
use crate::event::Checkpoint;
use crate::outbox::{my_ident, Column};
use crate::progress::Progress;
use crate::source::snapshot::{and_where, SnapshotKey, SnapshotMode, SnapshotPlan};
use crate::source::Outlet;
use crate::Error;
use mysql_async::binlog::value::BinlogValue;
use mysql_async::consts::ColumnType;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row, Value};

/// COLUMN_NAME, DATA_TYPE, CHARACTER_SET_NAME, CHARACTER_OCTET_LENGTH.
type ColumnRow = (String, String, Option<String>, Option<u64>);

/// The table's columns from `information_schema`, in the form a table map gives them.
pub(crate) async fn table_columns(
    conn: &mut Conn,
    table: &OutboxTable,
) -> Result<Vec<ColumnInfo>, Error> {
    let rows: Vec<ColumnRow> = conn
        .exec(
            "SELECT COLUMN_NAME, DATA_TYPE, CHARACTER_SET_NAME, CHARACTER_OCTET_LENGTH
               FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? ORDER BY ORDINAL_POSITION",
            (&table.database, &table.table),
        )
        .await?;
    Ok(rows
        .into_iter()
        .map(|(name, data_type, charset, octets)| {
            let dt = data_type.to_ascii_lowercase();
            let binary_type = matches!(
                dt.as_str(),
                "binary" | "varbinary" | "tinyblob" | "blob" | "mediumblob" | "longblob"
            );
            use ColumnType::*;
            let ty = match dt.as_str() {
                "tinyint" => Some(MYSQL_TYPE_TINY),
                "smallint" => Some(MYSQL_TYPE_SHORT),
                "mediumint" => Some(MYSQL_TYPE_INT24),
                "int" | "integer" => Some(MYSQL_TYPE_LONG),
                "bigint" => Some(MYSQL_TYPE_LONGLONG),
                "char" | "binary" => Some(MYSQL_TYPE_STRING),
                "varchar" | "varbinary" => Some(MYSQL_TYPE_VARCHAR),
                "tinytext" | "text" | "mediumtext" | "longtext" | "tinyblob" | "blob"
                | "mediumblob" | "longblob" => Some(MYSQL_TYPE_BLOB),
                "json" => Some(MYSQL_TYPE_JSON),
                "datetime" => Some(MYSQL_TYPE_DATETIME2),
                "timestamp" => Some(MYSQL_TYPE_TIMESTAMP2),
                _ => None,
            };
            ColumnInfo {
                name,
                ty,
                binary: binary_type || charset.as_deref() == Some("binary"),
                len: octets.unwrap_or(0) as usize,
            }
        })
        .collect())
}

/// What a first start (or a replay) publishes of each table's existing rows, [`plan`] per
/// table in their order.
pub(crate) async fn plan_tables(
    conn: &mut Conn,
    tables: &[OutboxTable],
    mode: &SnapshotMode,
) -> Result<Vec<(OutboxTable, SnapshotPlan)>, Error> {
    let mut plans = Vec::with_capacity(tables.len());
    for t in tables {
        plans.push((t.clone(), plan(conn, t, mode).await?));
    }
    Ok(plans)
}

/// Decides what a first start publishes. `auto` on a table without a status column refuses
/// (exit 2) when rows exist, saying how many and which options there are.
pub(crate) async fn plan(
    conn: &mut Conn,
    table: &OutboxTable,
    mode: &SnapshotMode,
) -> Result<SnapshotPlan, Error> {
    let cols = table_columns(conn, table).await?;
    let created = table.columns.get(Column::CreatedAt);
    let created_col = cols.iter().find(|c| c.name.eq_ignore_ascii_case(created));
    if created_col.is_none() {
        crate::source::snapshot::require_created_at(mode, &table.quoted(), created)?;
    }
    let status = table.columns.get(Column::Status);
    Ok(match mode {
        SnapshotMode::Never => SnapshotPlan::Nothing,
        SnapshotMode::All => SnapshotPlan::Rows {
            filter: String::new(),
            what: "every row".into(),
        },
        SnapshotMode::Since(ts) => {
            // TIMESTAMP compares in the session zone (UTC while reading); DATETIME holds
            // wall-clock time in the source zone.
            let literal =
                if created_col.and_then(|c| c.ty) == Some(ColumnType::MYSQL_TYPE_TIMESTAMP2) {
                    ts.naive_utc()
                } else {
                    table.tz.from_utc(*ts)
                };
            SnapshotPlan::Rows {
                filter: format!(
                    "WHERE {} >= '{}'",
                    my_ident(created),
                    literal.format("%Y-%m-%d %H:%M:%S%.6f")
                ),
                what: format!("rows created since {}", ts.to_rfc3339()),
            }
        }
        SnapshotMode::Auto if cols.iter().any(|c| c.name.eq_ignore_ascii_case(status)) => {
            SnapshotPlan::Rows {
                filter: format!("WHERE {} = 'pending'", my_ident(status)),
                what: "pending rows".into(),
            }
        }
        SnapshotMode::Auto => {
            let n: Option<i64> = conn
                .query_first(format!("SELECT COUNT(*) FROM {}", table.quoted()))
                .await?;
            let n = n.unwrap_or(0);
            if n == 0 {
                SnapshotPlan::Nothing
            } else {
                return Err(Error::config(
                    format!(
                        "first start: {} already holds {n} row{} and has no status column to tell which were published",
                        table.quoted(),
                        if n == 1 { "" } else { "s" }
                    ),
                    "choose: --snapshot all (publish them all), --snapshot never (publish none), \
                     or --snapshot since=<RFC 3339 time> (publish rows created since then)",
                ));
            }
        }
    })
}

/// What `--snapshot auto` publishes of a table without a status column that was empty when
/// the start first looked (its plan is `Nothing`), once the stream's position exists: every
/// row in it then was committed after that look, and may have committed before the position,
/// so it is read whole (a row also in the stream is a duplicate, never a gap).
pub(crate) fn appeared_since_empty() -> SnapshotPlan {
    SnapshotPlan::Rows {
        filter: String::new(),
        what: "rows committed while the relay started on the empty table".into(),
    }
}

/// The tables planned `Nothing` by `--snapshot auto` (empty at the first look) looked at again
/// once the stream's position was read: those holding rows now are planned
/// [`appeared_since_empty`]. Whether any was.
pub(crate) async fn look_again(
    conn: &mut Conn,
    plans: &mut [(OutboxTable, SnapshotPlan)],
) -> Result<bool, Error> {
    let mut any = false;
    for (table, plan) in plans.iter_mut() {
        if *plan != SnapshotPlan::Nothing {
            continue;
        }
        let n: Option<i64> = conn
            .query_first(format!("SELECT COUNT(*) FROM {}", table.quoted()))
            .await?;
        if n.unwrap_or(0) > 0 {
            tracing::info!(table = %table.quoted(), rows = n.unwrap_or(0), "first start: rows committed while the start position was read (the table was empty before): publishing them");
            *plan = appeared_since_empty();
            any = true;
        }
    }
    Ok(any)
}

/// An open consistent snapshot and the binlog position it was taken at.
pub struct Snapshot {
    conn: Conn,
    /// What to read of each outbox table (one consistent snapshot covers them all).
    plans: Vec<(OutboxTable, SnapshotPlan)>,
    pub at: Resume,
    /// How far an interrupted run of this first start got: only later rows are read.
    pub after: Option<SnapshotKey>,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("plans", &self.plans)
            .field("at", &self.at)
            .field("after", &self.after)
            .finish()
    }
}

fn text(row: &Row, i: usize) -> String {
    match row.as_ref(i) {
        Some(Value::Bytes(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(Value::Int(n)) => n.to_string(),
        Some(Value::UInt(n)) => n.to_string(),
        _ => String::new(),
    }
}

/// Opens the consistent snapshot on a session of its own and learns its binlog position.
pub(crate) async fn begin(
    mut conn: Conn,
    mariadb: bool,
    plans: Vec<(OutboxTable, SnapshotPlan)>,
) -> Result<Snapshot, Error> {
    conn.query_drop("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await?;
    // TIMESTAMP values and comparisons in UTC.
    conn.query_drop("SET time_zone = '+00:00'").await?;
    // MySQL has no binlog_snapshot_* status: the position is read just before the snapshot
    // opens, from performance_schema.log_status where readable (position and executed GTID
    // set taken together while commits are blocked), else from SHOW BINARY LOG STATUS.
    let before = if mariadb {
        None
    } else {
        Some(match admin::log_status(&mut conn).await {
            Some(head) => Resume::from_mysql_head(head),
            None => super::current_position(&mut conn, false).await?,
        })
    };
    conn.query_drop("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        .await?;
    let at = match before {
        Some(at) => at,
        None => {
            let rows: Vec<Row> = conn.query("SHOW STATUS LIKE 'binlog_snapshot_%'").await?;
            let get = |name: &str| {
                rows.iter()
                    .find(|r| text(r, 0).eq_ignore_ascii_case(name))
                    .map(|r| text(r, 1))
            };
            let (Some(file), Some(pos)) =
                (get("binlog_snapshot_file"), get("binlog_snapshot_position"))
            else {
                return Err(Error::Other(
                    "the server reports no binlog_snapshot_file/position for the consistent snapshot".into(),
                ));
            };
            let pos: u64 = pos
                .parse()
                .map_err(|_| Error::Decode(format!("binlog_snapshot_position {pos:?}")))?;
            let gtid: GtidState = admin::gtid_at(&mut conn, &file, pos).await?;
            Resume {
                file,
                pos,
                gtid: Some(gtid),
                mysql_gtids: None,
                by_position: false,
            }
        }
    };
    tracing::info!(position = %at.checkpoint(), "first start: consistent snapshot opened");
    Ok(Snapshot {
        conn,
        plans,
        at,
        after: None,
    })
}

impl Snapshot {
    /// How many rows the snapshot will publish, over every planned table (counted in the
    /// snapshot itself).
    pub async fn rows(&mut self) -> Result<i64, Error> {
        let mut total = 0;
        for (table, plan) in &self.plans {
            if let SnapshotPlan::Rows { filter, .. } = plan {
                let n: Option<i64> = self
                    .conn
                    .query_first(format!("SELECT COUNT(*) FROM {} {filter}", table.quoted()))
                    .await?;
                total += n.unwrap_or(0);
            }
        }
        Ok(total)
    }

    /// Reads the planned rows of every table and sends them as events at the snapshot's
    /// position; closes the snapshot. Returns how many rows were sent.
    pub async fn publish(mut self, outlet: &Outlet) -> Result<u64, Error> {
        let plans = std::mem::take(&mut self.plans);
        let after = self.after.take();
        // Numbered on from the last durable row, as in the life that published it.
        let mut n: u64 = SnapshotKey::next_index(after.as_ref());
        for (i, (table, plan)) in plans.iter().enumerate() {
            let Some(resume) = SnapshotKey::applies(after.as_ref(), i) else {
                continue;
            };
            let from = after.as_ref().filter(|_| resume);
            n = self
                .publish_table(table, plan, (i, from), n, outlet)
                .await?;
        }
        self.conn.query_drop("COMMIT").await?;
        let _ = self.conn.disconnect().await;
        tracing::info!(rows = n, "first start: existing rows handed to the sink");
        Ok(n)
    }

    /// One table's planned rows (the table at `index` in the plan; with `after`, only the rows
    /// after that key); `n` counts on across tables (the events' index). After each row, a
    /// [`Checkpoint::Snapshot`] mark with its key.
    async fn publish_table(
        &mut self,
        table: &OutboxTable,
        plan: &SnapshotPlan,
        (index, after): (usize, Option<&SnapshotKey>),
        mut n: u64,
        outlet: &Outlet,
    ) -> Result<u64, Error> {
        let SnapshotPlan::Rows { filter, what } = plan else {
            return Ok(n);
        };
        let infos = table_columns(&mut self.conn, table).await?;
        let mapping = table.map_columns(&infos)?;
        let select: Vec<String> = infos.iter().map(|c| my_ident(&c.name)).collect();
        let position_of = |name: &str| infos.iter().position(|c| c.name.eq_ignore_ascii_case(name));
        // Debezium's table has no `created_at`: its rows are read in `id` order.
        let created_column = position_of(table.columns.get(Column::CreatedAt));
        let created = created_column.map(|_| my_ident(table.columns.get(Column::CreatedAt)));
        let id = my_ident(table.columns.get(Column::Id));
        let mut params = Vec::new();
        let resume = after.and_then(|k| {
            let created_at = match &k.created_at {
                Some(c) => Some(decode_value(c)?),
                None => None,
            };
            Some((created_at, decode_value(&k.id)?))
        });
        let filter = match (resume, &created) {
            (Some((Some(c), i)), Some(created)) => {
                params = vec![c, i];
                and_where(filter, &format!("({created}, {id}) > (?, ?)"))
            }
            (Some((_, i)), None) => {
                params = vec![i];
                and_where(filter, &format!("{id} > ?"))
            }
            _ => filter.clone(),
        };
        let order = match &created {
            Some(created) => format!("{created}, {id}"),
            None => id.clone(),
        };
        let sql = format!(
            "SELECT {} FROM {} {filter} ORDER BY {order}",
            select.join(", "),
            table.quoted(),
        );
        let id_column = position_of(table.columns.get(Column::Id));
        match after {
            Some(k) => {
                tracing::info!(table = %table.quoted(), what = %what, after_created_at = k.created_at.as_deref().unwrap_or("-"), after_id = %k.id, next_index = k.seq, "first start: publishing existing rows after the last durable one of an interrupted snapshot")
            }
            None => {
                tracing::info!(table = %table.quoted(), what = %what, "first start: publishing existing rows")
            }
        }
        let mut progress = Progress::table(
            table.quoted(),
            admin::estimate_rows(&mut self.conn, table, &filter, params.clone()).await,
        );
        {
            // A prepared statement: values in the binary protocol (integers as integers,
            // dates as dates, bytes as bytes), read from the server one row at a time.
            let mut result = self.conn.exec_iter(sql, params).await?;
            while let Some(row) = result.next().await? {
                let raw = row.unwrap();
                // A row whose key column is NULL has no key to resume after (and sorts first).
                let created_at = match created_column {
                    Some(c) => raw.get(c).and_then(encode_value).map(Some),
                    None => Some(None),
                };
                let key = created_at
                    .zip(id_column.and_then(|i| raw.get(i).and_then(encode_value)))
                    .map(|(created_at, id)| SnapshotKey {
                        table: index,
                        created_at,
                        id,
                        seq: n + 1,
                    });
                let values: Vec<BinlogValue<'static>> =
                    raw.into_iter().map(BinlogValue::Value).collect();
                let mut event = mapping.event_from(
                    |i| values.get(i),
                    RowContext {
                        file: &self.at.file,
                        index: u32::try_from(n).unwrap_or(u32::MAX),
                        gtid: None,
                        committed_at: None,
                    },
                    table.tz,
                );
                if let crate::event::SourcePosition::Binlog { end_pos, .. } = &mut event.position {
                    *end_pos = self.at.pos;
                }
                outlet.send_event(event).await?;
                n += 1;
                progress.add(1);
                if let Some(key) = key {
                    outlet
                        .send_checkpoint(Checkpoint::Snapshot {
                            seq: n,
                            key: key.encode(),
                        })
                        .await?;
                }
            }
        }
        progress.finish();
        Ok(n)
    }
}

/// A key column's value as stored snapshot progress, tagged with its kind so that it is bound
/// back as the same kind (`None`: a value that cannot be a key, such as NULL).
fn encode_value(v: &Value) -> Option<String> {
    Some(match v {
        Value::Bytes(b) => {
            let mut s = String::with_capacity(2 + 2 * b.len());
            s.push_str("x:");
            for byte in b {
                s.push_str(&format!("{byte:02x}"));
            }
            s
        }
        Value::Int(i) => format!("i:{i}"),
        Value::UInt(u) => format!("u:{u}"),
        Value::Date(y, mo, d, h, mi, sec, us) => {
            format!("d:{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{sec:02}.{us:06}")
        }
        _ => return None,
    })
}

fn decode_value(s: &str) -> Option<Value> {
    let (tag, rest) = s.split_once(':')?;
    Some(match tag {
        "x" => {
            if rest.len() % 2 != 0 {
                return None;
            }
            let bytes = (0..rest.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(rest.get(i..i + 2)?, 16).ok())
                .collect::<Option<Vec<u8>>>()?;
            Value::Bytes(bytes)
        }
        "i" => Value::Int(rest.parse().ok()?),
        "u" => Value::UInt(rest.parse().ok()?),
        "d" => {
            let t = chrono::NaiveDateTime::parse_from_str(rest, "%Y-%m-%d %H:%M:%S%.f").ok()?;
            use chrono::{Datelike, Timelike};
            Value::Date(
                u16::try_from(t.year()).ok()?,
                t.month() as u8,
                t.day() as u8,
                t.hour() as u8,
                t.minute() as u8,
                t.second() as u8,
                t.nanosecond() / 1000,
            )
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_key_values_round_trip() {
        for v in [
            Value::Bytes(b"0190-ab\x00'".to_vec()),
            Value::Int(-42),
            Value::UInt(u64::MAX),
            Value::Date(2026, 12, 3, 8, 5, 59, 123456),
        ] {
            let s = encode_value(&v).unwrap();
            assert_eq!(decode_value(&s), Some(v), "{s}");
        }
        assert_eq!(encode_value(&Value::NULL), None);
        assert_eq!(decode_value("x:abc"), None);
        assert_eq!(decode_value("q:1"), None);
    }
}
