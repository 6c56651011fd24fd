//! The text of statements in the binlog: their first keyword, the target of an
//! `INSERT`/`REPLACE`, and the check that refuses statement-based writes to an outbox table
//! (their rows are not in the log).

use super::Decoder;
use crate::source::mysql::rows::OutboxTable;
use crate::Error;
use mysql_common::binlog::events::{Event, QueryEvent};

impl Decoder {
    /// A statement-based INSERT/REPLACE into the outbox table: its rows are not in the log.
    pub(super) fn check_statement(&self, q: &QueryEvent<'_>) -> Result<(), Error> {
        let text = q.query_raw();
        if let Some((db, table)) = insert_target(text) {
            let db = db.unwrap_or_else(|| q.schema().into_owned());
            if let Some(t) = self
                .outbox
                .iter()
                .find(|t| db == t.database && table == t.table)
            {
                return Err(statement_insert(t, &String::from_utf8_lossy(text)));
            }
        }
        Ok(())
    }

    pub(super) fn check_load_query(&self, ev: &Event, _start: u64) -> Result<(), Error> {
        // LOAD DATA in statement format: look for the table name in the text.
        let text = String::from_utf8_lossy(ev.data());
        let lower = text.to_ascii_lowercase();
        if !lower.contains("load data") {
            return Ok(());
        }
        if let Some(t) = self
            .outbox
            .iter()
            .find(|t| lower.contains(&t.table.to_ascii_lowercase()))
        {
            return Err(statement_insert(t, &text));
        }
        Ok(())
    }
}

fn statement_insert(table: &OutboxTable, text: &str) -> Error {
    let mut shown: String = text.chars().take(200).collect();
    if shown.len() < text.len() {
        shown.push('…');
    }
    Error::config(
        format!(
            "a statement-based INSERT into {} is in the binlog (a session ran binlog_format=STATEMENT or MIXED): its rows are not in the log, so the relay cannot publish them: {shown}",
            table.quoted()
        ),
        "SET GLOBAL binlog_format = ROW; set binlog_format=ROW in the server's option file and in any session that overrides it; \
         then publish that statement's rows by hand and move past it with `outboxd offset set`",
    )
}

/// The first keyword of a statement, after whitespace and comments.
pub(super) fn first_word(text: &[u8]) -> &str {
    let rest = skip_space(text);
    let end = rest
        .iter()
        .position(|c| !c.is_ascii_alphabetic())
        .unwrap_or(rest.len());
    std::str::from_utf8(&rest[..end]).unwrap_or("")
}

pub(super) fn skip_space(mut s: &[u8]) -> &[u8] {
    loop {
        while let Some((c, rest)) = s.split_first() {
            if c.is_ascii_whitespace() {
                s = rest;
            } else {
                break;
            }
        }
        if s.starts_with(b"/*") && !s.starts_with(b"/*!") && !s.starts_with(b"/*M!") {
            match s.windows(2).position(|w| w == b"*/") {
                Some(i) => s = &s[i + 2..],
                None => return &[],
            }
        } else if s.starts_with(b"/*!") || s.starts_with(b"/*M!") {
            // Versioned comments hold real SQL: skip only the opener and version digits.
            s = &s[if s.starts_with(b"/*M!") { 4 } else { 3 }..];
            while let Some((c, rest)) = s.split_first() {
                if c.is_ascii_digit() {
                    s = rest;
                } else {
                    break;
                }
            }
        } else if s.starts_with(b"-- ") || s.starts_with(b"#") {
            match s.iter().position(|&c| c == b'\n') {
                Some(i) => s = &s[i + 1..],
                None => return &[],
            }
        } else {
            return s;
        }
    }
}

/// The target table of an `INSERT`/`REPLACE` statement: `(database, table)`.
pub fn insert_target(text: &[u8]) -> Option<(Option<String>, String)> {
    let mut s = skip_space(text);
    let word = |s: &mut &[u8]| -> Option<String> {
        *s = skip_space(s);
        let end = s
            .iter()
            .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_'))
            .unwrap_or(s.len());
        if end == 0 {
            return None;
        }
        let w = String::from_utf8_lossy(&s[..end]).to_ascii_uppercase();
        *s = &s[end..];
        Some(w)
    };
    let verb = word(&mut s)?;
    if verb != "INSERT" && verb != "REPLACE" {
        return None;
    }
    // Modifiers and INTO, then the table name.
    loop {
        let save = s;
        match word(&mut s).as_deref() {
            Some("LOW_PRIORITY" | "DELAYED" | "HIGH_PRIORITY" | "IGNORE" | "INTO") => continue,
            _ => {
                s = save;
                break;
            }
        }
    }
    let first = ident(&mut s)?;
    if s.first() == Some(&b'.') {
        s = &s[1..];
        let second = ident(&mut s)?;
        Some((Some(first), second))
    } else {
        Some((None, first))
    }
}

/// An identifier: quoted with backticks (a doubled backtick inside stands for one) or bare.
pub(super) fn ident(s: &mut &[u8]) -> Option<String> {
    *s = skip_space(s);
    if s.first() == Some(&b'`') {
        let mut out = Vec::new();
        let mut i = 1;
        while i < s.len() {
            if s[i] == b'`' {
                if s.get(i + 1) == Some(&b'`') {
                    out.push(b'`');
                    i += 2;
                    continue;
                }
                *s = &s[i + 1..];
                return String::from_utf8(out).ok();
            }
            out.push(s[i]);
            i += 1;
        }
        None
    } else {
        let end = s
            .iter()
            .position(|c| !(c.is_ascii_alphanumeric() || *c == b'_' || *c == b'$' || *c >= 0x80))
            .unwrap_or(s.len());
        if end == 0 {
            return None;
        }
        let w = String::from_utf8(s[..end].to_vec()).ok();
        *s = &s[end..];
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statement_targets() {
        let t = |s: &str| insert_target(s.as_bytes());
        assert_eq!(
            t("INSERT INTO outbox VALUES (1)"),
            Some((None, "outbox".into()))
        );
        assert_eq!(
            t("  /* c */ insert low_priority ignore into `app`.`out``box` (id) values (1)"),
            Some((Some("app".into()), "out`box".into()))
        );
        assert_eq!(
            t("REPLACE app.outbox SET id = 1"),
            Some((Some("app".into()), "outbox".into()))
        );
        assert_eq!(
            t("INSERT INTO other SELECT * FROM outbox"),
            Some((None, "other".into()))
        );
        assert_eq!(t("UPDATE outbox SET status = 'published'"), None);
        assert_eq!(t("CREATE TABLE outbox (id int)"), None);
        assert_eq!(first_word(b"  BEGIN"), "BEGIN");
        assert_eq!(first_word(b"/* x */COMMIT"), "COMMIT");
    }
}
