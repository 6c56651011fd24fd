//! Rows events of an outbox table → outbox events, with the guard that turns a panic in
//! `mysql_common`'s row decoding into a decode error.

use super::Txn;
use crate::event::OutboxEvent;
use crate::source::mysql::gtid;
use crate::source::mysql::rows::{Mapping, OutboxTable, RowContext};
use crate::Error;
use mysql_common::binlog::events::{RowsEventData, TableMapEvent};

pub(super) fn decode_inserts(
    table: &OutboxTable,
    tme: &TableMapEvent<'static>,
    mapping: &Mapping,
    data: &RowsEventData<'_>,
    file: &str,
    txn: &mut Txn,
) -> Result<Vec<OutboxEvent>, Error> {
    let present = data
        .columns_after_image()
        .ok_or_else(|| Error::Decode("write rows event without an after image".into()))?;
    mapping.check_image(present, table)?;
    let mut out = Vec::new();
    for row in guarded_rows(data, tme)? {
        let (_, after) = row;
        let Some(after) = after else {
            return Err(Error::Decode("write rows event row without values".into()));
        };
        let event = mapping.event(
            &after,
            present,
            RowContext {
                file,
                index: txn.index,
                gtid: match (&txn.gtid, &txn.mysql_gtid) {
                    (Some(g), _) => Some(g.to_string()),
                    (None, Some((uuid, tag, gno))) => Some(gtid::mysql_gtid_text(*uuid, tag, *gno)),
                    (None, None) => None,
                },
                committed_at: txn.committed_at,
            },
            table.tz,
        );
        txn.index += 1;
        out.push(event);
    }
    Ok(out)
}

type RowImages = (
    Option<mysql_common::binlog::row::BinlogRow>,
    Option<mysql_common::binlog::row::BinlogRow>,
);

/// Every row of a rows event, decoded by `mysql_common`. The table map was checked
/// ([`crate::source::mysql::rows::table_map_fits`]) and the image holds the mapped columns,
/// but its value decoders still index and subtract unchecked on corrupt bytes (a DECIMAL
/// whose scale exceeds its precision, …; found by tests/mariadb/mysql_file.rs mutating binlog files).
/// As the last resort — and only here — a panic inside it becomes a decode error instead of a
/// crash.
fn guarded_rows(
    data: &RowsEventData<'_>,
    tme: &TableMapEvent<'static>,
) -> Result<Vec<RowImages>, Error> {
    let decode = || -> Result<Vec<RowImages>, Error> {
        data.rows(tme)
            .map(|r| r.map_err(|e| Error::Decode(e.to_string())))
            .collect()
    };
    GUARDED.with(|g| g.set(true));
    let rows = std::panic::catch_unwind(std::panic::AssertUnwindSafe(decode));
    GUARDED.with(|g| g.set(false));
    rows.unwrap_or_else(|_| {
        Err(Error::Decode(
            "the rows event cannot be decoded (corrupt row data: the decoder panicked)".into(),
        ))
    })
}

thread_local! {
    /// Set while [`guarded_rows`] decodes: a panic then is caught there. The fuzz targets'
    /// panic hook reads it, so that only panics nothing catches count as findings.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside the guarded row decoding (see [`guarded_rows`]).
pub fn in_guarded_rows() -> bool {
    GUARDED.with(|g| g.get())
}
