//! Logging on stderr, as text or JSON lines, with levels from `RUST_LOG`.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::os::fd::AsFd;
use std::sync::Arc;

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
///
/// Lines go to a copy of stderr's descriptor taken here, not to descriptor 2: libpg_query (in
/// fence-proxy) points descriptor 2 at a pipe of its own for the length of every parse, so a
/// line any thread wrote meanwhile would vanish into that pipe, and two parses at once on two
/// threads can leave descriptor 2 pointing at another parse's pipe for good.
pub fn init_tracing(format: LogFormat, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(LogSink::of_stderr())
        .with_ansi(ansi);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Where log lines go: the descriptor stderr had when logging started (or stderr itself, if it
/// could not be copied).
#[derive(Clone)]
struct LogSink(Option<Arc<File>>);

impl LogSink {
    fn of_stderr() -> LogSink {
        LogSink(
            std::io::stderr()
                .as_fd()
                .try_clone_to_owned()
                .ok()
                .map(|fd| Arc::new(File::from(fd))),
        )
    }
}

impl Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &self.0 {
            Some(file) => (&**file).write(buf),
            None => std::io::stderr().write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &self.0 {
            Some(file) => (&**file).flush(),
            None => std::io::stderr().flush(),
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogSink {
    type Writer = LogSink;

    fn make_writer(&'a self) -> LogSink {
        self.clone()
    }
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
