//! The binlog-file source: archived MySQL/MariaDB binlog files (one file, a directory, or a
//! range of files in a directory) read in order and fed through the same [`Decoder`] as the
//! server's dump stream, so the same outbox events reach the same relay and sinks. It is a
//! replay tool: it keeps no lease and stores no position (the files do not change), it has no
//! first start and no snapshot, and it ends when the last file ends.
//!
//! Files come from anywhere (a backup, a disk that failed), so every event is framed here
//! before `mysql_common` sees it: the header must be complete, the event's length must fit
//! the bytes left and hold its checksum, and the CRC32 must match. `mysql_common` would
//! allocate what a corrupt length claims and panics (an `unwrap`) when an event claims more
//! bytes than it has; behind these checks it never gets such input. Every error names
//! the file and the byte offset of the event.

use super::decode::{row_index, Decoder, Step};
use super::rows::OutboxTable;
use crate::dsn::FileDsn;
use crate::event::{Checkpoint, OutboxEvent, SourcePosition};
use crate::source::SourceLink;
use crate::Error;
use mysql_common::binlog::consts::{BinlogChecksumAlg, BinlogVersion};
use mysql_common::binlog::events::{BinlogEventHeader, Event, FormatDescriptionEvent};
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;

/// The first four bytes of every binlog file.
pub(crate) const MAGIC: [u8; 4] = [0xfe, b'b', b'i', b'n'];

const HEADER_LEN: usize = BinlogEventHeader::LEN;
const CHECKSUM_LEN: usize = 4;
const FORMAT_DESCRIPTION: u8 = 15;
/// The checksum algorithm byte of a format description: CRC32.
const CRC32: u8 = 1;

/// Frames and parses the events in `bytes` (from `at` on), one at a time, with the format
/// description seen so far. Used for whole files and for the unpacked contents of a
/// TRANSACTION_PAYLOAD event (whose events carry no checksum).
pub struct EventFramer<'a> {
    bytes: &'a [u8],
    at: usize,
    fde: FormatDescriptionEvent<'static>,
    /// Events carry a checksum when the format description says so (false inside a payload).
    checksums: bool,
}

impl<'a> EventFramer<'a> {
    /// A framer over a whole binlog file: checks the magic bytes.
    pub fn file(bytes: &'a [u8]) -> Result<EventFramer<'a>, String> {
        if bytes.len() < MAGIC.len() || bytes[..4] != MAGIC {
            return Err(format!(
                "not a binlog file: it does not start with the binlog magic bytes fe 62 69 6e ({} bytes)",
                bytes.len()
            ));
        }
        Ok(EventFramer {
            bytes,
            at: MAGIC.len(),
            fde: FormatDescriptionEvent::new(BinlogVersion::Version4),
            checksums: true,
        })
    }

    /// A framer over events without checksums, read with the format description `fde` (the
    /// events of a TRANSACTION_PAYLOAD).
    pub fn embedded(bytes: &'a [u8], fde: &FormatDescriptionEvent<'_>) -> EventFramer<'a> {
        let mut footer = fde.footer();
        footer.set_checksum_enabled(false);
        EventFramer {
            bytes,
            at: 0,
            fde: fde.clone().into_owned().with_footer(footer),
            checksums: false,
        }
    }

    /// The byte offset of the next event.
    pub fn offset(&self) -> usize {
        self.at
    }

    /// The next event and its offset; `None` at the end of the bytes. An error says what is
    /// wrong with the event at the offset it returns (the framer does not move past it).
    pub fn next_event(&mut self) -> Result<Option<(usize, Event)>, (usize, String)> {
        let at = self.at;
        let rest = &self.bytes[at..];
        if rest.is_empty() {
            return Ok(None);
        }
        let fail = |m: String| Err((at, m));
        if rest.len() < HEADER_LEN {
            return fail(format!(
                "truncated: {} bytes left, an event header needs {HEADER_LEN}",
                rest.len()
            ));
        }
        let size = u32::from_le_bytes(rest[9..13].try_into().expect("4 bytes")) as usize;
        let kind = rest[4];
        if size < HEADER_LEN {
            return fail(format!(
                "corrupt event: it claims {size} bytes, less than its own {HEADER_LEN}-byte header"
            ));
        }
        if size > rest.len() {
            return fail(format!(
                "truncated: the event (type {kind}) claims {size} bytes, only {} are left",
                rest.len()
            ));
        }
        let raw = &rest[..size];
        // Whether this event ends in a CRC32: a format description says so itself (its last
        // five bytes are the algorithm and the checksum); every other event per the last one.
        let crc = if !self.checksums {
            false
        } else if kind == FORMAT_DESCRIPTION {
            fde_has_crc32(raw)
        } else {
            // Whatever is not OFF makes mysql_common cut 4 checksum bytes off; a format
            // description with an algorithm other than OFF or CRC32 was refused below.
            !matches!(
                self.fde.footer().get_checksum_alg(),
                Ok(None | Some(BinlogChecksumAlg::BINLOG_CHECKSUM_ALG_OFF))
            )
        };
        if crc {
            if size < HEADER_LEN + CHECKSUM_LEN {
                return fail(format!(
                    "corrupt event: {size} bytes cannot hold a header and a checksum"
                ));
            }
            let (body, sum) = raw.split_at(size - CHECKSUM_LEN);
            if event_checksum(body).to_le_bytes() != sum {
                return fail(format!(
                    "corrupt event (type {kind}, {size} bytes): its CRC32 checksum does not match"
                ));
            }
        }
        let event = Event::read(&self.fde, raw).map_err(|e| (at, format!("event: {e}")))?;
        if kind == FORMAT_DESCRIPTION {
            let fde = event
                .read_event::<FormatDescriptionEvent<'_>>()
                .map_err(|e| (at, format!("format description: {e}")))?;
            let mut footer = event.footer();
            if footer.get_checksum_alg().is_err() {
                return fail("corrupt format description: unknown checksum algorithm".into());
            }
            footer.set_checksum_enabled(self.checksums);
            self.fde = fde.into_owned().with_footer(footer);
        }
        self.at += size;
        Ok(Some((at, event)))
    }
}

/// Whether a raw format description event ends in a CRC32: servers from 5.6.1 on write the
/// checksum algorithm byte before the 4 checksum bytes; older ones write neither.
fn fde_has_crc32(raw: &[u8]) -> bool {
    // header, binlog version (2), server version (50), create time (4), header length (1),
    // post-header lengths, then algorithm (1) and checksum (4).
    const VERSION_AT: usize = HEADER_LEN + 2;
    if raw.len() < VERSION_AT + 50 + 5 {
        return false;
    }
    let version = &raw[VERSION_AT..VERSION_AT + 50];
    let end = version.iter().position(|&b| b == 0).unwrap_or(50);
    let text = String::from_utf8_lossy(&version[..end]);
    let mut nums = text
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().unwrap_or(0));
    let v = (
        nums.next().unwrap_or(0),
        nums.next().unwrap_or(0),
        nums.next().unwrap_or(0),
    );
    v >= (5, 6, 1) && raw[raw.len() - 5] == CRC32
}

/// One event of a binlog file as the file source reads it: its offset in the file and, for a
/// TRANSACTION_PAYLOAD event, the events it wraps, unpacked.
#[derive(Debug)]
pub struct FileEvent {
    pub offset: u64,
    pub event: Event,
    pub unpacked: Vec<Event>,
}

/// Every event of one binlog file's bytes, TRANSACTION_PAYLOAD events unpacked (MySQL 8
/// `binlog_transaction_compression`). A truncated or corrupt file is an error naming `name`
/// and the byte offset; no input makes it panic. The entry point of the fuzz targets.
pub fn events_from_bytes(name: &str, bytes: &[u8]) -> Result<Vec<FileEvent>, Error> {
    let mut framer = EventFramer::file(bytes).map_err(|m| Error::Decode(format!("{name}: {m}")))?;
    let mut out = Vec::new();
    while let Some((offset, event)) = framer
        .next_event()
        .map_err(|(at, m)| at_offset(name, at, m))?
    {
        let unpacked = if event.header().event_type_raw() == super::decode::TRANSACTION_PAYLOAD {
            super::decode::unpack_payload(&event, super::decode::DEFAULT_PAYLOAD_LIMIT)
                .map_err(|m| at_offset(name, offset, format!("transaction payload: {m}")))?
        } else {
            Vec::new()
        };
        out.push(FileEvent {
            offset: offset as u64,
            event,
            unpacked,
        });
    }
    Ok(out)
}

/// Every outbox event in one binlog file's bytes, as the file source would send them (with
/// their commit positions), decoded for `table`. Errors as [`events_from_bytes`]; a second
/// entry point for the fuzz targets, through the decoder.
pub fn outbox_events_from_bytes(
    table: &OutboxTable,
    name: &str,
    bytes: &[u8],
) -> Result<Vec<OutboxEvent>, Error> {
    let mut dec = Decoder::new(vec![table.clone()], name, None);
    let mut out = Vec::new();
    let mut open: Vec<OutboxEvent> = Vec::new();
    let mut framer = EventFramer::file(bytes).map_err(|m| Error::Decode(format!("{name}: {m}")))?;
    while let Some((offset, event)) = framer
        .next_event()
        .map_err(|(at, m)| at_offset(name, at, m))?
    {
        let steps = dec
            .feed(&event)
            .map_err(|e| at_offset_err(name, offset, e))?;
        collect(steps, &mut open, |e| {
            out.push(e);
            Ok::<_, Error>(())
        })?;
    }
    Ok(out)
}

/// Applies decoder steps: rows are held until their commit, then given out with the end
/// position filled in; an aborted group's rows are dropped, and so are the rows a group
/// rolled back (to a savepoint, or whole). Returns the checkpoint of the last
/// commit among `steps`.
fn collect<F>(
    steps: Vec<Step>,
    open: &mut Vec<OutboxEvent>,
    mut give: F,
) -> Result<Option<Checkpoint>, Error>
where
    F: FnMut(OutboxEvent) -> Result<(), Error>,
{
    let mut last = None;
    for step in steps {
        match step {
            Step::Begin { .. } | Step::Abort { .. } => open.clear(),
            Step::Rows(events) => open.extend(events),
            Step::Undo { keep, .. } => open.retain(|e| row_index(e) < keep),
            Step::Commit { checkpoint, .. } => {
                let Checkpoint::Binlog { pos: end, .. } = &checkpoint else {
                    unreachable!("binlog checkpoints only")
                };
                for mut e in open.drain(..) {
                    if let SourcePosition::Binlog { end_pos, .. } = &mut e.position {
                        *end_pos = *end;
                    }
                    give(e)?;
                }
                last = Some(checkpoint);
            }
            Step::Nothing | Step::Heartbeat => {}
        }
    }
    Ok(last)
}

fn at_offset(name: &str, at: usize, m: String) -> Error {
    Error::Decode(format!("binlog file {name} at byte offset {at}: {m}"))
}

fn at_offset_err(name: &str, at: usize, e: Error) -> Error {
    match e {
        Error::Decode(m) => at_offset(name, at, m),
        other => other,
    }
}

/// The binlog files to read, in order. A directory gives every file in it that starts with
/// the binlog magic bytes (so `mysql-bin.index`, relay logs' info files and the like are left
/// out), sorted by name — the servers number them with zero-padded suffixes, so that is log
/// order — limited to `from..=to`.
pub(crate) fn binlog_files(sel: &FileDsn) -> Result<Vec<PathBuf>, Error> {
    let io_err = |p: &Path, e: std::io::Error| {
        Error::config(
            format!("cannot read {}: {e}", p.display()),
            "name an existing binlog file or directory readable by this user, e.g. --source file:///var/lib/mysql/mysql-bin.000042",
        )
    };
    let meta = std::fs::metadata(&sel.path).map_err(|e| io_err(&sel.path, e))?;
    if !meta.is_dir() {
        if sel.from.is_some() || sel.to.is_some() {
            return Err(Error::config(
                format!(
                    "{} is a file: from= and to= choose files in a directory",
                    sel.path.display()
                ),
                "name the directory: file:///var/lib/mysql/?from=mysql-bin.000040&to=mysql-bin.000042",
            ));
        }
        return Ok(vec![sel.path.clone()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&sel.path).map_err(|e| io_err(&sel.path, e))? {
        let entry = entry.map_err(|e| io_err(&sel.path, e))?;
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        let mut head = [0u8; 4];
        let is_binlog = std::fs::File::open(&path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head))
            .is_ok()
            && head == MAGIC;
        if !is_binlog {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        if sel
            .from
            .as_ref()
            .is_some_and(|f| name.as_str() < f.as_str())
            || sel.to.as_ref().is_some_and(|t| name.as_str() > t.as_str())
        {
            continue;
        }
        files.push((name, path));
    }
    files.sort();
    for (bound, which) in [(&sel.from, "from"), (&sel.to, "to")] {
        if let Some(b) = bound {
            if !files.iter().any(|(n, _)| n == b) {
                return Err(Error::config(
                    format!("{which}={b}: no such binlog file in {}", sel.path.display()),
                    format!("name a file of the directory ({})", describe(&files)),
                ));
            }
        }
    }
    if files.is_empty() {
        return Err(Error::config(
            format!("{} holds no binlog files", sel.path.display()),
            "name the directory that holds the binlog files (SELECT @@log_bin_basename shows it on the server)",
        ));
    }
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

fn describe(files: &[(String, PathBuf)]) -> String {
    match (files.first(), files.last()) {
        (Some(a), Some(b)) => format!("{} … {}", a.0, b.0),
        _ => "none".into(),
    }
}

/// The memory bounds of the file source (the same flags as the live stream's).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Bytes of outbox rows held for prepared XA transactions at once (`--txn-buffer`).
    pub txn_buffer_bytes: usize,
    /// Largest uncompressed size a compressed transaction may declare
    /// (`--max-txn-payload-bytes`).
    pub max_payload_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            txn_buffer_bytes: super::decode::DEFAULT_TXN_BUFFER,
            max_payload_bytes: super::decode::DEFAULT_PAYLOAD_LIMIT,
        }
    }
}

/// Reads `files` in order and sends their outbox events (each after its transaction's commit,
/// with its position: file name, commit end position, index) and a checkpoint after the last
/// commit of each file; then closes the relay's input, so the relay drains and the run ends.
/// `shutdown` stops between transactions. A compressed transaction's events are inflated and
/// decoded one at a time.
pub async fn run(
    files: Vec<PathBuf>,
    tables: Vec<OutboxTable>,
    limits: Limits,
    link: SourceLink,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let SourceLink { outlet, acks: _ } = link;
    let first = files.first().map(|p| file_name(p)).unwrap_or_default();
    let mut dec = Decoder::new(tables, &first, None)
        .with_limits(limits.txn_buffer_bytes, limits.max_payload_bytes);
    let mut published: u64 = 0;
    for path in &files {
        let name = file_name(path);
        let bytes = tokio::fs::read(path).await.map_err(|e| {
            Error::config(
                format!("cannot read {}: {e}", path.display()),
                "check the path and that this user may read it",
            )
        })?;
        dec.set_file(&name);
        let mut framer =
            EventFramer::file(&bytes).map_err(|m| Error::Decode(format!("{name}: {m}")))?;
        let mut open: Vec<OutboxEvent> = Vec::new();
        let mut last: Option<Checkpoint> = None;
        tracing::info!(file = %path.display(), bytes = bytes.len(), "reading binlog file");
        loop {
            if shutdown.is_cancelled() && !dec.in_txn() {
                tracing::info!(file = %name, offset = framer.offset(), "stopped between transactions");
                return finish(outlet, last).await;
            }
            let Some((offset, event)) = framer
                .next_event()
                .map_err(|(at, m)| at_offset(&name, at, m))?
            else {
                break;
            };
            let mut inner = dec
                .payload_events(&event)
                .map_err(|e| at_offset_err(&name, offset, e))?;
            let mut whole = Some(&event);
            loop {
                // One event at a time, also inside a compressed transaction.
                let steps = match inner.as_mut() {
                    None => match whole.take() {
                        Some(e) => dec.feed(e),
                        None => break,
                    },
                    Some(p) => match p.next_event() {
                        Ok(Some(e)) => dec.feed_inner(&e, &event),
                        Ok(None) => break,
                        Err(m) => Err(dec.payload_err(offset as u64, m)),
                    },
                }
                .map_err(|e| at_offset_err(&name, offset, e))?;
                let mut batch = Vec::new();
                if let Some(cp) = collect(steps, &mut open, |e| {
                    batch.push(e);
                    Ok(())
                })? {
                    last = Some(cp);
                }
                for e in batch {
                    published += 1;
                    outlet.send_event(e).await?;
                }
            }
        }
        if dec.in_txn() {
            tracing::warn!(file = %name, "the file ends inside a transaction (the server was still writing it, or it crashed): that transaction's rows are not published");
        }
        if let Some(cp) = last.take() {
            outlet.send_checkpoint(cp).await?;
        }
    }
    tracing::info!(
        files = files.len(),
        events = published,
        "all binlog files read"
    );
    finish(outlet, None).await
}

async fn finish(outlet: crate::source::Outlet, last: Option<Checkpoint>) -> Result<(), Error> {
    if let Some(cp) = last {
        outlet.send_checkpoint(cp).await?;
    }
    // Dropping the outlet closes the relay's input: it drains and ends.
    drop(outlet);
    Ok(())
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// The CRC32 a binlog event carries over `body` (the event without its checksum, header
/// included). A format description's is computed with LOG_EVENT_BINLOG_IN_USE_F (flags bit 0)
/// clear: the server sets that flag in the file after computing the checksum and clears it
/// when it closes the file.
pub fn event_checksum(body: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    if body.len() >= HEADER_LEN && body[4] == FORMAT_DESCRIPTION {
        let mut head = [0u8; HEADER_LEN];
        head.copy_from_slice(&body[..HEADER_LEN]);
        head[17] &= !1;
        hasher.update(&head);
        hasher.update(&body[HEADER_LEN..]);
    } else {
        hasher.update(body);
    }
    hasher.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_refuses_short_long_and_corrupt_events() {
        assert!(EventFramer::file(b"").is_err());
        assert!(EventFramer::file(b"\xfebi").is_err());
        assert!(EventFramer::file(b"GIF89a").is_err());
        let mut f = EventFramer::file(&MAGIC).unwrap();
        assert!(f.next_event().unwrap().is_none());

        // A header claiming 1 GiB: refused before anything is allocated.
        let mut bytes = MAGIC.to_vec();
        let mut header = [0u8; HEADER_LEN];
        header[4] = 2;
        header[9..13].copy_from_slice(&(1u32 << 30).to_le_bytes());
        bytes.extend_from_slice(&header);
        let (at, m) = EventFramer::file(&bytes).unwrap().next_event().unwrap_err();
        assert_eq!(at, 4);
        assert!(m.contains("claims 1073741824 bytes"), "{m}");

        // Shorter than its own header.
        bytes[4 + 9..4 + 13].copy_from_slice(&5u32.to_le_bytes());
        let (_, m) = EventFramer::file(&bytes).unwrap().next_event().unwrap_err();
        assert!(m.contains("less than its own"), "{m}");

        // A partial header.
        let (_, m) = EventFramer::file(&bytes[..10])
            .unwrap()
            .next_event()
            .unwrap_err();
        assert!(m.contains("an event header needs 19"), "{m}");
    }
}
