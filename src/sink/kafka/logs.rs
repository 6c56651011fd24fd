//! librdkafka's log lines and global errors, passed to `tracing` without a storm. With a broker
//! that cannot be reached, every client the sink holds (producer, admin, readers) logs each
//! failed connect and an "all brokers down" error, several times a second, for as long as the
//! broker is away: a line that repeats (the same words, numbers aside) is logged once, then at
//! most once a minute with the count of those held back meanwhile (those go to debug). The
//! relay's own "sink unavailable" warning says what it does about it.

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long repeats of a line are held back after it was logged.
pub(crate) const REPEAT_WINDOW: Duration = Duration::from_secs(60);
/// Most distinct lines remembered (then the memory starts again: a line with ever new words
/// cannot grow it without bound).
const MAX_KEYS: usize = 1024;

struct Seen {
    logged_at: Instant,
    held_back: u64,
}

fn seen() -> &'static Mutex<HashMap<String, Seen>> {
    static SEEN: OnceLock<Mutex<HashMap<String, Seen>>> = OnceLock::new();
    SEEN.get_or_init(Default::default)
}

/// The line without its numbers (ports, durations, counts), so that repeats match.
fn key(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_number = false;
    for c in text.chars() {
        if c.is_ascii_digit() {
            if !in_number {
                out.push('#');
            }
            in_number = true;
        } else {
            in_number = false;
            out.push(c);
        }
    }
    // librdkafka's own count of the repeats it folded into this line.
    out.replace(", # identical error(s) suppressed", "")
}

/// Whether to log `text` now: `Some(held back since it was last logged)`, or `None` to hold
/// it back.
pub(crate) fn admit(text: &str, now: Instant) -> Option<u64> {
    let Ok(mut map) = seen().lock() else {
        return Some(0);
    };
    if map.len() >= MAX_KEYS {
        map.clear();
    }
    match map.get_mut(&key(text)) {
        Some(s) if now.duration_since(s.logged_at) < REPEAT_WINDOW => {
            s.held_back += 1;
            None
        }
        Some(s) => {
            let held = s.held_back;
            s.logged_at = now;
            s.held_back = 0;
            Some(held)
        }
        None => {
            map.insert(
                key(text),
                Seen {
                    logged_at: now,
                    held_back: 0,
                },
            );
            Some(0)
        }
    }
}

fn emit(level: RDKafkaLogLevel, text: &str) {
    let held = match level {
        RDKafkaLogLevel::Debug => {
            tracing::debug!(target: "outboxd::sink::kafka::librdkafka", "{text}");
            return;
        }
        _ => match admit(text, Instant::now()) {
            Some(n) => n,
            None => {
                tracing::debug!(target: "outboxd::sink::kafka::librdkafka", "{text} (repeat held back)");
                return;
            }
        },
    };
    let note = if held > 0 {
        format!(
            " ({held} more like it held back in the last {}s)",
            REPEAT_WINDOW.as_secs()
        )
    } else {
        String::new()
    };
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => {
            tracing::error!(target: "outboxd::sink::kafka::librdkafka", "{text}{note}")
        }
        RDKafkaLogLevel::Warning => {
            tracing::warn!(target: "outboxd::sink::kafka::librdkafka", "{text}{note}")
        }
        _ => tracing::info!(target: "outboxd::sink::kafka::librdkafka", "{text}{note}"),
    }
}

/// librdkafka's log line `message` of facility `fac`.
pub(crate) fn log(level: RDKafkaLogLevel, fac: &str, message: &str) {
    emit(level, &format!("librdkafka: {fac} {message}"));
}

/// A global error of a client (all brokers down, a transport failure).
pub(crate) fn error(error: &KafkaError, reason: &str) {
    emit(
        RDKafkaLogLevel::Error,
        &format!("librdkafka: {error}: {reason}"),
    );
}

/// The context of every client the sink creates: librdkafka's lines through [`log`] and
/// [`error`].
#[derive(Clone, Copy, Default)]
pub(crate) struct Quiet;

impl ClientContext for Quiet {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        log(level, fac, message)
    }

    fn error(&self, e: KafkaError, reason: &str) {
        error(&e, reason)
    }
}

impl ConsumerContext for Quiet {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_are_held_back_for_the_window_and_counted() {
        let t0 = Instant::now();
        let line = "librdkafka: FAIL test-only 127.0.0.1:1: Connect failed (after 0ms)";
        assert_eq!(admit(line, t0), Some(0));
        let again = "librdkafka: FAIL test-only 127.0.0.1:1: Connect failed (after 12ms, 3 identical error(s) suppressed)";
        assert_eq!(admit(again, t0 + Duration::from_secs(1)), None);
        assert_eq!(admit(again, t0 + Duration::from_secs(2)), None);
        assert_eq!(
            admit(line, t0 + REPEAT_WINDOW + Duration::from_secs(1)),
            Some(2)
        );
        assert_eq!(admit("librdkafka: test-only other words", t0), Some(0));
    }
}
