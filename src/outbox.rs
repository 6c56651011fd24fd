//! The producer side of the pattern: [`Outbox`] writes an event row inside the caller's own
//! transaction, encrypting the schema's personal fields first when asked, and [`Mode`] says how
//! the relay reads the table. The table's names and column mapping are in `crate::names`
//! (re-exported here).
//!
//! [`Outbox::write`] and [`Outbox::write_event`] are written once, generic over
//! [`OutboxBackend`], which the `tokio_postgres` and `mysql_async` transaction types implement:
//! the steps (draw the id, seal the payload for it, insert) are the same, while the INSERT
//! itself is not — Postgres converts the aggregate id and version to the column types its
//! prepared statement reports, MySQL/MariaDB encodes them for the column types read once from
//! `information_schema`.

use crate::Error;
use std::future::Future;
use uuid::Uuid;

// The names of the outbox table and its columns, shared with every other module, are in
// `crate::names`; re-exported here, where users of the producer helper look for them.
pub use crate::names::{
    my_ident, pg_ident, pg_literal, Column, ColumnMap, ExtraColumn, LogicalColumn, TableName,
    OPTIONAL, REQUIRED,
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
    /// MySQL: the id and aggregate id column types, looked up once (only the MySQL backend
    /// reads them).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    my_types: std::sync::Arc<std::sync::OnceLock<MyTypes>>,
}

/// How the MySQL/MariaDB insert encodes the id and aggregate id for the table's column types.
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

    /// Writes one event in `tx` (a `tokio_postgres` or `mysql_async` transaction) and returns
    /// its id (UUID v7). `created_at` comes from the database clock. Commit `tx` and the event
    /// exists; roll it back and it never did.
    ///
    /// On MySQL/MariaDB the id is stored as `BINARY(16)` in RFC 4122 byte order, or as text in
    /// a `CHAR(36)` column, and `created_at` is `NOW(6)`, the session's time zone: run the
    /// relay with the same `--source-time-zone`.
    pub async fn write<B: OutboxBackend>(
        &self,
        tx: &mut B,
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
    pub async fn write_event<B: OutboxBackend>(
        &self,
        tx: &mut B,
        ev: &NewEvent<'_>,
    ) -> Result<Uuid, Error> {
        // What the backend must look up about the table comes before the id is drawn and the
        // payload sealed: on MySQL/MariaDB a missing table then fails before any key is used.
        let plan = tx.plan(self).await?;
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
        tx.insert(self, plan, id, ev, payload).await?;
        Ok(id)
    }
}

/// The INSERT of one outbox row, inside an open transaction (`self`). Implemented for
/// `tokio_postgres::Transaction` and `mysql_async::Transaction`; [`Outbox::write_event`] is
/// the flow around it.
pub trait OutboxBackend: Send {
    /// Inserts the row `id` with `payload` (already sealed when the outbox encrypts) and the
    /// rest of `ev`, `created_at` from the database clock.
    fn insert(
        &mut self,
        outbox: &Outbox,
        plan: Plan,
        id: Uuid,
        ev: &NewEvent<'_>,
        payload: &serde_json::Value,
    ) -> impl Future<Output = Result<(), Error>> + Send;

    /// What the insert needs to know of the table before the id is drawn and the payload
    /// sealed (nothing by default).
    fn plan(&mut self, outbox: &Outbox) -> impl Future<Output = Result<Plan, Error>> + Send {
        let _ = outbox;
        async { Ok(Plan(None)) }
    }
}

/// What [`OutboxBackend::plan`] learnt of the table for [`OutboxBackend::insert`]. Opaque: only
/// the backends in this module fill it in.
#[derive(Debug, Clone, Copy)]
pub struct Plan(#[cfg_attr(not(feature = "mysql"), allow(dead_code))] Option<MyTypes>);

#[cfg(feature = "postgres")]
impl OutboxBackend for tokio_postgres::Transaction<'_> {
    /// A prepared INSERT: its parameter types say what the aggregate id and version columns
    /// are (bigint, uuid or text; smallint, integer or bigint), and the values are converted
    /// to them. The prepare round trip is the price of accepting every column variant.
    async fn insert(
        &mut self,
        outbox: &Outbox,
        _plan: Plan,
        id: Uuid,
        ev: &NewEvent<'_>,
        payload: &serde_json::Value,
    ) -> Result<(), Error> {
        use tokio_postgres::types::{ToSql, Type};
        let c = |k: Column| pg_ident(outbox.columns.get(k));
        let mut cols = outbox.base_columns(pg_ident);
        let mut vals = vec!["$1", "$2", "$3", "$4", "now()"];
        if ev.headers.is_some() {
            cols.push(c(Column::Headers));
            vals.push("$5");
        }
        if ev.version.is_some() {
            cols.push(c(Column::Version));
            vals.push(if ev.headers.is_some() { "$6" } else { "$5" });
        }
        let sql = format!(
            "INSERT INTO {} ({}) VALUES ({})",
            outbox.table.pg_quoted(),
            cols.join(", "),
            vals.join(", ")
        );
        let stmt = self.prepare(&sql).await?;
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
        self.execute(&stmt, &params).await?;
        Ok(())
    }
}

impl Outbox {
    /// The columns every row fills, quoted by `quote`: the four values the caller gives, in
    /// parameter order, then `created_at` from the database clock. Headers and version follow
    /// when the event has them.
    fn base_columns(&self, quote: fn(&str) -> String) -> Vec<String> {
        [
            Column::Id,
            Column::AggregateId,
            Column::Topic,
            Column::Payload,
            Column::CreatedAt,
        ]
        .into_iter()
        .map(|k| quote(self.columns.get(k)))
        .collect()
    }

    /// `db`.`table` or `table` (the session's database).
    #[cfg(feature = "mysql")]
    fn my_quoted(&self) -> String {
        match &self.table.schema {
            Some(db) => format!("{}.{}", my_ident(db), my_ident(&self.table.name)),
            None => my_ident(&self.table.name),
        }
    }

    #[cfg(feature = "mysql")]
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
        let find = |logical: Column| {
            let actual = self.columns.get(logical);
            cols.iter()
                .find(|(n, _, _)| n.eq_ignore_ascii_case(actual))
                .map(|(_, dt, ct)| (dt.to_ascii_lowercase(), ct.to_ascii_lowercase()))
        };
        let (Some(id), Some(agg)) = (find(Column::Id), find(Column::AggregateId)) else {
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
}

#[cfg(feature = "mysql")]
impl OutboxBackend for mysql_async::Transaction<'_> {
    /// The id and aggregate id column types, looked up once per [`Outbox`] (they decide how
    /// the values are encoded).
    async fn plan(&mut self, outbox: &Outbox) -> Result<Plan, Error> {
        Ok(Plan(Some(outbox.my_types(self).await?)))
    }

    async fn insert(
        &mut self,
        outbox: &Outbox,
        plan: Plan,
        id: Uuid,
        ev: &NewEvent<'_>,
        payload: &serde_json::Value,
    ) -> Result<(), Error> {
        use mysql_async::prelude::Queryable;
        use mysql_async::Value;
        // A plan made by another backend carries no types: look them up here.
        let types = match plan.0 {
            Some(t) => t,
            None => outbox.my_types(self).await?,
        };
        let payload_text = payload.to_string();
        let c = |k| my_ident(outbox.columns.get(k));
        let mut cols = outbox.base_columns(my_ident);
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
            cols.push(c(Column::Headers));
            vals.push("?");
            params.push(Value::Bytes(h.to_string().into_bytes()));
        }
        if let Some(v) = ev.version {
            cols.push(c(Column::Version));
            vals.push("?");
            params.push(Value::Int(v));
        }
        let sql = format!(
            "INSERT INTO {} ({}) VALUES ({})",
            outbox.my_quoted(),
            cols.join(", "),
            vals.join(", ")
        );
        self.exec_drop(sql, params).await?;
        Ok(())
    }
}
