//! What differs between the PostgreSQL major versions the relay is tested on (14 to 18) for
//! logical replication, in one place: the server's version, which slot columns, functions and
//! settings it has, and the `check` lines for the settings that matter on it, each with its
//! fix. The stream itself needs no per-version branch: the relay asks pgoutput for protocol
//! version 1 (whole transactions at their commit, no in-progress streaming, no two-phase
//! decoding), which every version from 10 to 18 speaks the same way, so a prepared
//! transaction arrives only at `COMMIT PREPARED` and a rolled-back one never.

use crate::diagnostics::{line, CheckLine, Level};
use crate::outbox::pg_literal;
use crate::Error;
use tokio_postgres::Client;

/// The oldest major version the version suite runs against.
pub(crate) const OLDEST_TESTED: u32 = 14;
/// The newest major version the version suite runs against.
pub(crate) const NEWEST_TESTED: u32 = 18;

/// The server's `server_version_num` (170010 for 17.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServerVersion(pub i32);

impl ServerVersion {
    pub async fn of(client: &Client) -> Result<ServerVersion, Error> {
        let num: String = client
            .query_one("SHOW server_version_num", &[])
            .await?
            .get(0);
        num.parse()
            .map(ServerVersion)
            .map_err(|_| Error::Decode(format!("server_version_num {num:?} is not a number")))
    }

    pub fn major(self) -> u32 {
        (self.0 / 10000) as u32
    }

    /// Slots that a physical standby keeps in sync (`failover` and `synced` in
    /// `pg_replication_slots`, the `failover` argument of `pg_create_logical_replication_slot`,
    /// `sync_replication_slots`, `synchronized_standby_slots`): 17 and later.
    pub fn has_failover_slots(self) -> bool {
        self.major() >= 17
    }

    /// `invalidation_reason` and `inactive_since` in `pg_replication_slots`: 17 and later
    /// (16 has only `conflicting`).
    pub(crate) fn has_invalidation_reason(self) -> bool {
        self.major() >= 17
    }

    /// `idle_replication_slot_timeout` (a slot unused that long is invalidated,
    /// `invalidation_reason = 'idle_timeout'`): 18 and later.
    pub(crate) fn has_idle_slot_timeout(self) -> bool {
        self.major() >= 18
    }
}

impl std::fmt::Display for ServerVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major(), self.0 % 100)
    }
}

/// The check line of the server's version against the tested range.
pub(crate) fn version_line(v: ServerVersion) -> CheckLine {
    let major = v.major();
    if major < OLDEST_TESTED {
        line(
            Level::Warn,
            "server version",
            format!("PostgreSQL {v}: older than the oldest tested ({OLDEST_TESTED})"),
            Some(format!("upgrade to PostgreSQL {OLDEST_TESTED} or later (docs/operations.md, supported versions)")),
        )
    } else if major > NEWEST_TESTED {
        line(
            Level::Warn,
            "server version",
            format!("PostgreSQL {v}: newer than the newest tested ({NEWEST_TESTED})"),
            Some("run the version suite against it before production (docs/testing.md, version suite)".into()),
        )
    } else {
        line(
            Level::Ok,
            "server version",
            format!(
                "PostgreSQL {v} (tested: {OLDEST_TESTED} to {NEWEST_TESTED}; pgoutput protocol 1)"
            ),
            None,
        )
    }
}

/// What 17 and later say of a slot beyond what every version says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotDetails {
    /// Why the slot was invalidated (`wal_removed`, `rows_removed`,
    /// `wal_level_insufficient`, 18's `idle_timeout`); `None` while it is usable.
    pub(crate) invalidation_reason: Option<String>,
    /// Since when no one has streamed from it.
    pub(crate) inactive_since: Option<String>,
    /// Created (or altered) to be synchronised to standbys.
    pub failover: bool,
    /// A standby's copy, synchronised from the primary (not usable until promotion).
    pub synced: bool,
}

/// The 17+ columns of slot `slot`; `None` below 17 or when there is no such slot.
pub async fn slot_details(
    client: &Client,
    v: ServerVersion,
    slot: &str,
) -> Result<Option<SlotDetails>, Error> {
    if !v.has_invalidation_reason() {
        return Ok(None);
    }
    let row = client
        .query_opt(
            "SELECT invalidation_reason, inactive_since::text, failover, synced
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotDetails {
        invalidation_reason: r.get(0),
        inactive_since: r.get(1),
        failover: r.get(2),
        synced: r.get(3),
    }))
}

/// The settings the version-dependent check lines read; each `None` where the server has no
/// such setting.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VersionSettings {
    /// `idle_replication_slot_timeout` in minutes (18+).
    pub(crate) idle_slot_timeout_min: Option<i64>,
    /// `synchronized_standby_slots` (17+).
    pub synchronized_standby_slots: Option<String>,
}

pub async fn settings(client: &Client, v: ServerVersion) -> Result<VersionSettings, Error> {
    let get = |name: &'static str| async move {
        Ok::<Option<String>, Error>(
            client
                .query_opt("SELECT setting FROM pg_settings WHERE name = $1", &[&name])
                .await?
                .map(|r| r.get(0)),
        )
    };
    Ok(VersionSettings {
        idle_slot_timeout_min: if v.has_idle_slot_timeout() {
            get("idle_replication_slot_timeout")
                .await?
                .and_then(|s| s.parse().ok())
        } else {
            None
        },
        synchronized_standby_slots: if v.has_failover_slots() {
            get("synchronized_standby_slots").await?
        } else {
            None
        },
    })
}

/// The check lines of the settings that exist only on some versions: 18's idle-slot
/// invalidation, and on 17+ a failover slot's need for `synchronized_standby_slots`.
pub(crate) fn settings_lines(
    v: ServerVersion,
    s: &VersionSettings,
    slot: &str,
    details: Option<&SlotDetails>,
) -> Vec<CheckLine> {
    let mut out = Vec::new();
    if let Some(min) = s.idle_slot_timeout_min {
        out.push(if min == 0 {
            line(
                Level::Ok,
                "idle_replication_slot_timeout",
                "0 (slots are not invalidated for being idle)",
                None,
            )
        } else {
            line(
                Level::Warn,
                "idle_replication_slot_timeout",
                format!("{min} min: a relay stopped longer loses its slot (invalidation_reason idle_timeout)"),
                Some("ALTER SYSTEM SET idle_replication_slot_timeout = 0; SELECT pg_reload_conf();  -- or run the relay with --on-position-lost poll".into()),
            )
        });
    }
    if let Some(d) = details.filter(|d| d.failover) {
        let standby_slots = s.synchronized_standby_slots.as_deref().unwrap_or("");
        out.push(if standby_slots.is_empty() {
            line(
                Level::Warn,
                "failover slot",
                format!("{slot} is a failover slot but synchronized_standby_slots is empty: the relay can be sent (and publish) a transaction a standby has not received, which a failover to that standby rolls back"),
                Some(format!("ALTER SYSTEM SET synchronized_standby_slots = {}; SELECT pg_reload_conf();  -- the standby's physical slot (its primary_slot_name); verify with `outboxd check --standby DSN`", pg_literal("STANDBY_SLOT"))),
            )
        } else {
            line(
                Level::Ok,
                "failover slot",
                format!(
                    "{slot} (failover, synced {}); the relay waits for standby slots {standby_slots}",
                    if d.synced { "yes" } else { "no" }
                ),
                None,
            )
        });
    } else if v.has_failover_slots() && details.is_some() {
        out.push(line(
            Level::Ok,
            "failover slot",
            format!("{slot} is not a failover slot: a promoted standby will not have it (recovery through the table, docs/operations.md)"),
            None,
        ));
    }
    out
}

/// `check --standby DSN`: the lines that say whether a failover to that physical standby keeps
/// the relay's slot (17+), reading the primary's settings on `primary` and the standby's on a
/// connection of its own.
pub(crate) async fn standby_lines(
    primary: &Client,
    standby: &crate::dsn::DbDsn,
    slot: &str,
) -> Vec<CheckLine> {
    let mut out = Vec::new();
    let sb = match super::connect_sql(standby, "outboxd_check").await {
        Ok(c) => c,
        Err(e) => {
            out.push(line(
                Level::Fail,
                "standby connect",
                e.to_string(),
                Some(format!(
                    "make the standby reachable at {}:{} for user {}",
                    standby.host, standby.port, standby.user
                )),
            ));
            return out;
        }
    };
    if let Err(e) = standby_checks(primary, &sb, slot, &mut out).await {
        out.push(line(Level::Fail, "standby query", e.to_string(), None));
    }
    out
}

async fn standby_checks(
    primary: &Client,
    sb: &Client,
    slot: &str,
    out: &mut Vec<CheckLine>,
) -> Result<(), Error> {
    let v = ServerVersion::of(sb).await?;
    let in_recovery: bool = sb
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await?
        .get(0);
    if !in_recovery {
        out.push(line(
            Level::Fail,
            "standby",
            format!("PostgreSQL {v}, not in recovery: this is a primary, not a standby"),
            Some("give --standby the DSN of the physical standby".into()),
        ));
        return Ok(());
    }
    if !v.has_failover_slots() {
        out.push(line(
            Level::Warn,
            "standby",
            format!("PostgreSQL {v} has no failover slots: a failover to it loses the relay's slot"),
            Some("run the relay with --on-position-lost poll (recovery through the table), or upgrade both servers to 17+ (docs/operations.md)".into()),
        ));
        return Ok(());
    }
    out.push(line(
        Level::Ok,
        "standby",
        format!("PostgreSQL {v}, in recovery"),
        None,
    ));
    for (name, fix) in [
        ("hot_standby_feedback", "ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf();  -- on the standby"),
        ("sync_replication_slots", "ALTER SYSTEM SET sync_replication_slots = on; SELECT pg_reload_conf();  -- on the standby"),
    ] {
        let value = setting(sb, name).await?;
        out.push(if value == "on" {
            line(Level::Ok, name, "on (standby)", None)
        } else {
            line(Level::Fail, name, format!("{value:?} on the standby, failover slots need on"), Some(fix.into()))
        });
    }
    if !setting(sb, "primary_conninfo").await?.contains("dbname") {
        out.push(line(
            Level::Fail,
            "primary_conninfo",
            "names no dbname on the standby: the slot sync worker cannot connect",
            Some("ALTER SYSTEM SET primary_conninfo = '… dbname=postgres'; SELECT pg_reload_conf();  -- on the standby".into()),
        ));
    }
    let standby_slot = setting(sb, "primary_slot_name").await?;
    if standby_slot.is_empty() {
        out.push(line(
            Level::Fail,
            "primary_slot_name",
            "empty on the standby: slot synchronisation needs a physical slot",
            Some("SELECT pg_create_physical_replication_slot('standby1');  -- on the primary; then on the standby: ALTER SYSTEM SET primary_slot_name = 'standby1'; SELECT pg_reload_conf();".into()),
        ));
        return Ok(());
    }
    let physical = primary
        .query_opt(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1 AND slot_type = 'physical'",
            &[&standby_slot],
        )
        .await?;
    out.push(match physical {
        Some(r) if r.get::<_, bool>(0) => line(
            Level::Ok,
            "primary_slot_name",
            format!("{standby_slot} (active on the primary)"),
            None,
        ),
        Some(_) => line(
            Level::Warn,
            "primary_slot_name",
            format!(
                "{standby_slot} exists on the primary but the standby is not streaming from it"
            ),
            Some("see the standby's log".into()),
        ),
        None => line(
            Level::Fail,
            "primary_slot_name",
            format!("{standby_slot} does not exist on the primary"),
            Some(format!(
                "SELECT pg_create_physical_replication_slot({});  -- on the primary",
                pg_literal(&standby_slot)
            )),
        ),
    });
    let listed = setting(primary, "synchronized_standby_slots").await?;
    out.push(if listed.split(',').any(|s| s.trim().trim_matches('"') == standby_slot) {
        line(Level::Ok, "synchronized_standby_slots", format!("{listed} (primary)"), None)
    } else {
        line(
            Level::Fail,
            "synchronized_standby_slots",
            format!("{listed:?} on the primary does not name {standby_slot}: the relay can publish what the standby has not received"),
            Some(format!("ALTER SYSTEM SET synchronized_standby_slots = {}; SELECT pg_reload_conf();  -- on the primary", pg_literal(&standby_slot))),
        )
    });
    let copy = standby_copy(sb, slot).await?;
    out.push(standby_slot_line(slot, copy.as_ref()));
    Ok(())
}

/// A standby's copy of the relay's failover slot (17+), as `pg_replication_slots` shows it
/// there.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct StandbyCopy {
    /// Kept in sync by the standby's slot sync worker.
    pub synced: bool,
    /// Still temporary: the worker has not yet been able to make it persistent (the primary's
    /// slot has not moved past the standby's catalog xmin). A promotion drops a temporary
    /// copy.
    pub temporary: bool,
    /// Why the copy was invalidated; `None` while it is usable.
    pub(crate) invalidation_reason: Option<String>,
}

impl StandbyCopy {
    /// PostgreSQL's own readiness test for a failover: the copy survives a promotion and the
    /// relay can stream from it.
    pub fn ready(&self) -> bool {
        self.synced && !self.temporary && self.invalidation_reason.is_none()
    }

    /// `synced yes, temporary no, invalidation_reason -`.
    pub fn describe(&self) -> String {
        let yes = |b: bool| if b { "yes" } else { "no" };
        format!(
            "synced {}, temporary {}, invalidation_reason {}",
            yes(self.synced),
            yes(self.temporary),
            self.invalidation_reason.as_deref().unwrap_or("-")
        )
    }
}

/// The standby's copy of `slot`; `None` when the standby has no slot of that name.
pub(crate) async fn standby_copy(sb: &Client, slot: &str) -> Result<Option<StandbyCopy>, Error> {
    let row = sb
        .query_opt(
            "SELECT synced, temporary, invalidation_reason FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| StandbyCopy {
        synced: r.get(0),
        temporary: r.get(1),
        invalidation_reason: r.get(2),
    }))
}

/// The `standby slot` line: ready only by PostgreSQL's own test (`synced AND NOT temporary AND
/// invalidation_reason IS NULL`). A copy that is synchronised but still temporary is dropped
/// by a promotion: the relay would then find no slot on the new primary.
pub(crate) fn standby_slot_line(slot: &str, copy: Option<&StandbyCopy>) -> CheckLine {
    const WAIT: &str = "keep the relay streaming and run `outboxd check --standby` again until this line says ready (the standby's log says \"could not synchronize replication slot\" until then); do not promote the standby before";
    match copy {
        Some(c) if c.ready() => line(
            Level::Ok,
            "standby slot",
            format!("{slot} ready for a failover on the standby ({})", c.describe()),
            None,
        ),
        Some(c) if c.invalidation_reason.is_some() => line(
            Level::Fail,
            "standby slot",
            format!("{slot} on the standby is invalidated ({}): a promotion leaves the relay without its slot", c.describe()),
            Some("drop the copy on the standby (SELECT pg_drop_replication_slot(...)) so the slot sync worker creates it again, then wait until this line says ready".into()),
        ),
        Some(c) if c.synced && c.temporary => line(
            Level::Fail,
            "standby slot",
            format!("{slot} is synchronised to the standby but not ready ({}): a promotion now drops the temporary copy", c.describe()),
            Some(WAIT.into()),
        ),
        Some(c) => line(
            Level::Fail,
            "standby slot",
            format!("{slot} on the standby is not a synchronised copy ({})", c.describe()),
            Some("create the relay's slot as a failover slot on the primary (`outboxd setup --failover-slot` before the first run); a slot of that name made on the standby itself is not synchronised".into()),
        ),
        None => line(
            Level::Fail,
            "standby slot",
            format!("{slot} is not synchronised to the standby"),
            Some("create it as a failover slot (`outboxd setup --failover-slot` before the first run), then wait for the standby's slot sync worker".into()),
        ),
    }
}

/// A setting as `pg_settings` shows it to this role (empty when it cannot see it).
async fn setting(c: &Client, name: &str) -> Result<String, Error> {
    Ok(
        c.query_opt("SELECT setting FROM pg_settings WHERE name = $1", &[&name])
            .await?
            .map(|r| r.get(0))
            .unwrap_or_default(),
    )
}

/// The SQL that creates the relay's slot: with `failover` (17+) a standby with
/// `sync_replication_slots = on` keeps a copy that the relay resumes from after a failover.
pub(crate) fn create_slot_sql(failover: bool) -> &'static str {
    if failover {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    }
}

/// The refusal of `--failover-slot` on a server without failover slots.
pub fn failover_refused(v: ServerVersion) -> Error {
    Error::config(
        format!("--failover-slot needs PostgreSQL 17 or later; this server is {v}"),
        "drop --failover-slot (after a failover the relay then recovers through the table: run it with --on-position-lost poll), or upgrade the server to 17+",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_and_features_follow_the_major() {
        let v = ServerVersion(170010);
        assert_eq!((v.major(), v.to_string()), (17, "17.10".to_string()));
        assert!(v.has_failover_slots() && v.has_invalidation_reason());
        assert!(!v.has_idle_slot_timeout());
        let v16 = ServerVersion(160014);
        assert!(!v16.has_failover_slots() && !v16.has_invalidation_reason());
        assert!(ServerVersion(180004).has_idle_slot_timeout());
    }

    #[test]
    fn the_version_line_warns_outside_the_tested_range() {
        assert_eq!(version_line(ServerVersion(140023)).level, Level::Ok);
        assert_eq!(version_line(ServerVersion(180004)).level, Level::Ok);
        let old = version_line(ServerVersion(130020));
        assert_eq!(old.level, Level::Warn);
        assert!(old.fix.unwrap().contains("upgrade to PostgreSQL 14"));
        assert_eq!(version_line(ServerVersion(190000)).level, Level::Warn);
    }

    #[test]
    fn an_idle_timeout_and_a_failover_slot_without_standby_slots_are_warned() {
        let v = ServerVersion(180004);
        let s = VersionSettings {
            idle_slot_timeout_min: Some(30),
            synchronized_standby_slots: Some(String::new()),
        };
        let d = SlotDetails {
            failover: true,
            ..Default::default()
        };
        let lines = settings_lines(v, &s, "outboxd_r", Some(&d));
        assert_eq!(lines.len(), 2);
        assert!(lines
            .iter()
            .all(|l| l.level == Level::Warn && l.fix.is_some()));
        assert!(lines[0]
            .fix
            .as_ref()
            .unwrap()
            .contains("idle_replication_slot_timeout = 0"));
        assert!(lines[1]
            .fix
            .as_ref()
            .unwrap()
            .contains("synchronized_standby_slots"));

        let fine = VersionSettings {
            idle_slot_timeout_min: Some(0),
            synchronized_standby_slots: Some("sb1".into()),
        };
        let lines = settings_lines(v, &fine, "outboxd_r", Some(&d));
        assert!(lines.iter().all(|l| l.level == Level::Ok), "{lines:?}");
        // Below 17 neither line exists.
        assert!(settings_lines(
            ServerVersion(160014),
            &VersionSettings::default(),
            "s",
            None
        )
        .is_empty());
    }

    #[test]
    fn a_standby_copy_is_ready_only_when_synced_persistent_and_valid() {
        let ready = StandbyCopy {
            synced: true,
            ..Default::default()
        };
        assert!(ready.ready());
        assert_eq!(standby_slot_line("s", Some(&ready)).level, Level::Ok);
        // Right after `setup --failover-slot`: synchronised, but still temporary.
        let temporary = StandbyCopy {
            synced: true,
            temporary: true,
            invalidation_reason: None,
        };
        assert!(!temporary.ready());
        let l = standby_slot_line("s", Some(&temporary));
        assert_eq!(l.level, Level::Fail);
        assert!(l.detail.contains("temporary yes"), "{}", l.detail);
        assert!(l.fix.unwrap().contains("until this line says ready"));
        let invalid = StandbyCopy {
            invalidation_reason: Some("rows_removed".into()),
            ..ready.clone()
        };
        assert!(!invalid.ready());
        assert!(standby_slot_line("s", Some(&invalid))
            .detail
            .contains("rows_removed"));
        let local = StandbyCopy::default();
        assert_eq!(standby_slot_line("s", Some(&local)).level, Level::Fail);
        assert_eq!(standby_slot_line("s", None).level, Level::Fail);
    }

    #[test]
    fn the_slot_is_created_with_failover_only_when_asked() {
        assert!(create_slot_sql(true).contains("false, false, true"));
        assert!(!create_slot_sql(false).contains("true"));
        let e = failover_refused(ServerVersion(160014)).to_string();
        assert!(e.contains("17 or later") && e.contains("16.14"), "{e}");
    }
}
