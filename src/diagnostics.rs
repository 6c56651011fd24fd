//! What `outboxd check` prints: one line per check, each failure with its fix, for every
//! source and sink that checks itself (`source::postgres::operator`,
//! `source::mysql::operator`, `sink::topology`, `sink::nats`). A leaf, so the checks of one
//! part never import another part.

use serde::Serialize;

/// One preflight result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CheckLine {
    pub level: Level,
    pub check: String,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl std::fmt::Display for CheckLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tag = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        write!(f, "{tag} {}: {}", self.check, self.detail)?;
        if let Some(fix) = &self.fix {
            write!(f, "\n     fix: {fix}")?;
        }
        Ok(())
    }
}

/// A line (the checks build many).
pub fn line(
    level: Level,
    check: &str,
    detail: impl Into<String>,
    fix: Option<String>,
) -> CheckLine {
    CheckLine {
        level,
        check: check.into(),
        detail: detail.into(),
        fix,
    }
}

/// The `lease` line of `outboxd status`, the same for every source: who holds the lease
/// (`-` for no one) and whether it is live.
/// `status`'s progress line (after the lease line): what the lease holder's running snapshot,
/// replay or catch-up last stored (see `crate::progress::summary`), or `-` when none runs.
/// Without a live lease the report is a stopped relay's last word.
pub(crate) fn write_progress(
    f: &mut std::fmt::Formatter<'_>,
    progress: Option<&serde_json::Value>,
    live: bool,
) -> std::fmt::Result {
    match progress {
        None => write!(f, "\nprogress         -"),
        Some(p) => write!(
            f,
            "\nprogress         {}{}",
            crate::progress::describe(p),
            if live {
                ""
            } else {
                " (last reported by a relay that stopped)"
            }
        ),
    }
}

pub(crate) fn write_lease(
    f: &mut std::fmt::Formatter<'_>,
    holder: Option<&str>,
    live: bool,
) -> std::fmt::Result {
    write!(
        f,
        "lease            {}{}",
        holder.unwrap_or("-"),
        if live {
            " (live)"
        } else {
            " (expired or free)"
        }
    )
}
