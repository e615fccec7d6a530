//! Durations on the command line, in every binary the same way: `30s`, `250ms`, `1m 30s`
//! (humantime's forms).

use std::time::Duration;

/// A duration like `30s` or `500ms`; the error names the value.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 30s or 500ms ({e})"))
}

/// A duration like `30s`, or a bare number of milliseconds: the form of flags that used to be
/// named `--NAME-ms` and still accept that name and its numbers.
pub fn parse_duration_or_ms(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<u64>() {
        Ok(ms) => Ok(Duration::from_millis(ms)),
        Err(_) => parse_duration(s),
    }
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
    }
}
