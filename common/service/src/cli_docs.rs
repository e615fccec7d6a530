//! Shell completions and manual pages generated from a binary's clap definition, so that they
//! always match its flags: `<binary> completions SHELL` prints a completion script and
//! `<binary> man [--out-dir DIR]` prints the manual page or writes one page per command.

use std::io::Write;
use std::path::{Path, PathBuf};

pub use clap_complete::Shell;

/// The two documentation commands every binary has; flatten it into the binary's subcommands
/// (`#[command(flatten)] Docs(DocsCommand)`).
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DocsCommand {
    /// Print a shell completion script on stdout (for example `completions bash >
    /// /etc/bash_completion.d/NAME`).
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: Shell,
    },
    /// Print the manual page (roff) on stdout, or write one page per command into --out-dir.
    Man {
        /// Write `<binary>.1` and one `<binary>-<command>.1` per command into DIR (created if
        /// missing) and print the files' names, instead of printing the main page.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<PathBuf>,
    },
}

impl DocsCommand {
    /// Runs the command for the binary whose clap definition is `cmd`. The error is one line,
    /// for the binary to print after its name.
    pub fn run(&self, mut cmd: clap::Command) -> Result<(), String> {
        let name = cmd.get_name().to_owned();
        match self {
            DocsCommand::Completions { shell } => {
                let mut out = Vec::new();
                clap_complete::generate(*shell, &mut cmd, name.clone(), &mut out);
                write_stdout(&out).map_err(|e| format!("writing to stdout: {e}"))
            }
            DocsCommand::Man { out_dir: None } => {
                let mut out = Vec::new();
                clap_mangen::Man::new(cmd)
                    .render(&mut out)
                    .map_err(|e| format!("rendering the manual page: {e}"))?;
                write_stdout(&out).map_err(|e| format!("writing to stdout: {e}"))
            }
            DocsCommand::Man { out_dir: Some(dir) } => {
                let files = write_man_pages(cmd, dir)
                    .map_err(|e| format!("writing manual pages into {}: {e}", dir.display()))?;
                let list: String = files.iter().map(|f| format!("{}\n", f.display())).collect();
                write_stdout(list.as_bytes()).map_err(|e| format!("writing to stdout: {e}"))
            }
        }
    }
}

/// Writes `<name>.1` for `cmd` and `<name>-<sub>[-<subsub>].1` for every visible subcommand
/// into `dir`, and returns the files written, main page first.
pub fn write_man_pages(cmd: clap::Command, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    // clap's `help` subcommand gets no page; building gives each subcommand its full display
    // name (`lockctl-keys-list`, the page's name) and the parent's global flags.
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    // Every page names the program and version it documents (subcommands have no version).
    let source = format!(
        "{} {}",
        cmd.get_name(),
        cmd.get_version().unwrap_or_default()
    );
    let mut written = Vec::new();
    write_pages(cmd, &source, dir, &mut written)?;
    Ok(written)
}

/// The page of `cmd`, then its visible subcommands' pages.
fn write_pages(
    cmd: clap::Command,
    source: &str,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> std::io::Result<()> {
    let subcommands: Vec<clap::Command> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .cloned()
        .collect();
    written.push(clap_mangen::Man::new(cmd).source(source).generate_to(dir)?);
    for sub in subcommands {
        write_pages(sub, source, dir, written)?;
    }
    Ok(())
}

/// Writes `bytes` to stdout; a closed pipe (`| head`) is not an error.
fn write_stdout(bytes: &[u8]) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> clap::Command {
        clap::Command::new("sample")
            .version("1.2")
            .about("A sample tool.")
            .arg(clap::Arg::new("verbose").long("verbose").help("Say more."))
            .subcommand(
                clap::Command::new("keys")
                    .about("Keys.")
                    .subcommand(clap::Command::new("list").about("List them.")),
            )
            .subcommand(clap::Command::new("hidden").hide(true))
    }

    #[test]
    fn one_page_per_visible_command() {
        let dir = tempfile::tempdir().unwrap();
        let files = write_man_pages(sample(), dir.path()).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["sample.1", "sample-keys.1", "sample-keys-list.1"]);
        let page = std::fs::read_to_string(dir.path().join("sample-keys-list.1")).unwrap();
        assert!(
            page.contains(".TH sample-keys-list 1  \"sample 1.2\""),
            "{page}"
        );
        assert!(page.contains("sample\\-keys\\-list"), "{page}");
        assert!(page.contains("List them."), "{page}");
    }
}
