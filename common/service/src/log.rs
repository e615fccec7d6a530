//! Logging on stderr, as text or JSON lines, with levels from `RUST_LOG`.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Format of the log lines on stderr (the `--log-format` flag of `lockd` and `fence-proxy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    Text,
    /// One JSON object per line, for a log shipper.
    Json,
}

/// Installs the process's logger on stderr. Levels come from `RUST_LOG`; `default_filter` (an
/// `EnvFilter` directive such as `info,openraft=warn`, or `off`) applies when it is unset or
/// invalid.
///
/// Colours only when stderr is a terminal, so that journald and log files get plain text. A
/// second call (tests that start several services in one process) keeps the first logger.
pub fn init_tracing(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn formats_keep_their_flag_values() {
        let names: Vec<String> = LogFormat::value_variants()
            .iter()
            .map(|f| f.to_possible_value().unwrap().get_name().to_owned())
            .collect();
        assert_eq!(names, ["text", "json"]);
    }

    #[test]
    fn a_second_init_is_harmless() {
        init_tracing(LogFormat::Text, "off");
        init_tracing(LogFormat::Json, "info");
    }
}
