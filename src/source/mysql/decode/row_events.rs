//! Rows events of an outbox table → outbox events: each row's after image read column by
//! column from the table map ([`crate::source::mysql::rows::Image`]), only the outbox columns
//! decoded, straight into events. The panic guard is left for `mysql_common`'s binary JSON
//! parser (MySQL 8 JSON columns), which trusts offsets inside the value.

use super::Txn;
use crate::event::OutboxEvent;
use crate::source::mysql::gtid;
use crate::source::mysql::rows::{Cell, Layout, Mapping, OutboxTable, RowContext};
use crate::Error;
use mysql_common::binlog::events::RowsEventData;

pub(super) fn decode_inserts(
    table: &OutboxTable,
    layout: &Layout,
    mapping: &Mapping,
    data: &RowsEventData<'_>,
    file: &str,
    txn: &mut Txn,
) -> Result<Vec<OutboxEvent>, Error> {
    let present = data
        .columns_after_image()
        .ok_or_else(|| Error::Decode("write rows event without an after image".into()))?;
    mapping.check_image(present, table)?;
    let image = layout.image(present).map_err(Error::Decode)?;
    let rows = data.rows_data();
    let gtid = match (&txn.gtid, &txn.mysql_gtid) {
        (Some(g), _) => Some(g.to_string()),
        (None, Some((uuid, tag, gno))) => Some(gtid::mysql_gtid_text(*uuid, tag, *gno)),
        (None, None) => None,
    };
    let mut cells: Vec<Option<Cell<'_>>> = vec![None; mapping.columns()];
    let mut out = Vec::new();
    let mut at = 0;
    while at < rows.len() {
        at += image
            .read(&rows[at..], mapping.wanted(), &mut cells)
            .map_err(|m| Error::Decode(format!("row {} of the event: {m}", out.len() + 1)))?;
        out.push(mapping.event_cells(
            |i| cells.get(i).and_then(Option::as_ref),
            RowContext {
                file,
                index: txn.index,
                gtid: gtid.clone(),
                committed_at: txn.committed_at,
            },
            table.tz,
        ));
        txn.index += 1;
    }
    Ok(out)
}

/// Runs `f`; a panic inside it becomes an error. Only `mysql_common`'s binary JSON parser and
/// renderer run under it (found panicking on corrupt values by mutating binlog files): as the
/// last resort, and only there, a panic is a decode error instead of a crash.
pub fn guarded<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    let was = GUARDED.with(|g| g.replace(true));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    r.unwrap_or_else(|_| Err("corrupt binary JSON (its parser panicked)".into()))
}

thread_local! {
    /// Set while [`guarded`] runs: a panic then is caught there. The fuzz targets' panic hook
    /// reads it, so that only panics nothing catches count as findings.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is inside the guarded JSON decoding (see [`guarded`]).
pub fn in_guarded_rows() -> bool {
    GUARDED.with(|g| g.get())
}
