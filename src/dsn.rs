//! Connection strings: parsing the source DSNs (docs/configuration.md; a sink address is the
//! sink registry's, `sink::SinkDsn`), and the one redaction of every secret a connection
//! string can carry ([`redact`]), so no log line, error, `Debug` or `--help` ever shows one. A
//! leaf: it names no sink module.

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
                        format!("{} is not a local file path", redact(s)),
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
                                format!("unknown option {other:?} in the file source {}", redact(s)),
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

/// What a redacted secret shows instead.
const HIDDEN: &str = "***";

/// The one redaction of a connection string, used wherever one is shown (errors, logs,
/// `Debug`, `outboxd config`, `check`): every secret form it can carry becomes `***`, and the
/// rest stays as written, so the message still says which server and user it is about.
///
/// - URL user-info: `postgres://app:PASSWORD@host/db` → `postgres://app:***@host/db`;
/// - a token URL: `nats://TOKEN@host:4222` (a NATS URL reads a user without a password as a
///   token) → `nats://***@host:4222`;
/// - secret parameters, in a URL's query (`?password=…&sslpassword=…`) or as libpq
///   keyword/value pairs (`host=db user=app password='p w' dbname=app`, quoted or not): every
///   key that names a password, a password file, a token, a secret or a credential (see
///   [`is_secret_key`]).
///
/// It works on text, not on a parsed URL, so a string no parser accepts is redacted the same
/// way (a parse error is where a mistyped DSN is shown); where it cannot tell, it hides more:
/// the user-info ends at the last `@`.
pub fn redact(s: &str) -> String {
    let t = s.trim_start();
    let lead = &s[..s.len() - t.len()];
    match url_scheme(t) {
        Some(scheme) => {
            let rest = &t[scheme.len() + 3..];
            let mut out = format!("{lead}{scheme}://");
            let after_auth = match rest.rfind('@') {
                Some(at) => {
                    let auth = &rest[..at];
                    match auth.split_once(':') {
                        Some((user, pw)) if !pw.is_empty() => {
                            out.push_str(user);
                            out.push(':');
                            out.push_str(HIDDEN);
                        }
                        None if is_token_scheme(scheme) && !auth.is_empty() => out.push_str(HIDDEN),
                        // No password, or an `@` further on (in the query): what comes before
                        // it may still hold secret parameters.
                        _ => out.push_str(&redact_pairs(auth, true)),
                    }
                    out.push('@');
                    &rest[at + 1..]
                }
                None => rest,
            };
            out.push_str(&redact_pairs(after_auth, true));
            out
        }
        None => format!("{lead}{}", redact_pairs(t, false)),
    }
}

/// Whether `s` carries a secret [`redact`] would hide (a password in a URL, a token, a secret
/// parameter): what the warnings about secrets on the command line and the config file's
/// refusal of inline secrets ask.
pub fn has_secret(s: &str) -> bool {
    redact(s) != s
}

/// The scheme of a URL-shaped string (`scheme://…`), if it starts with one.
fn url_scheme(s: &str) -> Option<&str> {
    let end = s.find("://")?;
    let scheme = &s[..end];
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(scheme)
}

/// Schemes whose user without a password is a token: NATS (`nats://`, `tls://`).
fn is_token_scheme(scheme: &str) -> bool {
    matches!(scheme.to_ascii_lowercase().as_str(), "nats" | "tls")
}

/// Whether a parameter (a URL query key, a libpq keyword) holds a secret: a password
/// (`password`, `sslpassword`, `passwd`, `pass`, `pwd`, `passphrase`), a password file
/// (`passfile`), a token, a secret, a credential or key material given inline (`jwt`, `nkey`,
/// `seed`, `api_key`). Compared without case, `-` read as `_`. Names that merely mention
/// authentication (`auth_mechanism`) are not secrets.
pub(crate) fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase().replace('-', "_");
    [
        "password",
        "passwd",
        "passphrase",
        "passfile",
        "secret",
        "token",
        "credential",
    ]
    .iter()
    .any(|w| k.contains(w))
        || matches!(
            k.as_str(),
            "pass" | "pwd" | "jwt" | "nkey" | "seed" | "apikey" | "api_key" | "private_key"
        )
}

/// `text` with the value of every secret `key=value` pair replaced. A key counts where a
/// pair can start: at the beginning, after white space, or (in a URL, `url`) after `?`, `&`
/// or `;`. A value is quoted (`'…'` with backslash escapes, as libpq writes it; `"…"`) or
/// runs to the next white space (in a URL also to `&` or `#`).
fn redact_pairs(text: &str, url: bool) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    // Copied verbatim up to here.
    let mut copied = 0;
    while i < b.len() {
        let boundary = i == 0
            || b[i - 1].is_ascii_whitespace()
            || matches!(b[i - 1], b'?' | b'&' | b';' | b'\'' | b'"' | b'(' | b',');
        if !boundary || !is_key_byte(b[i]) {
            i += 1;
            continue;
        }
        let key_start = i;
        let mut j = i;
        while j < b.len() && is_key_byte(b[j]) {
            j += 1;
        }
        let key = &text[key_start..j];
        let mut k = j;
        while k < b.len() && b[k].is_ascii_whitespace() && !url {
            k += 1;
        }
        if k >= b.len() || b[k] != b'=' {
            i = j.max(i + 1);
            continue;
        }
        k += 1;
        while k < b.len() && b[k].is_ascii_whitespace() && !url {
            k += 1;
        }
        if !is_secret_key(key) {
            i = k;
            continue;
        }
        let mut end = value_end(b, k, url);
        // An escape may have stepped into a multi-byte character: end after it.
        while !text.is_char_boundary(end) {
            end += 1;
        }
        if end > k {
            out.push_str(&text[copied..k]);
            out.push_str(HIDDEN);
            copied = end;
        }
        i = end.max(k);
    }
    out.push_str(&text[copied..]);
    out
}

fn is_key_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.')
}

/// Where a value starting at `start` ends (see [`redact_pairs`]); an unclosed quote runs to
/// the end.
fn value_end(b: &[u8], start: usize, url: bool) -> usize {
    let mut i = start;
    if i < b.len() && (b[i] == b'\'' || b[i] == b'"') {
        let quote = b[i];
        i += 1;
        while i < b.len() {
            if b[i] == b'\\' {
                i += 2;
                continue;
            }
            if b[i] == quote {
                return i + 1;
            }
            i += 1;
        }
        return b.len();
    }
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() || (url && matches!(c, b'&' | b'#')) {
            break;
        }
        // libpq: a backslash escapes the next character (a space inside the value).
        i += if c == b'\\' && !url { 2 } else { 1 };
    }
    i.min(b.len())
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
pub(crate) fn check_verify_ca(settings: &TlsSettings, key: &str) -> Result<(), Error> {
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

    /// Each secret form, as written and as a parse error would show it: the secret is gone,
    /// what says which server and user is left.
    #[test]
    fn every_secret_form_is_redacted() {
        const S: &str = "Sup3rS3cret";
        for (dsn, kept) in [
            (
                "postgres://app:Sup3rS3cret@db:5432/app",
                "postgres://app:***@db:5432/app",
            ),
            (
                "postgres://app:Sup3rS3cret@@bad url",
                "postgres://app:***@bad url",
            ),
            (
                "mysql://app:Sup%40r:S3cret@db/app",
                "mysql://app:***@db/app",
            ),
            (
                "amqps://relay:Sup3rS3cret@mq/%2f",
                "amqps://relay:***@mq/%2f",
            ),
            (
                "kafka://u:Sup3rS3cret@k1:9092,k2:9092",
                "kafka://u:***@k1:9092,k2:9092",
            ),
            ("nats://Sup3rS3cret@nats:4222", "nats://***@nats:4222"),
            ("tls://Sup3rS3cret@nats:4222", "tls://***@nats:4222"),
            ("nats://u:Sup3rS3cret@nats:4222", "nats://u:***@nats:4222"),
            (
                "postgres://app@db/app?password=Sup3rS3cret",
                "postgres://app@db/app?password=***",
            ),
            (
                "postgres://app@db/app?sslmode=require&sslpassword=Sup3rS3cret&application_name=x",
                "postgres://app@db/app?sslmode=require&sslpassword=***&application_name=x",
            ),
            (
                "postgres://db/app?passfile=/home/Sup3rS3cret",
                "postgres://db/app?passfile=***",
            ),
            (
                "postgres://db/app?PassWord=Sup3rS3cret@x",
                "postgres://db/app?PassWord=***@x",
            ),
            (
                "file:///var/lib/mysql/?password=Sup3rS3cret",
                "file:///var/lib/mysql/?password=***",
            ),
            (
                "host=db port=5432 user=app password=Sup3rS3cret dbname=app",
                "host=db port=5432 user=app password=*** dbname=app",
            ),
            (
                "host=db password = 'Sup3r S3cret \\' x' dbname=app",
                "host=db password = *** dbname=app",
            ),
            (
                "host=db password=Sup3r\\ S3cret dbname=app",
                "host=db password=*** dbname=app",
            ),
            ("host=db password='Sup3rS3cret", "host=db password=***"),
            (
                "user=app sslpassword=Sup3rS3cret",
                "user=app sslpassword=***",
            ),
            (
                "Server=db;Password=Sup3rS3cret;Database=app",
                "Server=db;Password=***",
            ),
            ("token=Sup3rS3cret", "token=***"),
            ("password=\\é", "password=***"),
        ] {
            let shown = redact(dsn);
            assert!(
                !shown.contains(S) && !shown.contains("S3cret"),
                "{dsn} → {shown}"
            );
            assert_eq!(shown, kept, "{dsn}");
            assert!(has_secret(dsn), "{dsn}");
        }
        for plain in [
            "postgres://app@db:5432/app?sslmode=verify-full&sslrootcert=/ca.pem",
            "amqp://relay@mq/%2f",
            "nats://nats:4222",
            "host=db user=app dbname=app sslmode=require",
            "kafka://k1:9092,k2:9092?sasl=PLAIN",
            "amqps://relay@mq/%2f?auth_mechanism=external&cacertfile=/ca.pem",
            "postgres://db/app?options=-c%20statement_timeout%3D0&target_session_attrs=read-write",
            "postgres://u:@db/app",
            "stdout",
        ] {
            assert_eq!(redact(plain), plain);
            assert!(!has_secret(plain), "{plain}");
        }
        let err = SourceDsn::parse("host=db user=app password=Sup3rS3cret dbname=app")
            .unwrap_err()
            .to_string();
        assert!(!err.contains(S) && err.contains("password=***"), "{err}");
        let err = SourceDsn::parse("file:///var/lib/mysql/?password=Sup3rS3cret")
            .unwrap_err()
            .to_string();
        assert!(!err.contains(S), "{err}");
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
