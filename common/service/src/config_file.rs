//! `--config FILE`: flag values from a TOML file, for lockd and fence-proxy.
//!
//! A key is a long flag's name (or an alias of it) without the dashes (`heartbeat = "250ms"`,
//! `peer = ["1=a:7001", "2=b:7001"]`, `insecure-plaintext = true`); the flags of a subcommand go
//! in a table named after it (`[dev]`, `[http]`, `[postgres]`), and global flags stay at the top.
//! Values are checked by the flag's own parser, so they take the same forms as on the command
//! line. The file only supplies what the command line and the environment leave out: a flag on
//! the command line wins, then its environment variable, then the file, then the built-in
//! default. A `true` in the file for an on/off flag can be undone only by its environment
//! variable (`=false`), as such flags have no `--no-...` form.
//!
//! How: a first, lenient parse finds the subcommand and which flags the command line and the
//! environment set; the file's values for the others then join the command line as words, and
//! the real parse checks them exactly like typed ones (flags that need each other, conflicts,
//! required flags). Values as defaults would skip those checks: a TLS certificate without its
//! key would silently mean no TLS.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::flag_errors::one_line;
use crate::redact::connection_string as redact;

/// The flag that names the file.
pub const FLAG: &str = "config";

/// The file named by `--config FILE` or `--config=FILE` in `argv`, else by the environment
/// variable `env`. Only looks; the binary's clap definition declares the flag itself, so that
/// `--help` shows it and the parse accepts it.
pub fn path_from(argv: &[OsString], env: &str) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let long = format!("--{FLAG}");
    let with_value = format!("--{FLAG}=");
    let mut words = argv.iter().skip(1);
    while let Some(word) = words.next() {
        // Past `--` every word belongs to a command being run, not to us.
        if word == "--" {
            break;
        }
        if *word == *long {
            return words.next().map(PathBuf::from);
        }
        if let Some(value) = word.as_bytes().strip_prefix(with_value.as_bytes()) {
            return Some(PathBuf::from(std::ffi::OsStr::from_bytes(value)));
        }
    }
    std::env::var_os(env)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// `argv` without `--config FILE` / `--config=FILE` (read already): given before a subcommand
/// it would count as an argument of the top-level command, which some binaries do not allow
/// together with a subcommand.
fn without_config_flag(argv: Vec<OsString>) -> Vec<OsString> {
    use std::os::unix::ffi::OsStrExt;
    let long = format!("--{FLAG}");
    let with_value = format!("--{FLAG}=");
    let mut out = Vec::with_capacity(argv.len());
    let mut words = argv.into_iter();
    let mut rest_is_literal = false;
    while let Some(word) = words.next() {
        if rest_is_literal || out.is_empty() {
            out.push(word);
            continue;
        }
        if word == "--" {
            rest_is_literal = true;
            out.push(word);
        } else if word == *long {
            words.next();
        } else if !word.as_bytes().starts_with(with_value.as_bytes()) {
            out.push(word);
        }
    }
    out
}

/// Why the command line of a binary with `--config` could not be read.
#[derive(Debug)]
pub enum ParseError {
    /// A bad flag, or `--help`/`--version` (clap prints those and exits as usual).
    Flags(clap::Error),
    /// The config file is missing, not TOML, or has an unknown key or a bad value.
    Config(String),
}

/// One flag's values from the file.
#[derive(Clone, Debug)]
struct Setting {
    /// The subcommand whose table holds it; `None` for the top level.
    table: Option<String>,
    id: clap::Id,
    long: String,
    /// An on/off flag: `true` adds `--long`, `false` nothing.
    switch: bool,
    global: bool,
    values: Vec<String>,
}

/// Parses `argv` as `C`, with the flag values of the `--config` file (or of the file the
/// environment variable `env` names) for the flags the command line and environment leave out.
pub fn parse<C: clap::Parser>(argv: Vec<OsString>, env: &str) -> Result<C, ParseError> {
    let Some(path) = path_from(&argv, env) else {
        return C::try_parse_from(argv).map_err(ParseError::Flags);
    };
    let settings = match read(&C::command(), &path) {
        Ok(settings) => settings,
        // A broken file must not hide the help or the version.
        Err(_)
            if argv
                .iter()
                .skip(1)
                .any(|w| w.to_str().is_some_and(|w| HELP_OR_VERSION.contains(&w))) =>
        {
            Vec::new()
        }
        Err(e) => return Err(ParseError::Config(e)),
    };
    let argv = without_config_flag(argv);
    let typed = argv.len();
    let argv = with_file_words(C::command(), argv, &settings);
    let from_file = argv.len() > typed;
    C::command()
        .try_get_matches_from(argv)
        .and_then(|m| C::from_arg_matches(&m))
        .map_err(|e| match e.kind() {
            // Say where a flag the user never typed came from.
            clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                ParseError::Flags(e)
            }
            _ if from_file => ParseError::Config(format!(
                "{} (with flag values from --config {})",
                one_line(&e.to_string()),
                path.display()
            )),
            _ => ParseError::Flags(e),
        })
}

/// Words that ask for the help or the version.
const HELP_OR_VERSION: [&str; 4] = ["--help", "-h", "--version", "-V"];

/// `argv` with the words of the settings that apply: those of the top level and of the
/// subcommand being run, for flags neither the command line nor the environment set.
fn with_file_words(cmd: clap::Command, argv: Vec<OsString>, settings: &[Setting]) -> Vec<OsString> {
    // Lenient: only the subcommand and the sources are wanted here; the real parse reports
    // any error (help and version included).
    let Ok(matches) = cmd.ignore_errors(true).try_get_matches_from(&argv) else {
        return argv;
    };
    let sub = matches.subcommand();
    let explicit = |m: &clap::ArgMatches, id: &clap::Id| {
        matches!(
            m.value_source(id.as_str()),
            Some(clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable)
        )
    };
    let words = |s: &Setting| -> Vec<OsString> {
        if s.switch {
            s.values
                .iter()
                .filter(|v| v.as_str() == "true")
                .map(|_| OsString::from(format!("--{}", s.long)))
                .collect()
        } else {
            s.values
                .iter()
                .map(|v| OsString::from(format!("--{}={v}", s.long)))
                .collect()
        }
    };
    let mut top = Vec::new();
    let mut tail = Vec::new();
    for s in settings {
        match (&s.table, sub) {
            // A top-level flag: only without a subcommand, unless it is global.
            (None, None) => {
                if !explicit(&matches, &s.id) {
                    tail.extend(words(s));
                }
            }
            (None, Some((_, sub_matches))) => {
                if s.global && !explicit(sub_matches, &s.id) && !explicit(&matches, &s.id) {
                    top.extend(words(s));
                }
            }
            (Some(table), Some((name, sub_matches))) if table == name => {
                if !explicit(sub_matches, &s.id) {
                    tail.extend(words(s));
                }
            }
            (Some(_), _) => {}
        }
    }
    // Top-level words right after the program's name; the rest at the end, before a `--`.
    let mut out: Vec<OsString> = Vec::with_capacity(argv.len() + top.len() + tail.len());
    let mut argv = argv.into_iter();
    out.extend(argv.next());
    out.extend(top);
    let rest: Vec<OsString> = argv.collect();
    let literal = rest.iter().position(|w| w == "--").unwrap_or(rest.len());
    out.extend(rest[..literal].iter().cloned());
    out.extend(tail);
    out.extend(rest[literal..].iter().cloned());
    out
}

/// The settings of the TOML file at `path` for `cmd`, each value checked.
fn read(cmd: &clap::Command, path: &Path) -> Result<Vec<Setting>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--config {}: cannot read it: {e}", path.display()))?;
    read_text(cmd, &text, &path.display().to_string())
}

/// [`read`] on the file's text; `file` names it in errors.
fn read_text(cmd: &clap::Command, text: &str, file: &str) -> Result<Vec<Setting>, String> {
    let doc = toml_edit::Document::parse(text)
        .map_err(|e| format!("--config {file}: not TOML: {}", one_line(&e.to_string())))?;
    let mut settings = Vec::new();
    for (key, item) in doc.as_table().iter() {
        match item.as_table() {
            Some(table) => {
                let Some(sub) = cmd.find_subcommand(key) else {
                    return Err(format!(
                        "--config {file}: unknown table [{key}] ({})",
                        known_tables(cmd)
                    ));
                };
                // The table under the subcommand's own name, should it have been an alias.
                let table_name = sub.get_name();
                for (sub_key, sub_item) in table.iter() {
                    if sub_item.is_table() {
                        return Err(format!(
                            "--config {file}: [{key}.{sub_key}]: tables go one level deep"
                        ));
                    }
                    let global = cmd
                        .get_arguments()
                        .any(|a| a.is_global_set() && a.get_long() == Some(sub_key));
                    if global {
                        return Err(format!(
                            "--config {file}: {key}.{sub_key}: --{sub_key} is a global flag: put it at the top of the file, before any table"
                        ));
                    }
                    settings.push(setting(sub, Some(table_name), sub_key, sub_item, file)?);
                }
            }
            None => settings.push(setting(cmd, None, key, item, file)?),
        }
    }
    // A flag given twice (under its name and an alias) would be typed twice.
    for (i, a) in settings.iter().enumerate() {
        if settings[..i]
            .iter()
            .any(|b| b.table == a.table && b.id == a.id)
        {
            return Err(format!(
                "--config {file}: --{} is given twice (under its name and an alias)",
                a.long
            ));
        }
    }
    Ok(settings)
}

/// The setting of `key` in `cmd`'s table, its values checked by the flag's parser.
fn setting(
    cmd: &clap::Command,
    table: Option<&str>,
    key: &str,
    item: &toml_edit::Item,
    file: &str,
) -> Result<Setting, String> {
    let name = match table {
        Some(t) => format!("{t}.{key}"),
        None => key.to_owned(),
    };
    let Some(arg) = cmd.get_arguments().find(|a| {
        let long = a.get_long();
        !matches!(long, Some("help" | "version" | FLAG) | None)
            && (long == Some(key) || a.get_all_aliases().is_some_and(|al| al.contains(&key)))
    }) else {
        let prefix = table.map(|t| format!("{t}.")).unwrap_or_default();
        return Err(format!(
            "--config {file}: unknown key {name:?} ({})",
            known_keys(cmd, &prefix)
        ));
    };
    let values = values(item).map_err(|why| format!("--config {file}: {name}: {why}"))?;
    if values.is_empty() {
        return Err(format!(
            "--config {file}: {name}: an empty list gives no value (leave the key out)"
        ));
    }
    let long = arg.get_long().unwrap_or(key).to_owned();
    if values.len() > 1 && !takes_many(arg) {
        return Err(format!(
            "--config {file}: {name}: --{long} takes one value, the file gives {}",
            values.len()
        ));
    }
    // Each value through the flag's own parser now, so that a bad one is named with the file
    // and the key.
    let mut probe = clap::Arg::new("value")
        .long(long.clone())
        .value_parser(arg.get_value_parser().clone());
    if let Some(delimiter) = arg.get_value_delimiter() {
        probe = probe.value_delimiter(delimiter).num_args(1..);
    }
    for value in &values {
        clap::Command::new("--config")
            .no_binary_name(true)
            .disable_help_flag(true)
            .arg(probe.clone())
            .try_get_matches_from([format!("--{long}={value}")])
            .map_err(|e| {
                let shown = redact(value);
                format!(
                    "--config {file}: {name} = {shown:?}: {}",
                    one_line(&e.to_string().replace(value.as_str(), &shown))
                )
            })?;
    }
    Ok(Setting {
        table: table.map(str::to_owned),
        id: arg.get_id().clone(),
        long,
        switch: matches!(arg.get_action(), clap::ArgAction::SetTrue),
        global: arg.is_global_set(),
        values,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn sample() -> Command {
        Command::new("sample")
            .subcommand_negates_reqs(true)
            .arg(Arg::new("config").long("config"))
            .arg(
                Arg::new("id")
                    .long("id")
                    .alias("sample-alias")
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
            .arg(Arg::new("cert").long("cert").requires("key"))
            .arg(Arg::new("key").long("key"))
            .arg(Arg::new("glob").long("glob").global(true))
            .subcommand(Command::new("dev").arg(Arg::new("host").long("host")))
    }

    fn parse(file: &str, argv: &[&str]) -> Result<clap::ArgMatches, String> {
        let settings = read_text(&sample(), file, "s.toml")?;
        let argv = without_config_flag(argv.iter().map(OsString::from).collect());
        let argv = with_file_words(sample(), argv, &settings);
        sample()
            .try_get_matches_from(argv)
            .map_err(|e| e.to_string())
    }

    /// Goal: flags that need each other are checked with the file's values as with typed
    /// ones: a certificate without its key is refused, wherever each comes from.
    #[test]
    fn flags_that_need_each_other_are_checked() {
        let e = parse("id = 1\ncert = \"c.pem\"\n", &["sample"]).unwrap_err();
        assert!(e.contains("--key"), "{e}");
        let m = parse("id = 1\nkey = \"k.pem\"\n", &["sample", "--cert", "c.pem"]).unwrap();
        assert_eq!(m.get_one::<String>("key").unwrap(), "k.pem");
        let m = parse("id = 1\n", &["sample", "--config", "s.toml", "dev"]).unwrap();
        assert_eq!(m.subcommand_name(), Some("dev"));
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
        assert!(
            e.contains("known keys: id, peer, plain, mode, cert, key"),
            "{e}"
        );
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
        let e = parse("id = 1\nsample-alias = 2\n", &["sample"]).unwrap_err();
        assert!(e.contains("given twice"), "{e}");
        let e = parse("[dev]\nglob = \"x\"\n", &["sample"]).unwrap_err();
        assert!(e.contains("global flag: put it at the top"), "{e}");
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
