//! The JetStream stream the sink publishes into: created under `--declare auto` when it is
//! missing (file storage, the duplicate window that makes a restart duplicate-free, subjects
//! `<prefix>.>`), checked under `passive`, and described by `outboxd check` with what to
//! change. An existing stream is never edited: its settings are the operator's.

use super::config::{self, NatsConfig, DUPLICATE_WINDOW};
use crate::diagnostics::{CheckLine, Level};
use crate::sink::DeclareMode;
use crate::sink::SinkError;
use async_nats::jetstream::context::{Context, GetStreamErrorKind};
use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::ErrorCode;

fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> SinkError {
    SinkError::Config {
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// The subject filter the stream must cover: every subject the relay publishes to
/// (events, partitions, dead records) starts with the template's prefix.
pub(crate) fn stream_filter(cfg: &NatsConfig) -> Result<String, SinkError> {
    let prefix = config::subject_prefix(&cfg.subject)
        .map_err(|e| config_err(e.to_string(), "fix --subject"))?;
    Ok(format!("{prefix}.>"))
}

/// Whether subject filter `filter` matches every subject `pattern` matches (both may hold
/// `*` and a final `>`).
pub(crate) fn covers(filter: &str, pattern: &str) -> bool {
    let f: Vec<&str> = filter.split('.').collect();
    let p: Vec<&str> = pattern.split('.').collect();
    for (i, ft) in f.iter().enumerate() {
        if *ft == ">" {
            return i < p.len();
        }
        let Some(pt) = p.get(i) else { return false };
        match (*ft, *pt) {
            (_, ">") => return false,
            ("*", _) => {}
            (a, b) if a == b => {}
            _ => return false,
        }
    }
    f.len() == p.len()
}

/// The configuration a declared stream gets.
pub(crate) fn desired(cfg: &NatsConfig) -> Result<stream::Config, SinkError> {
    Ok(stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![stream_filter(cfg)?],
        storage: StorageType::File,
        duplicate_window: DUPLICATE_WINDOW,
        description: Some("outbox events published by outboxd".into()),
        ..Default::default()
    })
}

/// The stream as it is, or `None` when it does not exist.
pub(crate) async fn lookup(js: &Context, name: &str) -> Result<Option<stream::Info>, SinkError> {
    match js.get_stream(name).await {
        Ok(s) => Ok(Some(s.cached_info().clone())),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND => {
                Ok(None)
            }
            GetStreamErrorKind::JetStream(j)
                if j.error_code() == ErrorCode::JETSTREAM_NOT_ENABLED
                    || j.error_code() == ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT =>
            {
                Err(no_jetstream(&e.to_string()))
            }
            GetStreamErrorKind::Request => {
                let text = e.to_string();
                if text.contains("no responders") {
                    Err(no_jetstream(&text))
                } else {
                    Err(SinkError::Connection(format!(
                        "asking NATS for stream {name}: {text}"
                    )))
                }
            }
            _ => Err(SinkError::Connection(format!(
                "asking NATS for stream {name}: {e}"
            ))),
        },
    }
}

fn no_jetstream(text: &str) -> SinkError {
    config_err(
        format!("the NATS server does not answer JetStream requests ({text})"),
        "enable JetStream: start nats-server with -js (and a store directory, -sd /var/lib/nats-server), or enable it for the account",
    )
}

/// What is wrong with an existing stream for this relay (a failure), if anything, and the fix.
pub(crate) fn mismatch(
    cfg: &NatsConfig,
    info: &stream::Info,
) -> Result<Option<(String, String)>, SinkError> {
    let want = stream_filter(cfg)?;
    let s = &cfg.stream;
    if !info.config.subjects.iter().any(|sub| covers(sub, &want)) {
        return Ok(Some((
            format!(
                "stream {s} captures {:?}, which does not cover {want}: the relay's messages would find no stream",
                info.config.subjects
            ),
            format!("add the subjects: nats stream edit {s} --subjects '{want}' (keeping the ones it has), or use another --stream/--subject"),
        )));
    }
    if info.config.sealed {
        return Ok(Some((
            format!("stream {s} is sealed: it takes no messages"),
            format!(
                "use another --stream, or delete {s} and let the relay declare it (--declare auto)"
            ),
        )));
    }
    if info.config.retention == RetentionPolicy::Interest && info.state.consumer_count == 0 {
        // JetStream acknowledges each message and deletes it at once: nobody is interested.
        return Ok(Some((
            format!("stream {s} has interest retention and no consumer: every event would be deleted as soon as it is stored"),
            format!("recreate it with --retention limits (nats stream rm {s}; nats stream add {s} --subjects '{want}' --storage file --retention limits --dupe-window 2m), or create its consumers before the relay publishes"),
        )));
    }
    Ok(None)
}

/// A duration as an operator writes it (`90s`, `10m`, `1h`, `7d`).
fn short(d: std::time::Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{d:?}"),
        s if s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

/// Settings that weaken a guarantee without stopping the relay: warnings with fixes.
pub(crate) fn weaknesses(cfg: &NatsConfig, info: &stream::Info) -> Vec<(String, String)> {
    let s = &cfg.stream;
    let mut out = Vec::new();
    if info.config.duplicate_window < DUPLICATE_WINDOW {
        out.push((
            format!(
                "duplicate window {:?} is shorter than {:?}: a relay that restarts later than that after its last acknowledged event can leave duplicates",
                info.config.duplicate_window, DUPLICATE_WINDOW
            ),
            format!("nats stream edit {s} --dupe-window 2m (or longer)"),
        ));
    }
    if info.config.storage != StorageType::File {
        out.push((
            "memory storage: a server restart loses the stream's messages".into(),
            format!("recreate {s} with file storage (nats stream add {s} --storage file …), or let outboxd declare it: delete it and run with --declare auto"),
        ));
    }
    if info.config.discard == DiscardPolicy::Old
        && (info.config.max_bytes > 0 || info.config.max_messages > 0)
    {
        out.push((
            "discard old with a limit: when the stream is full, the oldest events are deleted whether consumed or not".into(),
            format!("nats stream edit {s} --discard new (the relay then waits, with backoff, until there is room)"),
        ));
    }
    if !info.config.max_age.is_zero() {
        // Whatever the discard policy: an age limit is not a size limit.
        out.push((
            format!(
                "max_age: events older than {} are deleted whether consumed or not",
                short(info.config.max_age)
            ),
            format!("nats stream edit {s} --max-age=0, or an age longer than any consumer can fall behind"),
        ));
    }
    if info.config.max_messages_per_subject > 0 {
        let n = info.config.max_messages_per_subject;
        out.push((
            format!(
                "max_msgs_per_subject: the stream keeps only the last {n} message{} of each subject, so older events of a topic are deleted whether consumed or not",
                if n == 1 { "" } else { "s" }
            ),
            format!("nats stream edit {s} --max-msgs-per-subject=-1"),
        ));
    }
    match info.config.retention {
        RetentionPolicy::Limits => {}
        // Without a consumer this is a failure (`mismatch`); with one, a later consumer misses out.
        RetentionPolicy::Interest => out.push((
            "interest retention: an event is deleted once the consumers that existed when it was stored acknowledged it; a consumer added later never sees it, and nothing can be read again".into(),
            format!("recreate {s} with --retention limits (and an age or size limit with --discard new) unless that is what you want"),
        )),
        RetentionPolicy::WorkQueue => out.push((
            "work-queue retention: the first consumer's acknowledgement deletes an event, so no second consumer ever sees it, and nothing can be read again".into(),
            format!("recreate {s} with --retention limits unless exactly one consumer reads it"),
        )),
    }
    out
}

/// Makes sure the stream exists as `--declare` says, logs a warning for each weak setting, and
/// returns the stream as it is (under `--declare off`, when it can be read), whose limits the
/// sink applies to each message.
pub(crate) async fn ensure(
    js: &Context,
    cfg: &NatsConfig,
) -> Result<Option<stream::Info>, SinkError> {
    if cfg.declare == DeclareMode::Off {
        // Neither created nor checked; its limits still make an event it can never take a
        // dead record rather than a refusal retried forever.
        return Ok(lookup(js, &cfg.stream).await.ok().flatten());
    }
    let info = match lookup(js, &cfg.stream).await? {
        Some(info) => info,
        None if cfg.declare == DeclareMode::Passive => {
            return Err(config_err(
                format!("JetStream stream {} does not exist (--declare passive only checks)", cfg.stream),
                format!(
                    "create it: nats stream add {} --subjects '{}' --storage file --dupe-window 2m; or run with --declare auto",
                    cfg.stream,
                    stream_filter(cfg)?
                ),
            ))
        }
        None => {
            let want = desired(cfg)?;
            match js.create_stream(want).await {
                Ok(s) => {
                    tracing::info!(stream = %cfg.stream, subjects = ?s.cached_info().config.subjects, "declared the JetStream stream");
                    s.cached_info().clone()
                }
                Err(e) => {
                    let text = e.to_string();
                    return Err(if text.contains("overlap") {
                        config_err(
                            format!("cannot create JetStream stream {}: {text}", cfg.stream),
                            format!("another stream already captures {}: name it with --stream, or change --subject", stream_filter(cfg)?),
                        )
                    } else if text.contains("not enabled") || text.contains("no responders") {
                        no_jetstream(&text)
                    } else {
                        SinkError::Connection(format!("creating JetStream stream {}: {text}", cfg.stream))
                    });
                }
            }
        }
    };
    if let Some((problem, fix)) = mismatch(cfg, &info)? {
        return Err(config_err(problem, fix));
    }
    for (w, fix) in weaknesses(cfg, &info) {
        tracing::warn!(stream = %cfg.stream, fix = %fix, "{w}");
    }
    Ok(Some(info))
}

fn line(level: Level, check: &str, detail: impl Into<String>, fix: Option<String>) -> CheckLine {
    CheckLine {
        level,
        check: check.into(),
        detail: detail.into(),
        fix,
    }
}

/// One line describing the stream's settings.
pub(crate) fn describe(info: &stream::Info) -> String {
    let c = &info.config;
    let limit = |v: i64| {
        if v <= 0 {
            "unlimited".to_string()
        } else {
            v.to_string()
        }
    };
    format!(
        "subjects {:?}, storage {:?}, duplicate window {:?}, retention {:?}, discard {:?}, max_bytes {}, max_msgs {}, max_msgs_per_subject {}, max_msg_size {}, max_age {:?}, replicas {}; {} consumers; holds {} messages ({} bytes)",
        c.subjects,
        c.storage,
        c.duplicate_window,
        c.retention,
        c.discard,
        limit(c.max_bytes),
        limit(c.max_messages),
        limit(c.max_messages_per_subject),
        limit(c.max_message_size.into()),
        c.max_age,
        c.num_replicas,
        info.state.consumer_count,
        info.state.messages,
        info.state.bytes
    )
    .to_lowercase()
}

/// `outboxd check` for a NATS sink: the connection, JetStream, and the stream's settings.
pub(crate) async fn check(cfg: &NatsConfig) -> Vec<CheckLine> {
    let mut out = Vec::new();
    let client = match super::connect::connect(cfg).await {
        Ok(c) => {
            let info = c.server_info();
            out.push(line(
                Level::Ok,
                "nats connect",
                format!(
                    "connected to nats-server {} (max_payload {} bytes)",
                    info.version, info.max_payload
                ),
                None,
            ));
            c
        }
        Err(e) => {
            let (detail, fix) = split(&e);
            out.push(line(Level::Fail, "nats connect", detail, fix));
            return out;
        }
    };
    let js = async_nats::jetstream::new(client);
    let name = format!("nats stream {}", cfg.stream);
    match lookup(&js, &cfg.stream).await {
        Ok(None) => {
            let filter = stream_filter(cfg).unwrap_or_default();
            let (level, fix) = if cfg.declare == DeclareMode::Auto {
                (Level::Warn, format!("none needed: the relay declares it (--declare auto) with subjects {filter}, file storage and a 2m duplicate window"))
            } else {
                (Level::Fail, format!("nats stream add {} --subjects '{filter}' --storage file --dupe-window 2m, or run with --declare auto", cfg.stream))
            };
            out.push(line(level, &name, "does not exist", Some(fix)));
        }
        Ok(Some(info)) => {
            let detail = describe(&info);
            match mismatch(cfg, &info) {
                Ok(Some((problem, fix))) => out.push(line(
                    Level::Fail,
                    &name,
                    format!("{detail}. {problem}"),
                    Some(fix),
                )),
                Ok(None) => {
                    let weak = weaknesses(cfg, &info);
                    if weak.is_empty() {
                        out.push(line(Level::Ok, &name, detail, None));
                    } else {
                        let (problems, fixes): (Vec<String>, Vec<String>) =
                            weak.into_iter().unzip();
                        out.push(line(
                            Level::Warn,
                            &name,
                            format!("{detail}. {}", problems.join("; ")),
                            Some(fixes.join("; ")),
                        ));
                    }
                }
                Err(e) => out.push(line(Level::Fail, &name, e.to_string(), None)),
            }
        }
        Err(e) => {
            let (detail, fix) = split(&e);
            out.push(line(Level::Fail, &name, detail, fix));
        }
    }
    out
}

fn split(e: &SinkError) -> (String, Option<String>) {
    match e {
        SinkError::Config { problem, fix } => (problem.clone(), Some(fix.clone())),
        other => (
            other.to_string(),
            Some(
                "check the host and port of --sink and that nats-server runs with JetStream (-js)"
                    .into(),
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::covers;

    #[test]
    fn subject_filters_cover_patterns() {
        assert!(covers("outbox.>", "outbox.>"));
        assert!(covers(">", "outbox.>"));
        assert!(covers("*.>", "outbox.>"));
        assert!(!covers("outbox.*", "outbox.>"));
        assert!(!covers("outbox.orders.>", "outbox.>"));
        assert!(!covers("other.>", "outbox.>"));
        assert!(covers("outbox.*", "outbox.x"));
        assert!(!covers("outbox", "outbox.>"));
    }
}
