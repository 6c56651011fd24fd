//! The producer side of the pattern: [`Outbox`] writes an event row inside the caller's own
//! transaction (tokio-postgres or mysql_async), encrypting the schema's personal fields first
//! when asked, and [`Mode`] says how the relay reads the table. The table's names and column
//! mapping are in `crate::names` (re-exported here).

use crate::Error;
use uuid::Uuid;

// The names of the outbox table and its columns, shared with every other module, are in
// `crate::names`; re-exported here, where users of the producer helper look for them.
pub use crate::names::{
    my_ident, pg_ident, pg_literal, ColumnMap, ExtraColumn, TableName, OPTIONAL, REQUIRED,
};

/// How the outbox is read (`--mode`): from the database's log, or by claiming rows from the
/// table itself (which then carries a `status` column the relay stamps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Change data capture: the Postgres WAL or the MySQL/MariaDB binlog.
    Cdc,
    /// `SELECT … FOR UPDATE SKIP LOCKED` on the table, for databases without log access.
    Poll,
}

/// One event to write.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    pub topic: &'a str,
    pub aggregate_id: &'a str,
    pub payload: &'a serde_json::Value,
    pub headers: Option<&'a serde_json::Value>,
    pub version: Option<i64>,
}

/// The producer helper: writes outbox rows inside the caller's transaction.
#[derive(Debug, Clone)]
pub struct Outbox {
    table: TableName,
    columns: ColumnMap,
    encryptor: Option<crate::crypto::Encryptor>,
    /// MySQL: the id and aggregate id column types, looked up once.
    my_types: std::sync::Arc<std::sync::OnceLock<MyTypes>>,
}

/// How [`Outbox::write_mysql`] encodes the id and aggregate id for the table's column types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MyTypes {
    /// `BINARY(16)` (bytes in RFC 4122 order); otherwise `CHAR(36)` text.
    id_binary: bool,
    /// `BINARY(16)` aggregate ids take a UUID's bytes; integer ones a number; others text.
    aggregate_binary: bool,
    aggregate_int: bool,
}

impl Outbox {
    pub fn new(table: &str) -> Result<Outbox, Error> {
        Ok(Outbox {
            table: TableName::parse(table)?,
            columns: ColumnMap::default(),
            encryptor: None,
            my_types: Default::default(),
        })
    }

    /// Encrypts the fields the encryptor's schema marks `x-gdpr-sensitive` in every payload,
    /// bound to the event's own id, before the INSERT: their plaintext never reaches the table
    /// (nor the WAL, nor the broker). Headers are not encrypted: keep personal data out of them.
    pub fn with_encryption(mut self, encryptor: crate::crypto::Encryptor) -> Self {
        self.encryptor = Some(encryptor);
        self
    }

    pub fn with_columns(mut self, columns: ColumnMap) -> Self {
        self.columns = columns;
        self
    }

    /// Writes one event in `tx` and returns its id (UUID v7). `created_at` comes from the
    /// database clock. Commit `tx` and the event exists; roll it back and it never did.
    pub async fn write(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        topic: &str,
        aggregate_id: &str,
        payload: &serde_json::Value,
    ) -> Result<Uuid, Error> {
        self.write_event(
            tx,
            &NewEvent {
                topic,
                aggregate_id,
                payload,
                headers: None,
                version: None,
            },
        )
        .await
    }

    /// [`Outbox::write`] with the optional headers and version.
    pub async fn write_event(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        ev: &NewEvent<'_>,
    ) -> Result<Uuid, Error> {
        use tokio_postgres::types::{ToSql, Type};
        let id = Uuid::now_v7();
        // Encrypt with the id the row will carry: the ciphertext is bound to it.
        let encrypted;
        let payload = match &self.encryptor {
            Some(enc) => {
                encrypted = enc.encrypt_event(id, ev.aggregate_id, ev.payload).await?;
                &encrypted
            }
            None => ev.payload,
        };
        let c = |k| pg_ident(self.columns.get(k));
        let mut cols = vec![
            c("id"),
            c("aggregate_id"),
            c("topic"),
            c("payload"),
            c("created_at"),
        ];
        let mut vals = vec!["$1", "$2", "$3", "$4", "now()"];
        if ev.headers.is_some() {
            cols.push(c("headers"));
            vals.push("$5");
        }
        if ev.version.is_some() {
            cols.push(c("version"));
            vals.push(if ev.headers.is_some() { "$6" } else { "$5" });
        }
        let sql = format!(
            "INSERT INTO {} ({}) VALUES ({})",
            self.table.pg_quoted(),
            cols.join(", "),
            vals.join(", ")
        );
        let stmt = tx.prepare(&sql).await?;
        // The aggregate id column may be bigint, uuid or text: convert to what it is.
        let agg_i64;
        let agg_uuid;
        let agg: &(dyn ToSql + Sync) = match stmt.params().get(1) {
            Some(&Type::INT8) | Some(&Type::INT4) => {
                agg_i64 = ev.aggregate_id.parse::<i64>().map_err(|_| {
                    Error::config(
                        format!("aggregate id {:?} is not an integer", ev.aggregate_id),
                        "the aggregate_id column is an integer: pass a number",
                    )
                })?;
                &agg_i64
            }
            Some(&Type::UUID) => {
                agg_uuid = Uuid::parse_str(ev.aggregate_id).map_err(|_| {
                    Error::config(
                        format!("aggregate id {:?} is not a UUID", ev.aggregate_id),
                        "the aggregate_id column is a uuid: pass a UUID",
                    )
                })?;
                &agg_uuid
            }
            _ => &ev.aggregate_id,
        };
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&id, agg, &ev.topic, payload];
        if let Some(h) = ev.headers {
            params.push(h);
        }
        // The version column may be smallint, integer or bigint.
        let (v16, v32, v64);
        if let Some(v) = ev.version {
            let out_of_range = || {
                Error::config(
                    format!("version {v} does not fit the version column"),
                    "make the version column bigint",
                )
            };
            match stmt.params().get(params.len()) {
                Some(&Type::INT2) => {
                    v16 = i16::try_from(v).map_err(|_| out_of_range())?;
                    params.push(&v16);
                }
                Some(&Type::INT4) => {
                    v32 = i32::try_from(v).map_err(|_| out_of_range())?;
                    params.push(&v32);
                }
                _ => {
                    v64 = v;
                    params.push(&v64);
                }
            }
        }
        tx.execute(&stmt, &params).await?;
        Ok(id)
    }
}

impl Outbox {
    /// `db`.`table` or `table` (the session's database).
    fn my_quoted(&self) -> String {
        match &self.table.schema {
            Some(db) => format!("{}.{}", my_ident(db), my_ident(&self.table.name)),
            None => my_ident(&self.table.name),
        }
    }

    async fn my_types(&self, tx: &mut mysql_async::Transaction<'_>) -> Result<MyTypes, Error> {
        use mysql_async::prelude::Queryable;
        if let Some(t) = self.my_types.get() {
            return Ok(*t);
        }
        let cols: Vec<(String, String, String)> = tx
            .exec(
                "SELECT COLUMN_NAME, DATA_TYPE, COLUMN_TYPE FROM information_schema.COLUMNS
                  WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
                (self.table.schema.clone(), self.table.name.clone()),
            )
            .await?;
        let find = |logical: &str| {
            let actual = self.columns.get(logical);
            cols.iter()
                .find(|(n, _, _)| n.eq_ignore_ascii_case(actual))
                .map(|(_, dt, ct)| (dt.to_ascii_lowercase(), ct.to_ascii_lowercase()))
        };
        let (Some(id), Some(agg)) = (find("id"), find("aggregate_id")) else {
            return Err(Error::config(
                format!(
                    "the outbox table {} or its id/aggregate_id column does not exist",
                    self.my_quoted()
                ),
                "create it with migrations/mysql/001_outbox.sql",
            ));
        };
        let binary = |(dt, _): &(String, String)| dt == "binary" || dt == "varbinary";
        let t = MyTypes {
            id_binary: binary(&id),
            aggregate_binary: binary(&agg),
            aggregate_int: agg.0.ends_with("int"),
        };
        let _ = self.my_types.set(t);
        Ok(t)
    }

    /// [`Outbox::write`] for MySQL/MariaDB: writes one event in `tx` (a `mysql_async`
    /// transaction) and returns its id (UUID v7, stored as `BINARY(16)` in RFC 4122 byte order,
    /// or as text in a `CHAR(36)` column). `created_at` comes from the database clock
    /// (`NOW(6)`, the session's time zone: run the relay with the same `--source-time-zone`).
    pub async fn write_mysql(
        &self,
        tx: &mut mysql_async::Transaction<'_>,
        topic: &str,
        aggregate_id: &str,
        payload: &serde_json::Value,
    ) -> Result<Uuid, Error> {
        self.write_event_mysql(
            tx,
            &NewEvent {
                topic,
                aggregate_id,
                payload,
                headers: None,
                version: None,
            },
        )
        .await
    }

    /// [`Outbox::write_mysql`] with the optional headers and version.
    pub async fn write_event_mysql(
        &self,
        tx: &mut mysql_async::Transaction<'_>,
        ev: &NewEvent<'_>,
    ) -> Result<Uuid, Error> {
        use mysql_async::prelude::Queryable;
        use mysql_async::Value;
        let types = self.my_types(tx).await?;
        let id = Uuid::now_v7();
        // As for Postgres: sealed for the row's own id before the INSERT.
        let payload_text = match &self.encryptor {
            Some(enc) => enc
                .encrypt_event(id, ev.aggregate_id, ev.payload)
                .await?
                .to_string(),
            None => ev.payload.to_string(),
        };
        let c = |k| my_ident(self.columns.get(k));
        let mut cols = vec![
            c("id"),
            c("aggregate_id"),
            c("topic"),
            c("payload"),
            c("created_at"),
        ];
        let mut vals = vec!["?", "?", "?", "?", "NOW(6)"];
        let id_value = if types.id_binary {
            Value::Bytes(id.as_bytes().to_vec())
        } else {
            Value::Bytes(id.hyphenated().to_string().into_bytes())
        };
        let aggregate = if types.aggregate_binary {
            let u = Uuid::parse_str(ev.aggregate_id).map_err(|_| {
                Error::config(
                    format!("aggregate id {:?} is not a UUID", ev.aggregate_id),
                    "the aggregate_id column is BINARY(16): pass a UUID",
                )
            })?;
            Value::Bytes(u.as_bytes().to_vec())
        } else if types.aggregate_int {
            match ev.aggregate_id.parse::<i64>() {
                Ok(i) => Value::Int(i),
                Err(_) => Value::UInt(ev.aggregate_id.parse::<u64>().map_err(|_| {
                    Error::config(
                        format!("aggregate id {:?} is not an integer", ev.aggregate_id),
                        "the aggregate_id column is an integer: pass a number",
                    )
                })?),
            }
        } else {
            Value::Bytes(ev.aggregate_id.as_bytes().to_vec())
        };
        let mut params = vec![
            id_value,
            aggregate,
            Value::Bytes(ev.topic.as_bytes().to_vec()),
            Value::Bytes(payload_text.into_bytes()),
        ];
        if let Some(h) = ev.headers {
            cols.push(c("headers"));
            vals.push("?");
            params.push(Value::Bytes(h.to_string().into_bytes()));
        }
        if let Some(v) = ev.version {
            cols.push(c("version"));
            vals.push("?");
            params.push(Value::Int(v));
        }
        let sql = format!(
            "INSERT INTO {} ({}) VALUES ({})",
            self.my_quoted(),
            cols.join(", "),
            vals.join(", ")
        );
        tx.exec_drop(sql, params).await?;
        Ok(id)
    }
}
