//! The zone the producers' `DATETIME` values are written in (`--source-time-zone`).

use crate::Error;
use chrono::{DateTime, FixedOffset, NaiveDateTime, TimeZone, Utc};

/// The zone `DATETIME` values are written in (`--source-time-zone`). `TIMESTAMP` values are
/// stored in UTC by the server and need none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SourceTz {
    #[default]
    Utc,
    Fixed(FixedOffset),
    Named(chrono_tz::Tz),
}

impl SourceTz {
    /// `UTC`, `+02:00`, `-0530`, or an IANA name such as `Europe/Berlin`.
    pub fn parse(s: &str) -> Result<SourceTz, Error> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("utc") || t == "Z" || t == "+00:00" || t == "00:00" {
            return Ok(SourceTz::Utc);
        }
        if let Some(sign) = t.chars().next().filter(|c| *c == '+' || *c == '-') {
            let digits: String = t[1..].chars().filter(|c| *c != ':').collect();
            if digits.len() == 4 && digits.chars().all(|c| c.is_ascii_digit()) {
                let h: i32 = digits[..2].parse().unwrap_or(99);
                let m: i32 = digits[2..].parse().unwrap_or(99);
                let secs = (h * 3600 + m * 60) * if sign == '-' { -1 } else { 1 };
                if h <= 14 && m < 60 {
                    if let Some(off) = FixedOffset::east_opt(secs) {
                        return Ok(SourceTz::Fixed(off));
                    }
                }
            }
        } else if let Ok(tz) = t.parse::<chrono_tz::Tz>() {
            return Ok(SourceTz::Named(tz));
        }
        Err(Error::config(
            format!("--source-time-zone {t:?} is not a time zone"),
            "use UTC, an offset like +02:00, or an IANA name like Europe/Berlin (the zone the producers' DATETIME values are written in)",
        ))
    }

    /// The wall-clock time in this zone at an instant.
    pub fn from_utc(&self, t: DateTime<Utc>) -> NaiveDateTime {
        match self {
            SourceTz::Utc => t.naive_utc(),
            SourceTz::Fixed(off) => t.with_timezone(off).naive_local(),
            SourceTz::Named(tz) => t.with_timezone(tz).naive_local(),
        }
    }

    /// The instant a wall-clock `DATETIME` value in this zone stands for. A time that repeats
    /// (the hour a DST change turns back) is taken as its first occurrence; a time that never
    /// existed (the hour skipped) gives `None`.
    pub fn to_utc(&self, naive: NaiveDateTime) -> Option<DateTime<Utc>> {
        match self {
            SourceTz::Utc => Some(naive.and_utc()),
            SourceTz::Fixed(off) => off
                .from_local_datetime(&naive)
                .earliest()
                .map(|t| t.with_timezone(&Utc)),
            SourceTz::Named(tz) => tz
                .from_local_datetime(&naive)
                .earliest()
                .map(|t| t.with_timezone(&Utc)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::NaiveDate;

    #[test]
    fn time_zones_parse_and_convert() {
        let n = NaiveDate::from_ymd_opt(2026, 6, 22)
            .unwrap()
            .and_hms_micro_opt(12, 0, 0, 123456)
            .unwrap();
        assert_eq!(
            SourceTz::parse("UTC").unwrap().to_utc(n).unwrap(),
            n.and_utc()
        );
        let plus2 = SourceTz::parse("+02:00").unwrap();
        assert_eq!(
            plus2.to_utc(n).unwrap().to_rfc3339(),
            "2026-06-22T10:00:00.123456+00:00"
        );
        let berlin = SourceTz::parse("Europe/Berlin").unwrap();
        assert_eq!(berlin.to_utc(n), plus2.to_utc(n), "CEST in June");
        // The skipped hour of the spring change does not exist.
        let gap = NaiveDate::from_ymd_opt(2026, 3, 29)
            .unwrap()
            .and_hms_opt(2, 30, 0)
            .unwrap();
        assert!(berlin.to_utc(gap).is_none());
        assert!(SourceTz::parse("Mars/Olympus").is_err());
        assert!(SourceTz::parse("+25:00").is_err());
        assert_eq!(
            SourceTz::parse("-0530").unwrap(),
            SourceTz::Fixed(FixedOffset::west_opt(5 * 3600 + 1800).unwrap())
        );
    }
}
