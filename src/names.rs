//! The names of the outbox table as every part of outboxd sees it: the contract's logical
//! columns and their mapping to a user's table (`--column` renames, docs/message-format.md),
//! table references for both databases, and identifier quoting. A leaf: the sources, the
//! sinks, the producer helper, the consumer kit and the encryption commands all read it, and
//! it reads none of them.

use crate::Error;
use std::collections::BTreeMap;

/// The fields every event has, by name, for templates and `--header` (`sink::template`).
pub const EVENT_FIELDS: &[&str] = &["id", "topic", "aggregate_id", "table"];

/// A logical column of the outbox contract (docs/message-format.md), as a type: the mapper,
/// the queries, the checks and the kits name a column by its variant, so a misspelt one does
/// not compile, and `--column` renames resolve it through [`ColumnMap::get`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Column {
    Id,
    AggregateId,
    Topic,
    Payload,
    /// May be missing (Debezium's table has none): the commit time stands in for it.
    CreatedAt,
    Status,
    PublishedAt,
    Headers,
    Version,
    AggregateType,
    ContentType,
    /// Poll mode's tie-break for rows with one `created_at`: rises with insert order.
    Seq,
}

impl Column {
    /// Every logical column, the required ones first.
    pub const ALL: [Column; 12] = [
        Column::Id,
        Column::AggregateId,
        Column::Topic,
        Column::Payload,
        Column::CreatedAt,
        Column::Status,
        Column::PublishedAt,
        Column::Headers,
        Column::Version,
        Column::AggregateType,
        Column::ContentType,
        Column::Seq,
    ];

    /// The contract's name (`aggregate_id`): the default column name, and the name `--column`
    /// and templates use.
    pub const fn name(self) -> &'static str {
        match self {
            Column::Id => "id",
            Column::AggregateId => "aggregate_id",
            Column::Topic => "topic",
            Column::Payload => "payload",
            Column::CreatedAt => "created_at",
            Column::Status => "status",
            Column::PublishedAt => "published_at",
            Column::Headers => "headers",
            Column::Version => "version",
            Column::AggregateType => "aggregate_type",
            Column::ContentType => "content_type",
            Column::Seq => "seq",
        }
    }
}

impl std::fmt::Display for Column {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`ColumnMap::get`] takes: a [`Column`], or a contract name as text (a name read at run
/// time, a template's placeholder).
pub trait LogicalColumn<'a> {
    fn logical(self) -> &'a str;
}

impl<'a> LogicalColumn<'a> for Column {
    fn logical(self) -> &'a str {
        self.name()
    }
}

impl<'a> LogicalColumn<'a> for &'a str {
    fn logical(self) -> &'a str {
        self
    }
}

impl<'a, 'b: 'a> LogicalColumn<'a> for &'a &'b str {
    fn logical(self) -> &'a str {
        self
    }
}

impl<'a> LogicalColumn<'a> for &'a String {
    fn logical(self) -> &'a str {
        self
    }
}

/// Logical columns the relay knows, in the contract's names. `created_at` may be missing
/// (Debezium's table has none): the commit time stands in for it.
pub const REQUIRED: [&str; 4] = [
    Column::Id.name(),
    Column::AggregateId.name(),
    Column::Topic.name(),
    Column::Payload.name(),
];
pub const OPTIONAL: [&str; 8] = [
    Column::CreatedAt.name(),
    Column::Status.name(),
    Column::PublishedAt.name(),
    Column::Headers.name(),
    Column::Version.name(),
    Column::AggregateType.name(),
    Column::ContentType.name(),
    Column::Seq.name(),
];

/// One more column a row's event must carry because a template or `--header` names it:
/// `key` as the template wrote it, `column` the table's name for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtraColumn {
    pub key: std::sync::Arc<str>,
    pub column: String,
    /// Whether the table must have it (a column named by the user) or it is read only when
    /// present (`aggregate_type` for the envelope formats).
    pub required: bool,
}

/// Logical column name → the table's column name, and what else the sources must read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnMap {
    names: BTreeMap<&'static str, String>,
    /// Logical names mapped explicitly (`--column`, a preset): `content_type` is read only then.
    explicit: std::collections::BTreeSet<&'static str>,
    /// Columns beyond the contract's that templates and `--header` name (usually none: the
    /// hot path carries nothing extra).
    extra: Vec<ExtraColumn>,
    /// `--payload-content-type`: payloads of text/binary columns are published as bytes with
    /// this content type instead of being checked as JSON.
    payload_content_type: Option<std::sync::Arc<str>>,
    /// The `debezium` preset was chosen (routing defaults follow Debezium's event router).
    debezium: bool,
}

impl Default for ColumnMap {
    fn default() -> Self {
        let names = REQUIRED
            .iter()
            .chain(OPTIONAL.iter())
            .map(|&k| (k, k.to_string()))
            .collect();
        ColumnMap {
            names,
            explicit: Default::default(),
            extra: Vec::new(),
            payload_content_type: None,
            debezium: false,
        }
    }
}

impl ColumnMap {
    /// Parses `id=event_id,aggregate_id=aggregateid` (repeatable flag values are joined), or the
    /// preset `debezium` (Debezium's outbox router columns: `aggregateid`, `type` as topic).
    pub fn parse(specs: &[String]) -> Result<ColumnMap, Error> {
        let mut map = ColumnMap::default();
        for spec in specs.iter().flat_map(|s| s.split(',')) {
            let spec = spec.trim();
            if spec.is_empty() {
                continue;
            }
            if spec == "debezium" {
                map.set(Column::AggregateId.name(), "aggregateid")?;
                map.set(Column::Topic.name(), "type")?;
                map.set(Column::AggregateType.name(), "aggregatetype")?;
                map.debezium = true;
                continue;
            }
            let (logical, actual) = spec.split_once('=').ok_or_else(|| {
                Error::config(
                    format!("--column {spec:?} is not NAME=COLUMN"),
                    "write e.g. --column id=event_id,aggregate_id=aggregateid",
                )
            })?;
            map.set(logical.trim(), actual.trim())?;
        }
        Ok(map)
    }

    fn set(&mut self, logical: &str, actual: &str) -> Result<(), Error> {
        let key = REQUIRED
            .iter()
            .chain(OPTIONAL.iter())
            .find(|&&k| k == logical)
            .ok_or_else(|| {
                Error::config(
                    format!("--column: unknown column {logical:?}"),
                    format!(
                        "use one of {}",
                        REQUIRED
                            .iter()
                            .chain(OPTIONAL.iter())
                            .copied()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })?;
        if actual.is_empty()
            || !actual
                .chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '$')
        {
            return Err(Error::config(
                format!("--column {logical}={actual:?}: not a plain column name"),
                "name the column without quotes or spaces",
            ));
        }
        self.names.insert(key, actual.to_string());
        self.explicit.insert(key);
        Ok(())
    }

    /// Whether `--column debezium` was given.
    pub fn is_debezium(&self) -> bool {
        self.debezium
    }

    /// Whether a logical column was mapped explicitly.
    pub fn is_explicit<'a>(&'a self, logical: impl LogicalColumn<'a>) -> bool {
        self.explicit.contains(logical.logical())
    }

    /// Whether per-row content types are read (`--column content_type=<column>`).
    pub fn reads_content_type(&self) -> bool {
        self.is_explicit(Column::ContentType)
    }

    /// Adds a column the events must carry, by the name a template or `--header` uses: a
    /// logical name resolves through the renames, anything else is the table's column name.
    /// Names every event already has (see [`EVENT_FIELDS`]) need none.
    pub fn require_extra(&mut self, key: &str, required: bool) {
        if EVENT_FIELDS.contains(&key) {
            return;
        }
        if let Some(e) = self.extra.iter_mut().find(|e| &*e.key == key) {
            e.required |= required;
            return;
        }
        let column = if REQUIRED.contains(&key) || OPTIONAL.contains(&key) {
            self.get(key).to_string()
        } else {
            key.to_string()
        };
        self.extra.push(ExtraColumn {
            key: key.into(),
            column,
            required,
        });
    }

    /// The extra columns events carry (see [`ColumnMap::require_extra`]).
    pub fn extra(&self) -> &[ExtraColumn] {
        &self.extra
    }

    /// Sets `--payload-content-type`.
    pub fn set_payload_content_type(&mut self, ct: Option<&str>) {
        self.payload_content_type = ct.map(Into::into);
    }

    /// `--payload-content-type`, if set.
    pub fn payload_content_type(&self) -> Option<&std::sync::Arc<str>> {
        self.payload_content_type.as_ref()
    }

    /// Whether payloads of text and binary columns are bytes with a content type (a flag or a
    /// column says which) rather than JSON that must parse.
    pub fn opaque_payloads(&self) -> bool {
        self.payload_content_type.is_some() || self.reads_content_type()
    }

    /// The table's name for a logical column (`Column::CreatedAt`, or its contract name).
    pub fn get<'a>(&'a self, logical: impl LogicalColumn<'a>) -> &'a str {
        let logical = logical.logical();
        self.names
            .get(logical)
            .map(String::as_str)
            .unwrap_or(logical)
    }
}

/// A table reference `schema.table` (Postgres) or `db.table` (MySQL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    pub schema: Option<String>,
    pub name: String,
}

impl TableName {
    pub fn parse(s: &str) -> Result<TableName, Error> {
        let valid = |p: &str| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_alphanumeric() || c == '_' || c == '$')
        };
        let (schema, name) = match s.split_once('.') {
            Some((a, b)) => (Some(a.to_string()), b.to_string()),
            None => (None, s.to_string()),
        };
        if !valid(&name) || schema.as_deref().is_some_and(|s| !valid(s)) {
            return Err(Error::config(
                format!("--table {s:?} is not a plain [schema.]table name"),
                "write e.g. --table outbox or --table public.outbox",
            ));
        }
        Ok(TableName { schema, name })
    }

    /// Postgres: `"schema"."table"` with `public` as the default schema.
    pub fn pg_quoted(&self) -> String {
        format!(
            "{}.{}",
            pg_ident(self.schema.as_deref().unwrap_or("public")),
            pg_ident(&self.name)
        )
    }

    pub fn pg_schema(&self) -> &str {
        self.schema.as_deref().unwrap_or("public")
    }
}

/// As written on the command line (`x-outbox-table` when a relay reads several tables).
impl std::fmt::Display for TableName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.schema {
            Some(s) => write!(f, "{s}.{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// Quotes a Postgres identifier.
pub fn pg_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes a Postgres string literal.
pub fn pg_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Quotes a MySQL/MariaDB identifier.
pub fn my_ident(s: &str) -> String {
    format!("`{}`", s.replace('`', "``"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_renames_and_presets() {
        let m = ColumnMap::parse(&["id=event_id, aggregate_id=aggregateid".into()]).unwrap();
        assert_eq!(m.get(Column::Id), "event_id");
        assert_eq!(m.get("aggregate_id"), "aggregateid");
        assert_eq!(m.get(Column::Topic), "topic");
        let d = ColumnMap::parse(&["debezium".into()]).unwrap();
        assert_eq!(d.get(Column::Topic), "type");
        assert!(d.is_explicit(Column::AggregateType));
        for c in Column::ALL {
            // One name per column.
            assert_eq!(
                Column::ALL.iter().filter(|d| d.name() == c.name()).count(),
                1
            );
            assert!(
                REQUIRED.contains(&c.name()) != OPTIONAL.contains(&c.name()),
                "{c}"
            );
        }
        assert!(ColumnMap::parse(&["nope=x".into()]).is_err());
        assert!(ColumnMap::parse(&["id".into()]).is_err());
        assert!(ColumnMap::parse(&["id=a b".into()]).is_err());
    }

    #[test]
    fn table_names() {
        assert_eq!(
            TableName::parse("outbox").unwrap().pg_quoted(),
            "\"public\".\"outbox\""
        );
        assert_eq!(
            TableName::parse("app.outbox").unwrap().pg_quoted(),
            "\"app\".\"outbox\""
        );
        assert!(TableName::parse("a;drop").is_err());
        assert!(TableName::parse("").is_err());
    }
}
