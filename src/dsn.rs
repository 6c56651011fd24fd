//! Connection strings: parsing the source and sink DSNs (docs/configuration.md), and rendering them
//! with the password redacted, so no log line, error or `--help` ever shows a secret.

use crate::Error;
use std::fmt;
use url::Url;

/// TLS verification level, as libpq's `sslmode` (MySQL's `ssl-mode` maps onto it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl TlsMode {
    fn parse(v: &str) -> Result<TlsMode, Error> {
        Ok(match v.to_ascii_lowercase().replace('_', "-").as_str() {
            "disable" | "disabled" => TlsMode::Disable,
            "allow" | "prefer" | "preferred" => TlsMode::Prefer,
            "require" | "required" => TlsMode::Require,
            "verify-ca" => TlsMode::VerifyCa,
            "verify-full" | "verify-identity" => TlsMode::VerifyFull,
            other => {
                return Err(Error::config(
                    format!("unknown TLS mode {other:?}"),
                    "use one of disable, prefer, require, verify-ca, verify-full",
                ))
            }
        })
    }
}

/// TLS settings shared by every client.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: TlsMode,
    pub ca_file: Option<String>,
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
}

/// A database server address with credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct DbDsn {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Option<String>,
    pub database: String,
    pub tls: TlsSettings,
}

impl fmt::Debug for DbDsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DbDsn")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("database", &self.database)
            .field("tls", &self.tls)
            .finish()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceDsn {
    Postgres(DbDsn),
    Mysql(DbDsn),
    /// Binlog files: one file or a directory read in order.
    File(FileDsn),
}

/// Which binlog files a `file://` source reads: `file:///dir/mysql-bin.000042` (one file),
/// `file:///dir/` (every binlog file in it, in name order) or
/// `file:///dir/?from=mysql-bin.000040&to=mysql-bin.000042` (those, inclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDsn {
    pub path: std::path::PathBuf,
    pub from: Option<String>,
    pub to: Option<String>,
}

impl SourceDsn {
    pub fn parse(s: &str) -> Result<SourceDsn, Error> {
        refuse_several_hosts(s)?;
        let url = Url::parse(s.trim()).map_err(|e| {
            Error::config(
                format!("cannot parse the source DSN {}: {e}", redact(s)),
                "use postgres://user@host:5432/db, mysql://user@host:3306/db or file:///path/binlog.000001",
            )
        })?;
        match url.scheme() {
            "postgres" | "postgresql" => Ok(SourceDsn::Postgres(db_dsn(&url, 5432, "sslmode")?)),
            "mysql" | "mariadb" => Ok(SourceDsn::Mysql(db_dsn(&url, 3306, "ssl-mode")?)),
            "file" => {
                let path = url.to_file_path().map_err(|_| {
                    Error::config(
                        format!("{s} is not a local file path"),
                        "use file:///absolute/path/to/binlog.000001",
                    )
                })?;
                let (mut from, mut to) = (None, None);
                for (k, v) in url.query_pairs() {
                    match k.as_ref() {
                        "from" => from = Some(v.into_owned()),
                        "to" => to = Some(v.into_owned()),
                        other => {
                            return Err(Error::config(
                                format!("unknown option {other:?} in the file source {s}"),
                                "a file source takes from= and to= (binlog file names in the directory), e.g. file:///var/lib/mysql/?from=mysql-bin.000040",
                            ))
                        }
                    }
                }
                Ok(SourceDsn::File(FileDsn { path, from, to }))
            }
            other => Err(Error::config(
                format!("unsupported source scheme {other:?}"),
                "use postgres://, postgresql://, mysql://, mariadb:// or file://",
            )),
        }
    }

    pub fn password(&self) -> Option<&str> {
        match self {
            SourceDsn::Postgres(d) | SourceDsn::Mysql(d) => d.password.as_deref(),
            SourceDsn::File(_) => None,
        }
    }
}

/// A DSN naming several hosts (`mysql://a,b/db`, `postgres://a:5432,b:5432/db`, libpq's
/// `target_session_attrs`) is refused with the reason, rather than taken for a host named
/// `a,b`: the relay's sessions (the replication stream, the state and lease sessions, the
/// snapshot) must all reach the same server, and the clients cannot pick it together —
/// `mysql_async` and the replication client (`pgwire-replication`) take one host each, and
/// `tokio-postgres`'s own host list would let the SQL sessions choose a server the stream does
/// not use.
fn refuse_several_hosts(s: &str) -> Result<(), Error> {
    let lower = s.trim().to_ascii_lowercase();
    let Some((scheme, rest)) = lower.split_once("://") else {
        return Ok(());
    };
    if !matches!(scheme, "postgres" | "postgresql" | "mysql" | "mariadb") {
        return Ok(());
    }
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let attrs = lower.contains("target_session_attrs");
    if hosts.contains(',') || attrs {
        return Err(Error::config(
            format!(
                "the source DSN {} names several hosts{}: outboxd connects to one server",
                redact(s),
                if attrs { " (target_session_attrs)" } else { "" }
            ),
            "name the primary through one address that moves with it (a DNS name, a virtual IP or a proxy such as HAProxy or ProxySQL); \
             after a failover the relay stops (it loses its lease within 3.5 s) and, restarted by its supervisor, connects to the new primary \
             and resumes there (docs/operations.md, failover runbooks)",
        ));
    }
    Ok(())
}

fn db_dsn(url: &Url, default_port: u16, tls_key: &str) -> Result<DbDsn, Error> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut tls = TlsSettings::default();
    let mut host = url.host_str().unwrap_or("").to_string();
    for (k, v) in url.query_pairs() {
        match k.as_ref() {
            "sslmode" | "ssl-mode" | "ssl_mode" | "tls" => tls.mode = TlsMode::parse(&v)?,
            "sslrootcert" | "ssl-ca" | "ssl_ca" => tls.ca_file = Some(v.into_owned()),
            "sslcert" | "ssl-cert" | "ssl_cert" => tls.cert_file = Some(v.into_owned()),
            "sslkey" | "ssl-key" | "ssl_key" => tls.key_file = Some(v.into_owned()),
            "host" => host = v.into_owned(),
            "application_name" | "connect_timeout" => {}
            other => {
                return Err(Error::config(
                    format!("unknown DSN parameter {other:?}"),
                    format!("remove it; supported: {tls_key}, sslrootcert/ssl-ca, sslcert/ssl-cert, sslkey/ssl-key, host"),
                ))
            }
        }
    }
    check_verify_ca(
        &tls,
        if tls_key == "sslmode" {
            "sslrootcert"
        } else {
            "ssl-ca"
        },
    )?;
    if host.is_empty() {
        host = "localhost".into();
    }
    // IPv6 literals arrive bracketed from the URL parser.
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let user = if url.username().is_empty() {
        if default_port == 5432 {
            "postgres".into()
        } else {
            "root".into()
        }
    } else {
        decode(url.username())
    };
    let database = decode(url.path().trim_start_matches('/'));
    Ok(DbDsn {
        host,
        port: url.port().unwrap_or(default_port),
        user,
        password: url.password().map(decode),
        database: if database.is_empty() {
            if default_port == 5432 {
                "postgres".into()
            } else {
                String::new()
            }
        } else {
            database
        },
        tls,
    })
}

/// A sink address.
#[derive(Clone, PartialEq, Eq)]
pub enum SinkDsn {
    Stdout,
    /// `amqp://` or `amqps://`, kept whole for the client (it carries the vhost and options).
    Amqp(String),
    /// `nats://` or `tls://` (NATS JetStream), kept whole; credentials are split off at connect.
    Nats(String),
    /// `kafka://` or `kafkas://` (TLS), kept whole; brokers and credentials are split at connect.
    Kafka(String),
    /// `rabbitmq-stream://` (a RabbitMQ stream), kept whole; parsed by the stream sink.
    RabbitStream(String),
}

impl fmt::Debug for SinkDsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SinkDsn::Stdout => f.write_str("Stdout"),
            SinkDsn::Amqp(u) => write!(f, "Amqp({})", redact(u)),
            SinkDsn::Nats(u) => write!(f, "Nats({})", redact_token(u)),
            SinkDsn::Kafka(u) => write!(f, "Kafka({})", redact(u)),
            SinkDsn::RabbitStream(u) => write!(f, "RabbitStream({})", redact(u)),
        }
    }
}

impl SinkDsn {
    pub fn parse(s: &str) -> Result<SinkDsn, Error> {
        let s = s.trim();
        if s == "stdout" || s == "-" {
            return Ok(SinkDsn::Stdout);
        }
        // Several brokers (`kafka://k1:9092,k2:9092`) are no URL: the Kafka sink parses them.
        if s.starts_with("kafka://") || s.starts_with("kafkas://") {
            return Ok(SinkDsn::Kafka(s.to_string()));
        }
        let url = Url::parse(s).map_err(|e| {
            Error::config(
                format!("cannot parse the sink {}: {e}", redact(s)),
                "use stdout, amqp://user@host:5672/%2f, nats://host:4222, kafka://host:9092 or rabbitmq-stream://user@host:5552/%2f",
            )
        })?;
        match url.scheme() {
            "amqp" | "amqps" => Ok(SinkDsn::Amqp(s.to_string())),
            "nats" | "tls" => Ok(SinkDsn::Nats(s.to_string())),
            "rabbitmq-stream" | "rabbitmq-stream+tls" => Ok(SinkDsn::RabbitStream(s.to_string())),
            other => Err(Error::config(
                format!("unsupported sink scheme {other:?}"),
                "use stdout, amqp://, amqps://, nats://, tls://, kafka://, kafkas://, rabbitmq-stream:// or rabbitmq-stream+tls://",
            )),
        }
    }

    pub fn password(&self) -> Option<String> {
        match self {
            SinkDsn::Stdout => None,
            SinkDsn::Amqp(u) | SinkDsn::Nats(u) | SinkDsn::RabbitStream(u) => Url::parse(u)
                .ok()
                .and_then(|u| u.password().map(str::to_string)),
            // A Kafka URL may name several brokers, which `Url` cannot parse: the sink's own
            // parser splits them (compiled with the relay; without it nothing connects).
            #[cfg(feature = "relay")]
            SinkDsn::Kafka(u) => crate::sink::kafka::config::endpoint(u)
                .ok()
                .and_then(|e| e.password),
            #[cfg(not(feature = "relay"))]
            SinkDsn::Kafka(_) => None,
        }
    }
}

/// A DSN as the command line or the environment gave it: used as the string it is, but its
/// `Debug` shows it with the password redacted, so an argument struct printed with `{:?}` (a
/// trace line, a panic message) never carries a secret. It has no `Display` on purpose.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct DsnArg(String);

impl DsnArg {
    pub fn new(s: impl Into<String>) -> DsnArg {
        DsnArg(s.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for DsnArg {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<DsnArg, Self::Err> {
        Ok(DsnArg(s.to_string()))
    }
}

impl std::ops::Deref for DsnArg {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<&str> for DsnArg {
    fn from(s: &str) -> DsnArg {
        DsnArg(s.to_string())
    }
}

impl From<String> for DsnArg {
    fn from(s: String) -> DsnArg {
        DsnArg(s)
    }
}

impl fmt::Debug for DsnArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&redact(&self.0), f)
    }
}

/// The DSN with its password replaced by `***` (best effort on unparsable input: everything
/// between `:` and `@` of the authority goes).
pub fn redact(s: &str) -> String {
    if let Ok(mut url) = Url::parse(s) {
        if url.password().is_some() {
            let _ = url.set_password(Some("***"));
        }
        return url.to_string();
    }
    match (s.find("://"), s.rfind('@')) {
        (Some(scheme_end), Some(at)) if at > scheme_end => {
            let auth = &s[scheme_end + 3..at];
            match auth.find(':') {
                Some(colon) => format!("{}:***{}", &s[..scheme_end + 3 + colon], &s[at..]),
                None => s.to_string(),
            }
        }
        _ => s.to_string(),
    }
}

/// [`redact`], and also a user without a password, which a NATS URL reads as a token
/// (`nats://TOKEN@host:4222`).
pub fn redact_token(s: &str) -> String {
    match Url::parse(s) {
        Ok(mut url) if url.password().is_none() && !url.username().is_empty() => {
            let _ = url.set_username("***");
            url.to_string()
        }
        _ => redact(s),
    }
}

/// Puts a password into a DSN that has none (passwords from `--source-file`/environment).
pub fn with_password(dsn: &str, password: &str) -> Result<String, Error> {
    // A Kafka sink lists several brokers, which `Url` cannot parse: the password goes after
    // the user by hand.
    let t = dsn.trim();
    if let Some(scheme) = ["kafka://", "kafkas://"]
        .into_iter()
        .find(|s| t.starts_with(s))
    {
        let rest = &t[scheme.len()..];
        let Some((user, hosts)) = rest
            .rsplit_once('@')
            .filter(|(u, _)| !u.is_empty() && !u.contains(':'))
        else {
            return Err(Error::config(
                format!("{} names no user to give the password to", redact(dsn)),
                "write the user into --sink, e.g. kafka://app@broker:9092",
            ));
        };
        let enc =
            percent_encoding::utf8_percent_encode(password, percent_encoding::NON_ALPHANUMERIC);
        return Ok(format!("{scheme}{user}:{enc}@{hosts}"));
    }
    let mut url = Url::parse(dsn.trim()).map_err(|e| {
        Error::config(
            format!("cannot parse {}: {e}", redact(dsn)),
            "check the DSN syntax",
        )
    })?;
    url.set_password(Some(password))
        .map_err(|_| Error::config("this DSN cannot carry a password", "use a URL with a host"))?;
    Ok(url.to_string())
}

/// `verify-ca` needs the CA to verify against: without one libpq refuses rather than trust
/// every public root with no host name check (which any public CA's customer passes). `key`
/// is the DSN's name for the CA file (`sslrootcert`, `ssl-ca`).
pub fn check_verify_ca(settings: &TlsSettings, key: &str) -> Result<(), Error> {
    if settings.mode == TlsMode::VerifyCa && settings.ca_file.is_none() {
        return Err(Error::config(
            format!("sslmode verify-ca is given without a CA file ({key}): it would accept any certificate a public CA signed, for any host"),
            format!("add {key}=/path/to/ca.pem (the CA that signed the server's certificate) to the DSN, or use verify-full, which also checks the host name"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_postgres_with_tls_and_redacts() {
        let s = "postgres://app:s%40cret@db.example:6543/orders?sslmode=verify-full&sslrootcert=/ca.pem";
        let SourceDsn::Postgres(d) = SourceDsn::parse(s).unwrap() else {
            panic!()
        };
        assert_eq!(d.host, "db.example");
        assert_eq!(d.port, 6543);
        assert_eq!(d.user, "app");
        assert_eq!(d.password.as_deref(), Some("s@cret"));
        assert_eq!(d.database, "orders");
        assert_eq!(d.tls.mode, TlsMode::VerifyFull);
        assert_eq!(d.tls.ca_file.as_deref(), Some("/ca.pem"));
        assert!(!format!("{d:?}").contains("cret"));
        assert!(!redact(s).contains("cret"));
        assert!(redact(s).contains("app:***@"));
        assert!(!redact("postgres://u:pw@@bad url").contains("pw"));
    }

    #[test]
    fn dsn_arguments_debug_without_the_password() {
        let arg: DsnArg = "amqp://relay:Hunter2-Xy@broker:5672/%2f".parse().unwrap();
        let shown = format!("{arg:?} {:?}", Some(arg.clone()));
        assert!(!shown.contains("Hunter2-Xy"), "{shown}");
        assert!(shown.contains("relay:***@broker"), "{shown}");
        assert_eq!(&*arg, "amqp://relay:Hunter2-Xy@broker:5672/%2f");
        let odd = DsnArg::new("postgres://u:Hunter2-Xy@@not a url");
        assert!(!format!("{odd:?}").contains("Hunter2-Xy"));
    }

    #[test]
    fn parses_other_schemes_and_refuses_unknown() {
        assert!(matches!(
            SourceDsn::parse("mariadb://root@127.0.0.1/test").unwrap(),
            SourceDsn::Mysql(DbDsn { port: 3306, .. })
        ));
        assert!(matches!(
            SourceDsn::parse("file:///var/lib/mysql/bin.000001").unwrap(),
            SourceDsn::File(_)
        ));
        assert_eq!(
            SourceDsn::parse("file:///var/lib/mysql/?from=bin.000002&to=bin.000003").unwrap(),
            SourceDsn::File(FileDsn {
                path: "/var/lib/mysql/".into(),
                from: Some("bin.000002".into()),
                to: Some("bin.000003".into()),
            })
        );
        assert!(SourceDsn::parse("file:///var/lib/mysql/?start=4").is_err());
        assert!(matches!(
            SourceDsn::parse("file:///x").unwrap(),
            SourceDsn::File(_)
        ));
        assert!(SourceDsn::parse("redis://x").is_err());
        for several in [
            "mysql://u@a,b/db",
            "mariadb://u:secret@a:3306,b:3306/db",
            "postgres://u@a:5432,b:5432/db",
            "postgres://a,b/db?target_session_attrs=read-write",
            "postgres://a/db?target_session_attrs=read-write",
        ] {
            let Err(Error::Config { problem, fix }) = SourceDsn::parse(several) else {
                panic!("{several} was not refused")
            };
            assert!(
                problem.contains("several hosts") && !problem.contains("secret"),
                "{problem}"
            );
            assert!(fix.contains("one address that moves with it"), "{fix}");
        }
        assert!(SourceDsn::parse("postgres://x/db?sslmode=bogus").is_err());
        // verify-ca needs the CA (as in libpq): refused with the fix, naming the DSN's key.
        let err = SourceDsn::parse("postgres://x/db?sslmode=verify-ca")
            .unwrap_err()
            .to_string();
        assert!(err.contains("fix: add sslrootcert="), "{err}");
        let err = SourceDsn::parse("mysql://x/db?ssl-mode=VERIFY_CA")
            .unwrap_err()
            .to_string();
        assert!(err.contains("fix: add ssl-ca="), "{err}");
        assert!(SourceDsn::parse("postgres://x/db?sslmode=verify-ca&sslrootcert=/ca.pem").is_ok());
        assert_eq!(SinkDsn::parse("stdout").unwrap(), SinkDsn::Stdout);
        assert_eq!(
            SinkDsn::parse("kafka://k1:9092,k2:9092").unwrap(),
            SinkDsn::Kafka("kafka://k1:9092,k2:9092".into())
        );
        assert!(SinkDsn::parse("redis://x").is_err());
        assert_eq!(
            with_password("kafka://app@k1:9092,k2:9092", "p@ss").unwrap(),
            "kafka://app:p%40ss@k1:9092,k2:9092"
        );
        let with = with_password("postgres://u@h/db", "p@ss").unwrap();
        let SourceDsn::Postgres(d) = SourceDsn::parse(&with).unwrap() else {
            panic!()
        };
        assert_eq!(d.password.as_deref(), Some("p@ss"));
    }
}
