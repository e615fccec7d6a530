//! Bad flags as one line on stderr, like every other error of these programs: clap's message
//! with its list of missing arguments and its tip ("a similar argument exists: '--listen'")
//! folded in, without the usage block, which `--help` shows.

use std::process::ExitCode;

use clap::error::ErrorKind;

/// Exit status of a command line that does not parse.
pub const USAGE_EXIT: u8 = 2;

/// How one program words its flag errors: `{prefix}{message}{suffix}`.
#[derive(Clone, Copy, Debug)]
pub struct FlagErrors {
    /// Starts every line, naming the program: `lockd: `, or `fence-proxy: error: `.
    pub prefix: &'static str,
    /// Ends every line, such as ` (see lockctl --help)`; empty for none.
    pub suffix: &'static str,
    /// Said instead of clap's whole help text when no subcommand was given.
    pub missing_command: &'static str,
}

impl FlagErrors {
    /// The line (without newline) that reports `e`.
    pub fn line(&self, e: &clap::Error) -> String {
        let message = match e.kind() {
            ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
                self.missing_command.to_owned()
            }
            _ => one_line(&e.render().to_string()),
        };
        format!("{}{message}{}", self.prefix, self.suffix)
    }

    /// Prints `--help` and `--version` as clap does (exit 0); any other error as [`Self::line`]
    /// on stderr (exit [`USAGE_EXIT`]).
    pub fn report(&self, e: clap::Error) -> ExitCode {
        if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        eprintln!("{}", self.line(&e));
        ExitCode::from(USAGE_EXIT)
    }
}

/// Folds clap's (or any multi-line) error text into one line: the message without its `error: `
/// prefix, the items of a list (the missing arguments) separated by commas, and clap's `tip:`
/// lines; the usage block and "For more information" are left out.
pub fn one_line(text: &str) -> String {
    let message = text
        .split("\n\nUsage:")
        .next()
        .unwrap_or(text)
        .split("\n\nFor more information")
        .next()
        .unwrap_or(text);
    let mut lines = message.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("invalid arguments");
    let mut folded = first.strip_prefix("error: ").unwrap_or(first).to_owned();
    // After a line ending in ':' clap lists one item per line ("--listen <ADDR>").
    let mut listing = folded.ends_with(':');
    let mut items = 0;
    for line in lines {
        if listing && !line.starts_with("tip:") {
            folded.push_str(if items == 0 { " " } else { ", " });
            folded.push_str(line);
            items += 1;
        } else {
            listing = false;
            folded.push(' ');
            folded.push_str(line);
        }
    }
    folded
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, Command};

    const LOCKD: FlagErrors = FlagErrors {
        prefix: "lockd: ",
        suffix: "",
        missing_command: "a command is required",
    };

    fn cmd() -> Command {
        Command::new("demo")
            .arg(Arg::new("listen").long("listen").required(true))
            .arg(Arg::new("data-dir").long("data-dir").required(true))
            .arg(
                Arg::new("id")
                    .long("id")
                    .value_parser(clap::value_parser!(u64)),
            )
    }

    fn error(args: &[&str]) -> clap::Error {
        cmd()
            .try_get_matches_from(std::iter::once("demo").chain(args.iter().copied()))
            .unwrap_err()
    }

    #[test]
    fn a_misspelt_flag_keeps_clap_s_tip() {
        let line = LOCKD.line(&error(&["--lisen", "x"]));
        assert_eq!(
            line,
            "lockd: unexpected argument '--lisen' found tip: a similar argument exists: '--listen'"
        );
    }

    #[test]
    fn missing_arguments_are_listed_with_commas() {
        let line = LOCKD.line(&error(&[]));
        assert_eq!(
            line,
            "lockd: the following required arguments were not provided: --listen <listen>, --data-dir <data-dir>"
        );
    }

    #[test]
    fn a_bad_value_names_it_without_the_help_hint() {
        let line = LOCKD.line(&error(&["--listen", "a", "--data-dir", "d", "--id", "x"]));
        assert_eq!(
            line,
            "lockd: invalid value 'x' for '--id <id>': invalid digit found in string"
        );
    }

    #[test]
    fn prefix_suffix_and_missing_command_frame_the_message() {
        let ctl = FlagErrors {
            prefix: "lockctl: ",
            suffix: " (see lockctl --help)",
            missing_command: "a command is required: acquire or release",
        };
        let e = Command::new("lockctl")
            .subcommand(Command::new("acquire"))
            .subcommand(Command::new("release"))
            .arg_required_else_help(true)
            .try_get_matches_from(["lockctl"])
            .unwrap_err();
        assert_eq!(
            ctl.line(&e),
            "lockctl: a command is required: acquire or release (see lockctl --help)"
        );
        let e = Command::new("lockctl")
            .subcommand(Command::new("acquire"))
            .subcommand_required(true)
            .try_get_matches_from(["lockctl"])
            .unwrap_err();
        assert_eq!(
            ctl.line(&e),
            "lockctl: a command is required: acquire or release (see lockctl --help)"
        );
    }

    #[test]
    fn every_report_is_one_line() {
        for args in [&[][..], &["--lisen", "x"], &["--bogus"], &["--id"]] {
            let line = LOCKD.line(&error(args));
            assert_eq!(line.lines().count(), 1, "{args:?}: {line:?}");
            assert!(!line.contains("Usage"), "{line}");
        }
    }

    #[test]
    fn plain_text_folds_too() {
        assert_eq!(
            one_line("opening the store: permission denied\n  caused by: EACCES\n"),
            "opening the store: permission denied caused by: EACCES"
        );
    }
}
