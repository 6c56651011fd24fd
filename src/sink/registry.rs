//! The sink registry: what the rest of the relay knows about a sink, in one [`Descriptor`] per
//! sink (its `--sink` schemes, how it is built, what `outboxd check` probes, the columns it
//! reads, the flags it ignores, the secret its URL carries), and the one list of sinks
//! ([`sinks!`], invoked in `sink/mod.rs`) that the sink kind, the dispatching `AnySink`, the
//! per-sink settings and the per-sink flags are all generated from. Nothing outside the sink's
//! own folder and that list names a sink, so a sink behind a feature that is off leaves no
//! trace in the build, and a new sink the list names cannot forget a part: a missing
//! descriptor field, options or flags type does not compile.
//!
//! `run` and `check` build a sink's settings through the same code
//! (`commands::sink::SinkArgs`, then the descriptor's `build` or `check`).

use super::options::{SinkContext, SinkOptions};
use super::{AnySink, SinkKind};
use crate::diagnostics::CheckLine;
use crate::dsn::redact;
use crate::Error;
use futures::future::LocalBoxFuture;
use std::fmt;

/// One sink, as the registry knows it. Every field is a plain value or function, so a
/// descriptor is a `const` in its sink's folder.
pub struct Descriptor {
    pub kind: SinkKind,
    /// The sink's name in logs, metrics and check lines (`rabbitmq`): its `Sink::name`.
    pub name: &'static str,
    /// The words that name it as a whole `--sink` (`stdout`, `-`).
    pub words: &'static [&'static str],
    /// The URL schemes that name it (`amqp`, `amqps`), compared without case.
    pub schemes: &'static [&'static str],
    /// A `--sink` of this kind, for error messages.
    pub example: &'static str,
    /// Whether the sink address is a URL (`Url` must parse it); a Kafka address lists several
    /// brokers, which is no URL, and is parsed by its sink.
    pub is_url: bool,
    /// Builds the sink. Nothing connects; a bad setting or an unreadable TLS file is reported
    /// here, before the relay creates a replication slot or takes a lease.
    pub build: fn(&SinkDsn, &SinkOptions, &SinkContext<'_>) -> Result<AnySink, Error>,
    /// `outboxd check`: connects and probes what `run` would use, one line per check; never
    /// stops at the first failure. Built from the same settings as [`Descriptor::build`].
    pub check: for<'a> fn(
        &'a SinkDsn,
        &'a SinkOptions,
        &'a SinkContext<'a>,
    ) -> LocalBoxFuture<'a, Vec<CheckLine>>,
    /// Columns of the outbox row the sink reads beyond the message options' (the Kafka
    /// partition column), so `run` maps them and `check` checks the table has them.
    pub columns: fn(&SinkOptions) -> Result<Vec<String>, Error>,
    /// A warning for settings given that this sink ignores (`--partitions` on stdout), logged
    /// once before the relay starts.
    pub ignored: fn(&SinkOptions) -> Option<&'static str>,
    /// The password its address carries, if any.
    pub password: fn(&str) -> Option<String>,
}

/// [`Descriptor::check`] of a sink with nothing to probe.
pub(crate) fn no_check<'a>(
    _: &'a SinkDsn,
    _: &'a SinkOptions,
    _: &'a SinkContext<'a>,
) -> LocalBoxFuture<'a, Vec<CheckLine>> {
    Box::pin(async { Vec::new() })
}

/// [`Descriptor::columns`] of a sink that reads no column of its own.
pub(crate) fn no_columns(_: &SinkOptions) -> Result<Vec<String>, Error> {
    Ok(Vec::new())
}

/// [`Descriptor::ignored`] of a sink that reads every setting it is given.
pub(crate) fn ignores_nothing(_: &SinkOptions) -> Option<&'static str> {
    None
}

/// [`Descriptor::password`] of a sink whose address is a URL.
pub(crate) fn url_password(url: &str) -> Option<String> {
    url::Url::parse(url)
        .ok()
        .and_then(|u| u.password().map(str::to_string))
}

/// A `--sink`: which sink, and its address as given (kept whole for the sink's own parser: it
/// carries the vhost, the options and the credentials). `Debug` redacts the password.
#[derive(Clone, PartialEq, Eq)]
pub struct SinkDsn {
    kind: SinkKind,
    url: String,
}

impl fmt::Debug for SinkDsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SinkDsn({}, {})",
            self.descriptor().name,
            redact(&self.url)
        )
    }
}

impl SinkDsn {
    /// Reads `--sink`: a word (`stdout`) or a URL whose scheme names a sink of this build.
    pub fn parse(s: &str) -> Result<SinkDsn, Error> {
        let s = s.trim();
        let found = |kind: SinkKind| {
            Ok(SinkDsn {
                kind,
                url: s.to_string(),
            })
        };
        let scheme = s
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase());
        for kind in SinkKind::all() {
            let d = kind.descriptor();
            if d.words.contains(&s) {
                return found(kind);
            }
            // An address that is no URL (several brokers) is recognised by its scheme alone.
            if !d.is_url && scheme.as_deref().is_some_and(|sc| d.schemes.contains(&sc)) {
                return found(kind);
            }
        }
        let url = url::Url::parse(s).map_err(|e| {
            Error::config(
                format!("cannot parse the sink {}: {e}", redact(s)),
                format!(
                    "use {}",
                    either(SinkKind::all().iter().map(|k| k.descriptor().example))
                ),
            )
        })?;
        match SinkKind::all()
            .into_iter()
            .find(|k| k.descriptor().schemes.contains(&url.scheme()))
        {
            Some(kind) => found(kind),
            None => Err(Error::config(
                format!("unsupported sink scheme {:?}", url.scheme()),
                format!(
                    "use {}",
                    either(SinkKind::all().iter().flat_map(|k| {
                        let d = k.descriptor();
                        d.words
                            .iter()
                            .take(1)
                            .map(|w| w.to_string())
                            .chain(d.schemes.iter().map(|s| format!("{s}://")))
                    }))
                ),
            )),
        }
    }

    /// The stdout sink (`--sink stdout`, the default).
    pub fn stdout() -> SinkDsn {
        SinkDsn {
            kind: SinkKind::Stdout,
            url: "stdout".into(),
        }
    }

    pub fn kind(&self) -> SinkKind {
        self.kind
    }

    pub fn descriptor(&self) -> &'static Descriptor {
        self.kind.descriptor()
    }

    /// The address as given, password included: never log it unredacted.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The password the address carries.
    pub fn password(&self) -> Option<String> {
        (self.descriptor().password)(&self.url)
    }
}

/// `a, b, c or d`.
fn either<S: fmt::Display>(items: impl Iterator<Item = S>) -> String {
    let items: Vec<String> = items.map(|i| i.to_string()).collect();
    match items.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Declares the sinks of this build (in `sink/mod.rs`, one line each:
/// `#[cfg(feature = "…")] Variant => module::SinkType`). Each module provides `DESCRIPTOR`
/// (a [`Descriptor`]), `Options` (its own settings, `Default`) and, with the `cli` feature,
/// `Flags` (its own `clap::Args`, with `fn options(&self) -> Result<Options, Error>`). From the
/// list this generates [`SinkKind`], `AnySink` (the `Sink` that dispatches to each), `PerSink`
/// (every sink's `Options`, in `SinkOptions::sinks`) and `SinkFlags` (every sink's `Flags`,
/// flattened into the command line's `SinkArgs`).
macro_rules! sinks {
    ($( $(#[$cfg:meta])* $variant:ident => $module:ident :: $sink:ident ),+ $(,)?) => {
        /// Which sink `--sink` names: one variant per sink compiled into this build.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum SinkKind {
            $( $(#[$cfg])* $variant, )+
        }

        impl SinkKind {
            /// Every sink of this build, in the registry's order.
            // One push per sink of the list, each under its feature: no literal to start from.
            #[allow(clippy::vec_init_then_push)]
            pub fn all() -> Vec<SinkKind> {
                let mut all = Vec::new();
                $( $(#[$cfg])* all.push(SinkKind::$variant); )+
                all
            }

            pub fn descriptor(self) -> &'static $crate::sink::registry::Descriptor {
                match self {
                    $( $(#[$cfg])* SinkKind::$variant => &$module::DESCRIPTOR, )+
                }
            }
        }

        /// The sink chosen on the command line. Dispatching here keeps the relay generic and
        /// the pipeline free of one copy of its wiring per sink.
        pub enum AnySink {
            $( $(#[$cfg])* $variant(Box<$module::$sink>), )+
        }

        impl Sink for AnySink {
            fn name(&self) -> &'static str {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.name(), )+ }
            }

            fn stores_position(&self) -> bool {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.stores_position(), )+ }
            }

            async fn connect(&mut self) -> Result<(), SinkError> {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.connect().await, )+ }
            }

            async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.publish(event).await, )+ }
            }

            async fn flush(&mut self) -> Result<(), SinkError> {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.flush().await, )+ }
            }

            fn guard_wire(&mut self, fence: $crate::state::Fence) {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.guard_wire(fence), )+ }
            }

            fn is_broken(&self) -> bool {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.is_broken(), )+ }
            }

            fn set_origin(&mut self, origin: &$crate::identity::Origin) {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.set_origin(origin), )+ }
            }

            fn flow_control(&self) -> Option<Arc<FlowControl>> {
                match self { $( $(#[$cfg])* AnySink::$variant(s) => s.flow_control(), )+ }
            }
        }

        /// Each sink's own settings (`SinkOptions::sinks`), by its module's name.
        #[derive(Debug, Clone, Default)]
        pub struct PerSink {
            $( $(#[$cfg])* pub $module: $module::Options, )+
        }

        /// Each sink's own flags, by its module's name (flattened into `run` and `check`).
        #[cfg(feature = "cli")]
        #[derive(Debug, Clone, clap::Args)]
        pub struct SinkFlags {
            $( $(#[$cfg])* #[command(flatten)] pub $module: $module::Flags, )+
        }

        #[cfg(feature = "cli")]
        impl SinkFlags {
            /// Every sink's settings from its flags.
            pub fn options(&self) -> Result<PerSink, $crate::Error> {
                Ok(PerSink {
                    $( $(#[$cfg])* $module: self.$module.options()?, )+
                })
            }
        }
    };
}
pub(crate) use sinks;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_names_its_sink_and_others_are_refused() {
        assert_eq!(SinkDsn::parse("stdout").unwrap().kind(), SinkKind::Stdout);
        assert_eq!(
            SinkDsn::parse(" - ").unwrap(),
            SinkDsn::parse("stdout").unwrap().with_url("-")
        );
        for kind in SinkKind::all() {
            let d = kind.descriptor();
            assert_eq!(d.kind, kind, "{} is registered as another kind", d.name);
            assert_eq!(
                SinkDsn::parse(d.example).unwrap().kind(),
                kind,
                "{}",
                d.example
            );
            for scheme in d.schemes {
                let dsn = SinkDsn::parse(&format!("{scheme}://u@host:1234")).unwrap();
                assert_eq!(dsn.kind(), kind, "{scheme}");
            }
        }
        let err = SinkDsn::parse("redis://x").unwrap_err().to_string();
        assert!(err.contains("unsupported sink scheme \"redis\""), "{err}");
        assert!(err.contains("use stdout, "), "{err}");
        let err = SinkDsn::parse("not a url").unwrap_err().to_string();
        assert!(err.contains("cannot parse the sink"), "{err}");
    }

    #[test]
    fn the_sink_address_debugs_without_its_password() {
        #[cfg(feature = "nats")]
        {
            let sink = SinkDsn::parse("nats://Sup3rS3cret@nats:4222").unwrap();
            assert!(!format!("{sink:?}").contains("Sup3rS3cret"));
        }
        #[cfg(feature = "kafka")]
        {
            let sink = SinkDsn::parse("kafka://k1:9092,k2:9092").unwrap();
            assert_eq!(sink.kind(), SinkKind::Kafka);
            assert_eq!(sink.url(), "kafka://k1:9092,k2:9092");
            let sink = SinkDsn::parse("kafka://u:Sup3rS3cret@k1:9092,k2:9092").unwrap();
            assert_eq!(sink.password().as_deref(), Some("Sup3rS3cret"));
            assert!(!format!("{sink:?}").contains("Sup3rS3cret"));
        }
        #[cfg(feature = "rabbitmq")]
        {
            let sink = SinkDsn::parse("amqp://relay:Sup3rS3cret@mq/%2f").unwrap();
            assert_eq!(sink.password().as_deref(), Some("Sup3rS3cret"));
        }
        assert_eq!(SinkDsn::stdout().password(), None);
    }

    impl SinkDsn {
        fn with_url(mut self, url: &str) -> SinkDsn {
            self.url = url.into();
            self
        }
    }
}
