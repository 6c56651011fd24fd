//! Compressed transactions (MySQL 8's TRANSACTION_PAYLOAD events): the payload header, its
//! events inflated and framed one at a time, and the limit on what a payload may declare.

use super::{span, Decoder, Step, TRANSACTION_PAYLOAD};
use crate::Error;
use mysql_common::binlog::events::Event;

impl Decoder {
    /// The events of `ev` one at a time when it is a TRANSACTION_PAYLOAD (`None` for any other
    /// event); feed each with [`Decoder::feed_inner`]. Refuses a payload that declares more
    /// than the limit before inflating anything.
    pub fn payload_events<'e>(&self, ev: &'e Event) -> Result<Option<PayloadEvents<'e>>, Error> {
        if ev.header().event_type_raw() != TRANSACTION_PAYLOAD {
            return Ok(None);
        }
        let (start, _) = span(ev);
        match PayloadEvents::open(ev, self.payload_limit) {
            Ok(p) => Ok(Some(p)),
            Err(PayloadError::TooLarge { declared, limit }) => Err(payload_too_large(
                &format!("{}:{start}", self.file),
                declared,
                limit,
            )),
            Err(PayloadError::Corrupt(m)) => Err(self.payload_err(start, m)),
        }
    }

    /// Feeds one event of the TRANSACTION_PAYLOAD `outer` (from [`Decoder::payload_events`]):
    /// it sits at the payload's place.
    pub fn feed_inner(&mut self, inner: &Event, outer: &Event) -> Result<Vec<Step>, Error> {
        let (start, end) = span(outer);
        if inner.header().event_type_raw() == TRANSACTION_PAYLOAD {
            return Err(self.payload_err(
                start,
                "a transaction payload inside a transaction payload".into(),
            ));
        }
        self.feed_at(inner, start, end)
    }

    /// A corrupt payload error, naming its position (the stream's `feed` path and the
    /// sources' streamed path say the same).
    pub fn payload_err(&self, start: u64, m: String) -> Error {
        Error::Decode(format!("transaction payload at {}:{start}: {m}", self.file))
    }
}

/// Why a TRANSACTION_PAYLOAD cannot be read.
#[derive(Debug)]
pub enum PayloadError {
    /// It declares more uncompressed bytes than the limit (`--max-txn-payload-bytes`).
    TooLarge { declared: u64, limit: u64 },
    /// Its header or contents are corrupt (the message says how).
    Corrupt(String),
}

impl std::fmt::Display for PayloadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PayloadError::TooLarge { declared, limit } => write!(
                f,
                "it declares {declared} uncompressed bytes, more than --max-txn-payload-bytes ({limit})"
            ),
            PayloadError::Corrupt(m) => f.write_str(m),
        }
    }
}

impl From<String> for PayloadError {
    fn from(m: String) -> Self {
        PayloadError::Corrupt(m)
    }
}

impl From<&str> for PayloadError {
    fn from(m: &str) -> Self {
        PayloadError::Corrupt(m.to_string())
    }
}

/// The events wrapped in one TRANSACTION_PAYLOAD event, inflated (zstd or none) and framed one
/// at a time with the same checks as a file's events (they carry no checksums): memory holds
/// the event being framed and zstd's window (at most 128 MiB, zstd's default decoder limit),
/// never the whole transaction. Nothing past the payload's declared uncompressed size is
/// inflated, and a declared size above the limit is refused before anything is.
///
/// The payload header is read here, not by `mysql_common`: its parser unwraps an unknown
/// compression type and skips unknown fields by their claimed length, and either panics on
/// corrupt input. The header is fields of (type, length, value) as length-encoded integers:
/// 1 payload size, 2 compression type (0 zstd, 255 none), 3 uncompressed size; 0 ends it and
/// the payload follows.
pub struct PayloadEvents<'a> {
    reader: mysql_common::binlog::events::TransactionPayloadReader<'a>,
    fde: mysql_common::binlog::events::FormatDescriptionEvent<'static>,
    declared: u64,
    /// Declared bytes not framed yet.
    left: u64,
}

impl<'a> PayloadEvents<'a> {
    /// Reads the header of the payload event `ev`.
    pub fn open(ev: &'a Event, limit: u64) -> Result<PayloadEvents<'a>, PayloadError> {
        use mysql_common::binlog::events::TransactionPayloadReader;
        let mut b = ev.data();
        let (mut size, mut algorithm, mut declared) = (None, None, None);
        loop {
            let field = lenenc(&mut b).ok_or("truncated header")?;
            if field == 0 {
                break;
            }
            let len = lenenc(&mut b).ok_or("truncated header")?;
            let len = usize::try_from(len).map_err(|_| "corrupt header")?;
            if len > b.len() {
                return Err(
                    format!("header field {field} claims {len} bytes, {} left", b.len()).into(),
                );
            }
            let (mut value, rest) = b.split_at(len);
            b = rest;
            match field {
                1 => size = Some(lenenc(&mut value).ok_or("corrupt payload size")?),
                2 => algorithm = Some(lenenc(&mut value).ok_or("corrupt compression type")?),
                3 => declared = Some(lenenc(&mut value).ok_or("corrupt uncompressed size")?),
                _ => {}
            }
        }
        let size = size.ok_or("no payload size in the header")?;
        if size != b.len() as u64 {
            return Err(format!("it claims {size} payload bytes, it holds {}", b.len()).into());
        }
        let declared = match (algorithm, declared) {
            (Some(255), None) => b.len() as u64,
            (_, Some(d)) => d,
            (Some(0), None) => return Err("no uncompressed size in the header".into()),
            (_, None) => 0,
        };
        if declared > limit {
            return Err(PayloadError::TooLarge { declared, limit });
        }
        let reader = match algorithm {
            Some(0) => TransactionPayloadReader::new_zstd(b)
                .map_err(|e| format!("cannot decompress: {e}"))?,
            Some(255) => TransactionPayloadReader::new_uncompressed(b),
            Some(other) => return Err(format!("unknown compression type {other}").into()),
            None => return Err("no compression type in the header".into()),
        };
        let mut fde = ev.fde().clone().into_owned();
        let mut footer = fde.footer();
        footer.set_checksum_enabled(false);
        fde = fde.with_footer(footer);
        Ok(PayloadEvents {
            reader,
            fde,
            declared,
            left: declared,
        })
    }

    /// The uncompressed size the payload declares.
    pub fn declared(&self) -> u64 {
        self.declared
    }

    /// The next event of the payload; `None` after the last. An error says what is wrong and
    /// at which offset of the unpacked payload.
    pub fn next_event(&mut self) -> Result<Option<Event>, String> {
        use std::io::Read;
        let at = self.declared - self.left;
        let inflate = |e: std::io::Error| format!("cannot decompress (at offset {at}): {e}");
        if self.left == 0 {
            let mut probe = [0u8; 1];
            return match self.reader.read(&mut probe).map_err(inflate)? {
                0 => Ok(None),
                _ => Err(format!(
                    "it holds more than the {} uncompressed bytes it declares",
                    self.declared
                )),
            };
        }
        let short = |got: u64| {
            format!(
                "it declares {} uncompressed bytes but holds {}",
                self.declared,
                at + got
            )
        };
        const HEADER: usize = 19;
        if self.left < HEADER as u64 {
            return Err(format!(
                "event at offset {at} of the unpacked payload: truncated: {} bytes left, an event header needs {HEADER}",
                self.left
            ));
        }
        let mut header = [0u8; HEADER];
        read_full(&mut self.reader, &mut header)
            .map_err(inflate)?
            .map_err(|got| short(got as u64))?;
        let size = u32::from_le_bytes(header[9..13].try_into().expect("4 bytes")) as u64;
        if size < HEADER as u64 || size > self.left {
            return Err(format!(
                "event at offset {at} of the unpacked payload: it claims {size} bytes, {} are left of the declared size",
                self.left
            ));
        }
        if header[4] == TRANSACTION_PAYLOAD {
            return Err("a transaction payload inside a transaction payload".into());
        }
        let mut raw = vec![0u8; size as usize];
        raw[..HEADER].copy_from_slice(&header);
        read_full(&mut self.reader, &mut raw[HEADER..])
            .map_err(inflate)?
            .map_err(|got| short((HEADER + got) as u64))?;
        self.left -= size;
        let mut framer = crate::source::mysql::file::EventFramer::embedded(&raw, &self.fde);
        match framer.next_event() {
            Ok(Some((_, e))) => Ok(Some(e)),
            Ok(None) => unreachable!("a non-empty buffer"),
            Err((_, m)) => Err(format!("event at offset {at} of the unpacked payload: {m}")),
        }
    }
}

/// Fills `buf` from `r`; `Ok(Err(n))` when the input ended after `n` bytes.
fn read_full(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<Result<(), usize>> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Ok(Err(got)),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Ok(()))
}

/// Every event of a TRANSACTION_PAYLOAD at once (tests and fuzzing; the sources stream them
/// with [`PayloadEvents`]).
pub fn unpack_payload(ev: &Event, limit: u64) -> Result<Vec<Event>, PayloadError> {
    let mut p = PayloadEvents::open(ev, limit)?;
    let mut out = Vec::new();
    while let Some(e) = p.next_event()? {
        out.push(e);
    }
    Ok(out)
}

/// The error for a payload that declares more than the limit.
pub fn payload_too_large(where_: &str, declared: u64, limit: u64) -> Error {
    Error::config(
        format!(
            "the compressed transaction (TRANSACTION_PAYLOAD) at {where_} declares {declared} uncompressed bytes, more than --max-txn-payload-bytes ({limit})"
        ),
        format!(
            "raise --max-txn-payload-bytes above {declared} (e.g. --max-txn-payload-bytes {}) if the server really writes transactions that large",
            declared.next_power_of_two()
        ),
    )
}

/// A MySQL length-encoded integer, consumed from `b`.
fn lenenc(b: &mut &[u8]) -> Option<u64> {
    let (&first, rest) = b.split_first()?;
    let n = match first {
        0..=0xfa => {
            *b = rest;
            return Some(first as u64);
        }
        0xfc => 2,
        0xfd => 3,
        0xfe => 8,
        _ => return None,
    };
    if rest.len() < n {
        return None;
    }
    let mut raw = [0u8; 8];
    raw[..n].copy_from_slice(&rest[..n]);
    *b = &rest[n..];
    Some(u64::from_le_bytes(raw))
}
