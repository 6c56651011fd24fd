//! The JetStream stream the sink publishes into: created under `--declare auto` when it is
//! missing (file storage, the duplicate window that makes a restart duplicate-free, subjects
//! `<prefix>.>`), checked under `passive`, and described by `outboxd check` with what to
//! change. An existing stream is never edited: its settings are the operator's.

use super::config::{self, NatsConfig, DUPLICATE_WINDOW};
use crate::operator::{CheckLine, Level};
use crate::sink::rabbitmq::DeclareMode;
use crate::sink::SinkError;
use async_nats::jetstream::context::{Context, GetStreamErrorKind};
use async_nats::jetstream::stream::{self, DiscardPolicy, StorageType};
use async_nats::jetstream::ErrorCode;

fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> SinkError {
    SinkError::Config {
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// The subject filter the stream must cover: every subject the relay publishes to
/// (events, partitions, dead records) starts with the template's prefix.
pub fn stream_filter(cfg: &NatsConfig) -> Result<String, SinkError> {
    let prefix = config::subject_prefix(&cfg.subject)
        .map_err(|e| config_err(e.to_string(), "fix --subject"))?;
    Ok(format!("{prefix}.>"))
}

/// Whether subject filter `filter` matches every subject `pattern` matches (both may hold
/// `*` and a final `>`).
pub fn covers(filter: &str, pattern: &str) -> bool {
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
pub fn desired(cfg: &NatsConfig) -> Result<stream::Config, SinkError> {
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
pub async fn lookup(js: &Context, name: &str) -> Result<Option<stream::Info>, SinkError> {
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

/// What is wrong with an existing stream for this relay (a failure), if anything.
pub fn mismatch(cfg: &NatsConfig, info: &stream::Info) -> Result<Option<String>, SinkError> {
    let want = stream_filter(cfg)?;
    if !info.config.subjects.iter().any(|s| covers(s, &want)) {
        return Ok(Some(format!(
            "stream {} captures {:?}, which does not cover {want}: the relay's messages would find no stream",
            cfg.stream, info.config.subjects
        )));
    }
    if info.config.sealed {
        return Ok(Some(format!(
            "stream {} is sealed: it takes no messages",
            cfg.stream
        )));
    }
    Ok(None)
}

/// Settings that weaken a guarantee without stopping the relay: warnings with fixes.
pub fn weaknesses(cfg: &NatsConfig, info: &stream::Info) -> Vec<(String, String)> {
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
        && (info.config.max_bytes > 0
            || info.config.max_messages > 0
            || !info.config.max_age.is_zero())
    {
        out.push((
            "discard old with a limit: when the stream is full, the oldest events are deleted whether consumed or not".into(),
            format!("nats stream edit {s} --discard new (the relay then waits, with backoff, until there is room)"),
        ));
    }
    out
}

/// Makes sure the stream exists as `--declare` says. Returns warnings about weak settings.
pub async fn ensure(js: &Context, cfg: &NatsConfig) -> Result<Vec<String>, SinkError> {
    if cfg.declare == DeclareMode::Off {
        return Ok(Vec::new());
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
    if let Some(problem) = mismatch(cfg, &info)? {
        return Err(config_err(
            problem,
            format!(
                "add the subjects: nats stream edit {} --subjects '{}' (keeping the ones it has), or use another --stream/--subject",
                cfg.stream,
                stream_filter(cfg)?
            ),
        ));
    }
    let warnings: Vec<String> = weaknesses(cfg, &info)
        .into_iter()
        .map(|(w, fix)| {
            tracing::warn!(stream = %cfg.stream, fix = %fix, "{w}");
            w
        })
        .collect();
    Ok(warnings)
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
pub fn describe(info: &stream::Info) -> String {
    let c = &info.config;
    let limit = |v: i64| {
        if v <= 0 {
            "unlimited".to_string()
        } else {
            v.to_string()
        }
    };
    format!(
        "subjects {:?}, storage {:?}, duplicate window {:?}, retention {:?}, discard {:?}, max_bytes {}, max_msgs {}, max_age {:?}, replicas {}; holds {} messages ({} bytes)",
        c.subjects,
        c.storage,
        c.duplicate_window,
        c.retention,
        c.discard,
        limit(c.max_bytes),
        limit(c.max_messages),
        c.max_age,
        c.num_replicas,
        info.state.messages,
        info.state.bytes
    )
    .to_lowercase()
}

/// `outboxd check` for a NATS sink: the connection, JetStream, and the stream's settings.
pub async fn check(cfg: &NatsConfig) -> Vec<CheckLine> {
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
                Ok(Some(problem)) => out.push(line(
                    Level::Fail,
                    &name,
                    format!("{detail}. {problem}"),
                    Some(format!(
                        "nats stream edit {} --subjects '{}' (keeping the ones it has)",
                        cfg.stream,
                        stream_filter(cfg).unwrap_or_default()
                    )),
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
