//! How long a prepared XA transaction has held the stored position back, and what happens
//! when that is too long. While one that holds outbox rows is prepared, every position the
//! source sends is the one before its prepare (see [`super::decode`]), so a restart reads
//! again, and publishes again, everything committed since: past any duplicate window when the
//! prepare is old. The watch makes that visible and bounded, checked every second: the gauge
//! `outboxd_xa_prepared_oldest_age_seconds`, a WARN once the prepare is older than
//! [`WARN_AFTER`] (or half the limit) and again every [`WARN_EVERY`], and at
//! `--xa-prepare-limit` the policy `--xa-prepare-expired`: `stop` ends the relay with the
//! statements that end the transaction (the position stays before it: nothing is lost);
//! `release` stops holding the position for it, logging each XID given up.
//!
//! The age is the server's: the prepare event's time in the binlog, so a restart that reads
//! the prepare again knows how old it is.

use super::decode::{Decoder, XaPin};
use crate::telemetry::events::{InternalEvent, XaPreparePinning, XaPrepareReleased};
use crate::Error;
use chrono::Utc;
use std::time::{Duration, Instant};

/// A prepare older than this (or than half the limit, when that is shorter) is logged.
pub(crate) const WARN_AFTER: Duration = Duration::from_secs(10);
/// How often the WARN repeats while the same prepare holds the position.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(60);
/// The default of `--xa-prepare-limit`.
pub(crate) const DEFAULT_LIMIT: Duration = Duration::from_secs(3600);

/// `--xa-prepare-expired`: what the relay does with a prepared XA transaction that has held
/// its position back longer than `--xa-prepare-limit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum XaExpired {
    /// Stop with the statements that end it; the stored position stays before its prepare.
    #[default]
    Stop,
    /// Store positions past it and log its XID: its rows are published only if its commit
    /// comes before this process ends.
    Release,
}

/// The watch's memory: which prepare was last reported, and when.
#[derive(Debug, Default)]
pub(crate) struct XaWatch {
    /// The XID last warned about, and when.
    warned: Option<(String, Instant)>,
    /// Whether the gauge shows a prepare (so it is set back to 0 once none holds).
    shown: bool,
}

impl XaWatch {
    /// One look at what holds the position back. `Ok(true)` when prepares were given up (the
    /// caller sends its position at once); an error under the `stop` policy.
    pub(crate) fn check(
        &mut self,
        dec: &mut Decoder,
        limit: Duration,
        policy: XaExpired,
    ) -> Result<bool, Error> {
        let pins = dec.pins();
        let Some(oldest) = pins.first() else {
            if std::mem::take(&mut self.shown) {
                XaPreparePinning {
                    xid: None,
                    age: Duration::ZERO,
                    held_at: &"",
                    count: 0,
                    limit,
                    warn: false,
                }
                .emit();
            }
            self.warned = None;
            return Ok(false);
        };
        let age = age(oldest);
        if age >= limit {
            match policy {
                XaExpired::Stop => return Err(expired_error(&pins, limit)),
                XaExpired::Release => {
                    let cutoff = Utc::now()
                        - chrono::Duration::from_std(limit).unwrap_or(chrono::Duration::MAX);
                    for p in dec.release_prepared_before(cutoff) {
                        XaPrepareReleased {
                            xid: &p.xid,
                            age: self::age(&p),
                            rows: p.rows,
                            held_at: &p.floor,
                        }
                        .emit();
                    }
                    // What holds the position now (maybe nothing) is shown at the next look.
                    return Ok(true);
                }
            }
        }
        let xid = oldest.xid.to_string();
        let due = match &self.warned {
            Some((x, at)) => *x != xid || at.elapsed() >= WARN_EVERY,
            None => true,
        };
        let warn = due && age >= WARN_AFTER.min(limit / 2);
        if warn {
            self.warned = Some((xid, Instant::now()));
        }
        XaPreparePinning {
            xid: Some(&oldest.xid),
            age,
            held_at: &oldest.floor,
            count: pins.len(),
            limit,
            warn,
        }
        .emit();
        self.shown = true;
        Ok(false)
    }
}

/// How long ago the server prepared it (0 when its clock is ahead of ours).
fn age(p: &XaPin) -> Duration {
    (Utc::now() - p.prepared_at).to_std().unwrap_or_default()
}

/// The `stop` policy's error: every prepare that holds the position back, and the statements
/// that end them.
fn expired_error(pins: &[XaPin], limit: Duration) -> Error {
    let names = pins
        .iter()
        .map(|p| {
            format!(
                "{} (prepared {}s ago, {} outbox row(s), position held at {})",
                p.xid,
                age(p).as_secs(),
                p.rows,
                p.floor
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let ends = pins
        .iter()
        .map(|p| format!("XA COMMIT {0}; or XA ROLLBACK {0};", p.xid))
        .collect::<Vec<_>>()
        .join(" ");
    Error::config(
        format!(
            "a prepared XA transaction has held the stored position back longer than --xa-prepare-limit ({limit:?}): {names}. Every restart publishes again everything committed since its prepare; the relay stops instead of holding the position longer (the position stays before the prepare: nothing is lost)"
        ),
        format!(
            "end it on the server ({ends}) and start the relay again; or start it with --xa-prepare-expired release to move the position past it (its rows are then published only if it commits while that relay runs), or a longer --xa-prepare-limit"
        ),
    )
}
