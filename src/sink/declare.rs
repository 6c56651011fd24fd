//! `--declare`: whether a sink creates what it publishes into (exchanges and queues, a
//! JetStream stream, Kafka topics, RabbitMQ streams), only checks it exists, or assumes it.
//! One idea every broker sink shares, so it lives beside them rather than inside one.

/// How a sink treats its destination's topology (`--declare`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeclareMode {
    /// Declare exchanges, queues and the binding (idempotent; needs configure permission).
    #[default]
    Auto,
    /// Only check that they exist (for users without configure permission).
    Passive,
    /// Assume they exist; check nothing.
    Off,
}

impl DeclareMode {
    /// The flag's spelling (`--declare auto`), for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            DeclareMode::Auto => "auto",
            DeclareMode::Passive => "passive",
            DeclareMode::Off => "off",
        }
    }
}
