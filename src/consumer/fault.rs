//! Whose fault a database error is, decided once for Postgres and MySQL/MariaDB from the codes
//! the server sends with it — the SQLSTATE (both databases send one) and, on MySQL, the error
//! number — never from the wording of the message. The answer decides what the runner does:
//! only an error caused by the message's own data may count towards `--max-failures` and so
//! reach `--on-poison`; a database that cannot take writes right now (a standby behind the DSN
//! after a failover, a lost connection) is retried with backoff on a new session, and a schema
//! or grant that does not fit the consumer stops it with the message left in the queue. Left to
//! the poison policy, those would skip or park every healthy message that arrived meanwhile.

use super::ConsumerError;

/// What a database error says about the message that was being processed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The transaction lost a race (deadlock, serialization failure, lock wait timeout):
    /// running it again is the fix.
    Conflict,
    /// The database cannot take the write now (connection lost, shutting down, out of
    /// resources, read-only — a standby after a failover): reconnect and retry with backoff,
    /// without limit.
    Unavailable,
    /// The schema, the grants or the handler's SQL do not fit (a missing table or column,
    /// permission denied, a statement the server rejects), or the error is not one known to
    /// come from the message: no message gets through until someone fixes it, so the consumer
    /// stops with the message unacked.
    Setup,
    /// The message's data broke a rule (a constraint, a value out of range, an exception a
    /// trigger raised): the message fails, and counts towards `--max-failures`.
    Data,
}

/// MySQL/MariaDB error numbers whose SQLSTATE is the generic `HY000` (or otherwise too coarse)
/// and that are the message's data: incorrect value for a column (1366, 1367), incorrect
/// argument to a function (1411), a check constraint (MySQL 3819). (A trigger's `SIGNAL`,
/// 1644, goes by the SQLSTATE it chose: `45000` is data, `40001` a conflict.)
const MY_DATA: &[u16] = &[1366, 1367, 1411, 3819];

/// Classifies a server error by its SQLSTATE and, on MySQL/MariaDB, its error number (`None`
/// on Postgres). One function for both databases: MySQL numbers are looked at first where
/// its SQLSTATE is too coarse (`HY000` covers read-only and lock waits alike), then the
/// SQLSTATE class decides for both.
pub fn classify_sql(sqlstate: &str, mysql_code: Option<u16>) -> Fault {
    if let Some(code) = mysql_code {
        match code {
            // Lock wait timeout, deadlock, MariaDB's "record has changed since last read".
            1205 | 1213 | 1020 => return Fault::Conflict,
            c if MY_DATA.contains(&c) => return Fault::Data,
            // Connection trouble, shutdown, too many connections, --read-only (1290),
            // read-only mode (1836): the list the relay reconnects on.
            #[cfg(feature = "mysql")]
            c if crate::db::mysql::is_retryable_code(c) => return Fault::Unavailable,
            _ => {}
        }
    }
    match sqlstate {
        "40001" | "40P01" | "55P03" => return Fault::Conflict,
        // A read-only transaction (Postgres standby, default_transaction_read_only; MySQL
        // 1792): the write goes to a server that cannot take it now.
        "25006" => return Fault::Unavailable,
        // A deferred constraint checked at commit.
        "40002" => return Fault::Data,
        // "Statement completion unknown" and other rollbacks the server chose; an object in
        // use (a concurrent DDL or a database being dropped).
        "40000" | "40003" | "55006" => return Fault::Unavailable,
        _ => {}
    }
    match sqlstate.get(..2).unwrap_or("") {
        // Connection exception, insufficient resources, operator intervention (shutdown,
        // statement timeout, terminated session), system error (I/O), configuration file,
        // foreign data wrapper. (Internal errors and corruption, class XX, stop instead: an
        // operator has to look.)
        "08" | "53" | "57" | "58" | "F0" | "HV" => Fault::Unavailable,
        // Cardinality, data exception, integrity constraint, triggered data change, WITH
        // CHECK OPTION, program limits (a value too large for an index), routine and trigger
        // exceptions, PL/pgSQL RAISE and MySQL's SIGNAL '45000'.
        "21" | "22" | "23" | "27" | "44" | "54" | "20" | "09" | "2F" | "38" | "39" | "P0"
        | "45" => Fault::Data,
        // Syntax or access rule (undefined table or column, permission denied), invalid
        // authorization, unknown database or schema, unsupported feature, transaction state
        // and everything not listed: not known to be the message's fault.
        _ => Fault::Setup,
    }
}

/// The fix to print when a [`Fault::Setup`] error stops the consumer.
pub(crate) fn setup_fix(sqlstate: &str, mysql_code: Option<u16>) -> &'static str {
    match (sqlstate, mysql_code) {
        ("42501", _) | (_, Some(1142 | 1143 | 1044 | 1227 | 1370)) => {
            "grant the database user the privileges it needs (e.g. GRANT SELECT, INSERT, UPDATE, DELETE ON <table> TO <user>), then start again; a consumer leaves the message in the queue meanwhile"
        }
        ("42703", _) | (_, Some(1054)) => {
            "a statement names a column its table does not have: apply the migration that adds it (or deploy the code that matches the schema), then start again; a consumer leaves the message in the queue meanwhile"
        }
        _ => {
            "the database refused the statement for a reason no message causes (schema, grants, SQL, or an error not known to be the message's): fix the cause named above, then start again; a consumer leaves the message in the queue meanwhile"
        }
    }
}

/// The [`ConsumerError`] for a server error with `message` (already naming its code).
pub(crate) fn to_error(message: String, sqlstate: &str, mysql_code: Option<u16>) -> ConsumerError {
    match classify_sql(sqlstate, mysql_code) {
        Fault::Conflict => ConsumerError::Conflict(message),
        Fault::Unavailable => ConsumerError::Database {
            message,
            retryable: true,
        },
        Fault::Data => ConsumerError::Database {
            message,
            retryable: false,
        },
        Fault::Setup => ConsumerError::config(message, setup_fix(sqlstate, mysql_code)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same condition on both databases lands in the same class.
    #[test]
    fn both_databases_alike() {
        let pg = |s| classify_sql(s, None);
        let my = |s, c| classify_sql(s, Some(c));
        // Read-only: a Postgres standby, MySQL/MariaDB --read-only, a read-only transaction.
        assert_eq!(pg("25006"), Fault::Unavailable);
        assert_eq!(my("HY000", 1290), Fault::Unavailable);
        assert_eq!(my("HY000", 1836), Fault::Unavailable);
        assert_eq!(my("25006", 1792), Fault::Unavailable);
        // Permission denied.
        assert_eq!(pg("42501"), Fault::Setup);
        assert_eq!(my("42000", 1142), Fault::Setup);
        assert_eq!(my("42000", 1143), Fault::Setup);
        assert_eq!(my("28000", 1045), Fault::Setup);
        // Unknown column and table.
        assert_eq!(pg("42703"), Fault::Setup);
        assert_eq!(my("42S22", 1054), Fault::Setup);
        assert_eq!(pg("42P01"), Fault::Setup);
        assert_eq!(my("42S02", 1146), Fault::Setup);
        // Conflicts.
        assert_eq!(pg("40001"), Fault::Conflict);
        assert_eq!(pg("40P01"), Fault::Conflict);
        assert_eq!(pg("55P03"), Fault::Conflict);
        assert_eq!(my("40001", 1213), Fault::Conflict);
        assert_eq!(my("HY000", 1205), Fault::Conflict);
        // Connections and shutdowns.
        assert_eq!(pg("08006"), Fault::Unavailable);
        assert_eq!(pg("57P01"), Fault::Unavailable);
        assert_eq!(pg("53100"), Fault::Unavailable);
        assert_eq!(my("08S01", 1053), Fault::Unavailable);
        assert_eq!(my("HY000", 4031), Fault::Unavailable);
        // The message's data.
        assert_eq!(pg("23505"), Fault::Data);
        assert_eq!(pg("23502"), Fault::Data);
        assert_eq!(pg("22003"), Fault::Data);
        assert_eq!(pg("P0001"), Fault::Data);
        assert_eq!(my("23000", 1062), Fault::Data);
        assert_eq!(my("23000", 1452), Fault::Data);
        assert_eq!(my("22001", 1406), Fault::Data);
        assert_eq!(my("HY000", 1366), Fault::Data);
        assert_eq!(my("HY000", 3819), Fault::Data);
        assert_eq!(my("45000", 1644), Fault::Data);
        // A trigger's SIGNAL with a conflict SQLSTATE is a conflict.
        assert_eq!(my("40001", 1644), Fault::Conflict);
        assert_eq!(pg("55006"), Fault::Unavailable);
        // Not known to be the message's: stop rather than poison it.
        assert_eq!(pg("25P02"), Fault::Setup);
        assert_eq!(pg("55000"), Fault::Setup);
        assert_eq!(pg("XX001"), Fault::Setup);
        assert_eq!(my("HY000", 1), Fault::Setup);
        assert_eq!(pg(""), Fault::Setup);
    }

    #[test]
    fn errors_follow_the_class() {
        let e = to_error("ro".into(), "25006", None);
        assert!(e.is_retryable() && e.session_lost(), "{e:?}");
        let e = to_error("ro".into(), "HY000", Some(1290));
        assert!(e.is_retryable() && e.session_lost(), "{e:?}");
        let e = to_error("denied".into(), "42000", Some(1142));
        assert!(
            matches!(e, ConsumerError::Config { ref fix, .. } if fix.contains("GRANT")),
            "{e:?}"
        );
        let e = to_error("col".into(), "42703", None);
        assert!(
            matches!(e, ConsumerError::Config { ref fix, .. } if fix.contains("column")),
            "{e:?}"
        );
        let e = to_error("dup".into(), "23505", None);
        assert!(!e.is_retryable() && matches!(e, ConsumerError::Database { .. }));
        assert!(matches!(
            to_error("d".into(), "40P01", None),
            ConsumerError::Conflict(_)
        ));
    }
}
