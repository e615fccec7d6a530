//! `--config FILE`: flag values from a TOML file, for lockd and fence-proxy.
//!
//! A key is a long flag's name without the dashes (`heartbeat = "250ms"`, `peer = ["1=a:7001",
//! "2=b:7001"]`, `insecure-plaintext = true`); the flags of a subcommand go in a table named
//! after it (`[dev]`, `[http]`, `[postgres]`). Values are checked by the flag's own parser, so
//! they take the same forms as on the command line. The file only supplies defaults: a flag on
//! the command line wins, then its environment variable, then the file, then the built-in
//! default. An unknown key or a bad value stops the program with an error naming the file and
//! the key.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The flag that names the file.
pub const FLAG: &str = "config";

/// The file named by `--config FILE` or `--config=FILE` in `argv`, else by the environment
/// variable `env`. Only looks; the binary's clap definition declares the flag itself, so that
/// `--help` shows it and the parse accepts it.
pub fn path_from(argv: &[OsString], env: &str) -> Option<PathBuf> {
    let long = format!("--{FLAG}");
    let with_value = format!("--{FLAG}=");
    let mut words = argv.iter().skip(1);
    while let Some(word) = words.next() {
        // Past `--` every word belongs to a command being run (lockctl hold), not to us.
        if word == "--" {
            break;
        }
        if *word == *long {
            return words.next().map(PathBuf::from);
        }
        if let Some(value) = word.to_str().and_then(|w| w.strip_prefix(&with_value)) {
            return Some(PathBuf::from(value));
        }
    }
    std::env::var_os(env)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Why the command line of a binary with `--config` could not be read.
#[derive(Debug)]
pub enum ParseError {
    /// A bad flag, or `--help`/`--version` (clap prints those and exits as usual).
    Flags(clap::Error),
    /// The config file is missing, not TOML, or has an unknown key or a bad value.
    Config(String),
}

/// Parses `argv` as `C`, with the flag values of the `--config` file (or of the file the
/// environment variable `env` names) as defaults.
pub fn parse<C: clap::Parser>(argv: Vec<OsString>, env: &str) -> Result<C, ParseError> {
    let mut cmd = C::command();
    if let Some(path) = path_from(&argv, env) {
        cmd = apply(cmd, &path).map_err(ParseError::Config)?;
    }
    cmd.try_get_matches_from(argv)
        .and_then(|m| C::from_arg_matches(&m))
        .map_err(ParseError::Flags)
}

/// `cmd` with the values of the TOML file at `path` as its flags' defaults.
pub fn apply(cmd: clap::Command, path: &Path) -> Result<clap::Command, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--config {}: cannot read it: {e}", path.display()))?;
    apply_text(cmd, &text, &path.display().to_string())
}

/// [`apply`] on the file's text; `file` names it in errors.
pub fn apply_text(cmd: clap::Command, text: &str, file: &str) -> Result<clap::Command, String> {
    let doc = toml_edit::Document::parse(text)
        .map_err(|e| format!("--config {file}: not TOML: {}", one_line(&e.to_string())))?;
    apply_table(cmd, doc.as_table(), file, "")
}

/// Sets the defaults of `cmd` from `table`; `at` is the table's name in errors (`""` for the
/// file's top level, `"dev."` inside `[dev]`).
fn apply_table(
    mut cmd: clap::Command,
    table: &toml_edit::Table,
    file: &str,
    at: &str,
) -> Result<clap::Command, String> {
    for (key, item) in table.iter() {
        let name = format!("{at}{key}");
        if let Some(sub) = item.as_table() {
            if cmd.find_subcommand(key).is_none() {
                return Err(format!(
                    "--config {file}: unknown table [{name}] ({})",
                    known_tables(&cmd)
                ));
            }
            let mut result = Ok(());
            cmd = cmd.mut_subcommand(key, |s| {
                match apply_table(s.clone(), sub, file, &format!("{name}.")) {
                    Ok(s) => s,
                    Err(e) => {
                        result = Err(e);
                        s
                    }
                }
            });
            result?;
            continue;
        }
        let Some(arg) = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(key) && !matches!(key, "help" | "version" | FLAG))
            .cloned()
        else {
            return Err(format!(
                "--config {file}: unknown key {name:?} ({})",
                known_keys(&cmd, at)
            ));
        };
        let values = values(item).map_err(|why| format!("--config {file}: {name}: {why}"))?;
        if values.len() > 1 && !takes_many(&arg) {
            return Err(format!(
                "--config {file}: {name}: --{key} takes one value, the file gives {}",
                values.len()
            ));
        }
        // Each value through the flag's own parser now, so that a bad one is named with the
        // file and the key (clap would later report a bad default without either).
        let probe = clap::Arg::new("value")
            .long(key.to_owned())
            .value_parser(arg.get_value_parser().clone());
        for value in &values {
            clap::Command::new("--config")
                .no_binary_name(true)
                .disable_help_flag(true)
                .arg(probe.clone())
                .try_get_matches_from([format!("--{key}={value}")])
                .map_err(|e| {
                    format!(
                        "--config {file}: {name} = {value:?}: {}",
                        one_line(&e.to_string())
                    )
                })?;
        }
        // A required flag the file gives is no longer required on the command line.
        cmd = cmd.mut_arg(arg.get_id().clone(), |a| {
            a.required(false).default_values(values.clone())
        });
    }
    Ok(cmd)
}

/// Whether `arg` keeps several values (a repeatable flag or a list).
fn takes_many(arg: &clap::Arg) -> bool {
    matches!(arg.get_action(), clap::ArgAction::Append)
        || arg.get_num_args().is_some_and(|n| n.max_values() > 1)
}

/// A TOML value as the command-line words it stands for.
fn values(item: &toml_edit::Item) -> Result<Vec<String>, String> {
    let scalar = |v: &toml_edit::Value| -> Result<String, String> {
        Ok(match v {
            toml_edit::Value::String(s) => s.value().clone(),
            toml_edit::Value::Integer(i) => i.value().to_string(),
            toml_edit::Value::Float(f) => f.value().to_string(),
            toml_edit::Value::Boolean(b) => b.value().to_string(),
            toml_edit::Value::Datetime(d) => d.value().to_string(),
            toml_edit::Value::Array(_) | toml_edit::Value::InlineTable(_) => {
                return Err("a list or table inside a list is not a flag value".to_owned());
            }
        })
    };
    match item.as_value() {
        Some(toml_edit::Value::Array(list)) => list.iter().map(scalar).collect(),
        Some(toml_edit::Value::InlineTable(_)) | None => {
            Err("a table is not a flag value (subcommands' flags go in [NAME] tables)".to_owned())
        }
        Some(v) => Ok(vec![scalar(v)?]),
    }
}

/// The keys `cmd` accepts, for an error.
fn known_keys(cmd: &clap::Command, at: &str) -> String {
    let keys: Vec<&str> = cmd
        .get_arguments()
        .filter_map(clap::Arg::get_long)
        .filter(|l| !matches!(*l, "help" | "version" | FLAG))
        .collect();
    if keys.is_empty() {
        return format!("[{}] takes no keys", at.trim_end_matches('.'));
    }
    format!("known keys: {}", keys.join(", "))
}

/// The tables `cmd` accepts, for an error.
fn known_tables(cmd: &clap::Command) -> String {
    let names: Vec<&str> = cmd
        .get_subcommands()
        .map(clap::Command::get_name)
        .filter(|n| *n != "help")
        .collect();
    if names.is_empty() {
        return "this command takes no tables".to_owned();
    }
    format!("known tables: {}", names.join(", "))
}

/// An error text on one line.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn sample() -> Command {
        Command::new("sample")
            .arg(Arg::new("config").long("config"))
            .arg(
                Arg::new("id")
                    .long("id")
                    .required(true)
                    .value_parser(clap::value_parser!(u64)),
            )
            .arg(Arg::new("peer").long("peer").action(ArgAction::Append))
            .arg(
                Arg::new("plain")
                    .long("plain")
                    .action(ArgAction::SetTrue)
                    .env("SAMPLE_PLAIN_FOR_TEST"),
            )
            .arg(Arg::new("mode").long("mode").default_value("a"))
            .subcommand(Command::new("dev").arg(Arg::new("host").long("host")))
    }

    fn parse(file: &str, argv: &[&str]) -> Result<clap::ArgMatches, String> {
        let cmd = apply_text(sample(), file, "s.toml")?;
        cmd.try_get_matches_from(argv).map_err(|e| e.to_string())
    }

    #[test]
    fn the_file_supplies_defaults_and_flags_win() {
        let file =
            "id = 7\npeer = [\"1=a\", \"2=b\"]\nplain = true\nmode = \"b\"\n[dev]\nhost = \"h\"\n";
        let m = parse(file, &["sample"]).unwrap();
        assert_eq!(m.get_one::<u64>("id"), Some(&7));
        let peers: Vec<&String> = m.get_many("peer").unwrap().collect();
        assert_eq!(peers, ["1=a", "2=b"]);
        assert!(m.get_flag("plain"));
        assert_eq!(m.get_one::<String>("mode").unwrap(), "b");

        let m = parse(
            file,
            &["sample", "--id", "9", "--peer", "3=c", "--mode", "c"],
        )
        .unwrap();
        assert_eq!(m.get_one::<u64>("id"), Some(&9));
        let peers: Vec<&String> = m.get_many("peer").unwrap().collect();
        assert_eq!(peers, ["3=c"]);
        assert_eq!(m.get_one::<String>("mode").unwrap(), "c");

        let m = parse(file, &["sample", "dev"]).unwrap();
        let (_, dev) = m.subcommand().unwrap();
        assert_eq!(dev.get_one::<String>("host").unwrap(), "h");

        // Without the file the flag is still required.
        assert!(parse("", &["sample"]).is_err());
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let e = parse("hartbeat = 1", &["sample"]).unwrap_err();
        assert!(e.contains("s.toml") && e.contains("\"hartbeat\""), "{e}");
        assert!(e.contains("known keys: id, peer, plain, mode"), "{e}");
        let e = parse("id = \"seven\"", &["sample"]).unwrap_err();
        assert!(e.contains("id = \"seven\"") && e.contains("s.toml"), "{e}");
        let e = parse("id = [1, 2]", &["sample"]).unwrap_err();
        assert!(e.contains("takes one value"), "{e}");
        let e = parse("[prod]\nhost = \"h\"", &["sample"]).unwrap_err();
        assert!(
            e.contains("[prod]") && e.contains("known tables: dev"),
            "{e}"
        );
        let e = parse("[dev]\nid = 1", &["sample"]).unwrap_err();
        assert!(
            e.contains("\"dev.id\"") && e.contains("known keys: host"),
            "{e}"
        );
        let e = parse("id = ", &["sample"]).unwrap_err();
        assert!(e.contains("not TOML"), "{e}");
        let e = parse("config = \"other.toml\"", &["sample"]).unwrap_err();
        assert!(e.contains("unknown key \"config\""), "{e}");
    }

    #[test]
    fn the_path_comes_from_the_flag_or_the_environment() {
        let argv = |w: &[&str]| -> Vec<OsString> { w.iter().map(OsString::from).collect() };
        let unset = "LOCKD_SERVICE_KIT_TEST_UNSET_CONFIG";
        assert_eq!(
            path_from(&argv(&["b", "--config", "x.toml"]), unset),
            Some(PathBuf::from("x.toml"))
        );
        assert_eq!(
            path_from(&argv(&["b", "http", "--config=y.toml"]), unset),
            Some(PathBuf::from("y.toml"))
        );
        assert_eq!(
            path_from(
                &argv(&["b", "hold", "r", "--", "x", "--config", "z"]),
                unset
            ),
            None
        );
        assert_eq!(path_from(&argv(&["b"]), unset), None);
    }
}
