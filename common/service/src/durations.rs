//! Durations on the command line, in every binary the same way: `30s`, `250ms`, `1m 30s`
//! (humantime's forms).

use std::time::Duration;

/// A duration like `30s` or `500ms`; the error names the value.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 30s or 500ms ({e})"))
}

/// A duration like `30s` of at most a day (see [`TIMING_MAX`]).
pub fn parse_timing(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > TIMING_MAX {
        return Err(format!("{s:?} is longer than a day"));
    }
    Ok(d)
}

/// Longest timing flag: a day. Anything longer is a typo, and bounding it keeps arithmetic on
/// the value (three heartbeats, twice the election timeout) from overflowing.
pub const TIMING_MAX: Duration = Duration::from_secs(24 * 60 * 60);

/// A duration like `30s`, or a bare number of milliseconds (the unit of the flags that used to
/// be named `--NAME-ms` and still accept that name), in whole milliseconds and at most a day:
/// these are timings of the Raft core and of connections, which work in milliseconds.
pub fn parse_duration_or_ms(s: &str) -> Result<Duration, String> {
    let d = match s.trim().parse::<u64>() {
        Ok(ms) => Duration::from_millis(ms),
        Err(_) => parse_duration(s)?,
    };
    if d.subsec_nanos() % 1_000_000 != 0 {
        return Err(format!("{s:?} is not a whole number of milliseconds"));
    }
    if d > TIMING_MAX {
        return Err(format!("{s:?} is longer than a day"));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1m 30s"), Ok(Duration::from_secs(90)));
        let e = parse_duration("soon").unwrap_err();
        assert!(e.contains("\"soon\""), "{e}");
        assert!(parse_duration("250").is_err());
        assert_eq!(parse_duration_or_ms("250"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration_or_ms("2s"), Ok(Duration::from_secs(2)));
        assert!(parse_duration_or_ms("-5").is_err());
        let e = parse_duration_or_ms("500us").unwrap_err();
        assert!(e.contains("whole number of milliseconds"), "{e}");
        let e = parse_duration_or_ms("200000000000y").unwrap_err();
        assert!(e.contains("\"200000000000y\""), "{e}");
        assert!(parse_duration_or_ms("25h").is_err());
        assert_eq!(parse_duration_or_ms("24h"), Ok(TIMING_MAX));
        assert_eq!(parse_timing("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_timing("500000000000y").is_err());
        assert!(parse_timing("2d").is_err());
    }
}
