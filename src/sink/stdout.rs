//! The stdout sink (docs/message-format.md): one JSON object per event per line, logs stay on stderr.
//! Lines are buffered and flushed before any position that covers them is acknowledged. Lines
//! still buffered when the sink is dropped are discarded, not written: their positions were
//! never acknowledged (they come again on the next start), and a relay that stops because it
//! lost its lease must print nothing more.

use super::{Delivery, Sink, SinkError};
use crate::event::OutboxEvent;
use serde::Serialize;
use serde_json::value::RawValue;
use std::io::Write;

pub struct StdoutSink<W: Write + Send = std::io::Stdout> {
    /// Always `Some` until dropped or taken apart (`BufWriter` would write its buffer out when
    /// dropped).
    out: Option<std::io::BufWriter<W>>,
    commit_offsets: bool,
}

impl StdoutSink {
    pub fn new(commit_offsets: bool) -> Self {
        Self::with_writer(std::io::stdout(), commit_offsets)
    }
}

impl<W: Write + Send> StdoutSink<W> {
    pub fn with_writer(writer: W, commit_offsets: bool) -> Self {
        StdoutSink {
            out: Some(std::io::BufWriter::with_capacity(256 * 1024, writer)),
            commit_offsets,
        }
    }

    fn out(&mut self) -> &mut std::io::BufWriter<W> {
        self.out.as_mut().expect("present until dropped")
    }
}

impl<W: Write + Send> Drop for StdoutSink<W> {
    fn drop(&mut self) {
        // Discard, do not write, what was never flushed.
        if let Some(out) = self.out.take() {
            drop(out.into_parts());
        }
    }
}

#[derive(Serialize)]
struct Line<'a> {
    id: String,
    aggregate_id: &'a str,
    topic: &'a str,
    payload: &'a RawValue,
    created_at: String,
    position: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    table: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    poison: Option<&'a str>,
}

/// Renders the stdout line of an event (without the newline).
pub(crate) fn render_line(event: &OutboxEvent) -> Result<Vec<u8>, SinkError> {
    let null = RawValue::from_string("null".into()).expect("null is JSON");
    // The payload goes out as a JSON value: it was validated when decoded, and a poison event
    // (invalid JSON) prints `null` with its reason instead of breaking the line format.
    let payload_str = std::str::from_utf8(&event.payload).ok();
    let raw: Option<&RawValue> = match (&event.poison, payload_str) {
        (None, Some(s)) => serde_json::from_str(s).ok(),
        _ => None,
    };
    let line = Line {
        id: event.id.hyphenated().to_string(),
        aggregate_id: &event.aggregate_id,
        topic: &event.topic,
        payload: raw.unwrap_or(&null),
        created_at: event.created_at_rfc3339(),
        position: event.position.to_string(),
        table: event.table.as_deref(),
        poison: event.poison.as_deref().or(if raw.is_none() {
            Some("payload is not valid JSON")
        } else {
            None
        }),
    };
    serde_json::to_vec(&line).map_err(|e| SinkError::Io(std::io::Error::other(e)))
}

impl<W: Write + Send> Sink for StdoutSink<W> {
    fn name(&self) -> &'static str {
        "stdout"
    }

    fn stores_position(&self) -> bool {
        self.commit_offsets
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        Ok(())
    }

    async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
        let mut line = render_line(event)?;
        line.push(b'\n');
        self.out().write_all(&line)?;
        Ok(Delivery::Accepted)
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        self.out().flush()?;
        Ok(())
    }
}

/// The stdout sink in the registry: `--sink stdout` (or `-`), no flags of its own
/// (`--commit-offsets` is the relay's, in [`super::SinkContext`]), nothing to check.
pub(crate) const DESCRIPTOR: super::Descriptor = super::Descriptor {
    kind: super::SinkKind::Stdout,
    name: "stdout",
    words: &["stdout", "-"],
    schemes: &[],
    example: "stdout",
    is_url: false,
    build: |_, _, ctx| {
        Ok(super::AnySink::Stdout(Box::new(StdoutSink::new(
            ctx.commit_offsets,
        ))))
    },
    check: super::registry::no_check,
    columns: super::registry::no_columns,
    ignored: |o| {
        let p = &o.partitioning;
        (p.partitions > 0 || p.sends_headers()).then_some(
            "--partitions and --group-partitions apply to a RabbitMQ sink: the stdout sink ignores them",
        )
    },
    password: |_| None,
};

/// The stdout sink's own settings: none.
#[derive(Debug, Clone, Default)]
pub struct Options;

/// The stdout sink's own flags: none.
#[cfg(feature = "cli")]
#[derive(Debug, Clone, Default, clap::Args)]
pub struct StdoutFlags {}

#[cfg(feature = "cli")]
pub use StdoutFlags as Flags;

#[cfg(feature = "cli")]
impl StdoutFlags {
    pub fn options(&self) -> Result<Options, crate::Error> {
        Ok(Options)
    }
}
