//! The configuration file (`--config PATH` or `OUTBOXD_CONFIG`, TOML; docs/configuration.md).
//! Its keys are the long flags with `_` for `-` (`source_file`, `window`, `routing_key`), found
//! by walking clap's command tree, so every flag works in the file without a list to keep.
//! A key's value becomes the flag's environment variable when that variable is not set, which
//! gives the precedence flags > environment > file from clap itself. Keys at the top level are
//! shared by every command that takes the flag; a section named after a command (`[prune]`,
//! `[keys.retire]`) holds keys for that command alone, and wins over the top level for it — a
//! file serves several commands, and a flag two commands share need not mean the same to both.
//! Destructive confirmations (`yes`, `force`) are refused anywhere in the file: they are given
//! on the command line, for one run, never left in a file for every later one. Unknown keys
//! are refused with the closest valid name; secret values only by reference: a flag whose
//! environment value clap hides (`source`, `sink`) may not carry a password in the file, and
//! names that say secret (`password`, `token`, …) are refused unless they end in `_file`.

use crate::Error;
use clap::{Arg, Command};
use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A config file larger than this is refused before it is read whole.
const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// Environment variables this process took from the config file (for `outboxd config`).
static FROM_FILE: OnceLock<(PathBuf, HashSet<String>)> = OnceLock::new();

/// Flags that confirm or force a destructive step: never from the file (see the module doc).
const CONFIRMATIONS: &[&str] = &["yes", "force"];

/// Words that mark a key as a secret value (allowed only as a `*_file` reference).
const SECRET_WORDS: &[&str] = &["password", "passwd", "secret", "token", "passphrase"];

/// The config file named by `--config`/`--config=` in `argv` or by `OUTBOXD_CONFIG`.
pub fn path_from(argv: &[OsString]) -> Option<PathBuf> {
    let mut it = argv.iter().skip(1);
    while let Some(a) = it.next() {
        let Some(s) = a.to_str() else { continue };
        if s == "--" {
            break;
        }
        if s == "--config" {
            return it.next().map(PathBuf::from);
        }
        if let Some(p) = s.strip_prefix("--config=") {
            return Some(PathBuf::from(p));
        }
    }
    std::env::var_os("OUTBOXD_CONFIG")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Every long flag of `cmd` and its subcommands by config key (`source-file` → `source_file`).
fn keys(cmd: &Command) -> BTreeMap<String, Vec<Arg>> {
    fn walk(cmd: &Command, out: &mut BTreeMap<String, Vec<Arg>>) {
        for a in cmd.get_arguments() {
            if let Some(long) = a.get_long() {
                if matches!(long, "help" | "version") {
                    continue;
                }
                out.entry(long.replace('-', "_"))
                    .or_default()
                    .push(a.clone());
            }
        }
        for s in cmd.get_subcommands() {
            walk(s, out);
        }
    }
    let mut out = BTreeMap::new();
    walk(cmd, &mut out);
    out
}

fn refuse(path: &Path, problem: impl std::fmt::Display, fix: impl Into<String>) -> Error {
    Error::config(format!("config file {}: {problem}", path.display()), fix)
}

/// Whether a value holds a secret inline: a URL's password or token, or a secret parameter
/// (`password=`, …), as [`crate::dsn::redact`] knows them.
fn has_inline_password(v: &str) -> bool {
    crate::dsn::has_secret(v)
}

/// Reads the config file (if any) and sets, for each key that applies to the command `argv`
/// runs, its flag's environment variable unless the environment already has it. Call before
/// clap parses `argv`.
pub fn apply(cmd: &Command, argv: &[OsString]) -> Result<(), Error> {
    let Some(path) = path_from(argv) else {
        return Ok(());
    };
    let vars = load(cmd, &path, &invoked_path(cmd, argv))?;
    let mut taken = HashSet::new();
    for (env, value) in vars {
        if std::env::var_os(&env).is_none() {
            // Single-threaded here: main calls this before the runtime starts.
            std::env::set_var(&env, value);
            taken.insert(env);
        }
    }
    let _ = FROM_FILE.set((path, taken));
    Ok(())
}

/// The subcommand path `argv` runs (`["keys", "retire"]`), read the way clap will: options
/// that take a value skip it, the first word that is not a subcommand ends the path.
pub fn invoked_path(cmd: &Command, argv: &[OsString]) -> Vec<String> {
    let takes_value = |a: &Arg| {
        matches!(
            a.get_action(),
            clap::ArgAction::Set | clap::ArgAction::Append
        )
    };
    let mut path = Vec::new();
    let mut scope = cmd;
    let mut it = argv.iter().skip(1);
    while let Some(a) = it.next() {
        let Some(s) = a.to_str() else { break };
        if s == "--" {
            break;
        }
        if let Some(long) = s.strip_prefix("--") {
            if long.contains('=') {
                continue;
            }
            let arg = scope
                .get_arguments()
                .chain(cmd.get_arguments())
                .find(|a| a.get_long() == Some(long));
            if arg.is_some_and(takes_value) {
                it.next();
            }
            continue;
        }
        if s.starts_with('-') {
            continue;
        }
        match scope.find_subcommand(s) {
            Some(sub) => {
                path.push(sub.get_name().to_string());
                scope = sub;
            }
            None => break,
        }
    }
    path
}

/// The file's keys that apply to the command at `invoked` (a subcommand path; empty: the top
/// level only) as (environment variable, value) pairs. Every key of every section is checked,
/// whichever command runs, so a mistake shows on the first run.
pub fn load(
    cmd: &Command,
    path: &Path,
    invoked: &[String],
) -> Result<Vec<(String, String)>, Error> {
    let meta = std::fs::metadata(path).map_err(|e| {
        refuse(
            path,
            format!("cannot read it: {e}"),
            "check the path given to --config / OUTBOXD_CONFIG",
        )
    })?;
    if meta.len() > MAX_FILE_BYTES {
        return Err(refuse(
            path,
            format!(
                "{} bytes, more than the {MAX_FILE_BYTES} allowed",
                meta.len()
            ),
            "a config file holds flags only: keep it small",
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| {
        refuse(
            path,
            format!("cannot read it: {e}"),
            "check the file's permissions and that it is UTF-8",
        )
    })?;
    let doc: toml_edit::DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        refuse(
            path,
            format!("not valid TOML: {}", e.to_string().trim()),
            "write one `key = value` per line, e.g. window = 1000",
        )
    })?;
    // `outboxd config` shows `run`'s configuration: `[run]` is its section too.
    let invoked: Vec<String> = if invoked.first().is_some_and(|c| c == "config") {
        std::iter::once("run".to_string())
            .chain(invoked.iter().skip(1).cloned())
            .collect()
    } else {
        invoked.to_vec()
    };
    let leaf = invoked
        .iter()
        .try_fold(cmd, |c, name| c.find_subcommand(name));
    let mut out = BTreeMap::new();
    let file = File {
        root: cmd,
        path,
        invoked: &invoked,
        leaf,
    };
    file.section(cmd, &mut Vec::new(), doc.as_table(), &mut out)?;
    Ok(out
        .into_iter()
        .map(|(env, (_, value))| (env, value))
        .collect())
}

/// What one read of the file needs to know.
struct File<'a> {
    root: &'a Command,
    path: &'a Path,
    /// The subcommand path this process runs.
    invoked: &'a [String],
    /// That subcommand's definition (`None`: not a known path, so no section applies).
    leaf: Option<&'a Command>,
}

impl File<'_> {
    /// Reads one table: the top level (`at` empty) or the section of the command at `at`.
    /// Applying keys go to `out` by environment variable, with the depth that set them, so a
    /// command's section beats the top level whatever the order in the file.
    fn section(
        &self,
        scope: &Command,
        at: &mut Vec<String>,
        table: &toml_edit::Table,
        out: &mut BTreeMap<String, (usize, String)>,
    ) -> Result<(), Error> {
        let known = self.known_keys(scope, at.is_empty());
        let applies = self.leaf.is_some() && self.invoked.starts_with(at);
        for (key, item) in table.iter() {
            if let Some(sub) = item.as_table() {
                let Some(next) = scope.find_subcommand(key) else {
                    return Err(self.not_a_command(scope, at, key));
                };
                at.push(next.get_name().to_string());
                let r = self.section(next, at, sub, out);
                at.pop();
                r?;
                continue;
            }
            let key = self.accepted(&known, at, key, item)?;
            if applies {
                self.apply(key, at.len(), out);
            }
        }
        Ok(())
    }

    /// The keys a section may hold: the flags of its command (at the top level, of the root
    /// command), global flags (log_level) included, by their long name with '_' for '-'.
    fn known_keys(&self, scope: &Command, top: bool) -> BTreeMap<String, Vec<Arg>> {
        if top {
            return keys(self.root);
        }
        let mut k = keys(scope);
        for a in self.root.get_arguments().filter(|a| a.is_global_set()) {
            if let Some(long) = a.get_long() {
                k.entry(long.replace('-', "_")).or_default().push(a.clone());
            }
        }
        k
    }

    /// The refusal of a section `[at.key]` that names no subcommand of `scope`.
    fn not_a_command(&self, scope: &Command, at: &[String], key: &str) -> Error {
        let top = at.is_empty();
        let names: Vec<String> = scope
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .collect();
        let fix = match closest(key, names.iter()) {
            Some(n) => format!(
                "did you mean [{}]? (a section is named after a command: [prune], [keys.retire])",
                at.iter().chain([n]).cloned().collect::<Vec<_>>().join(".")
            ),
            None if names.is_empty() => format!(
                "{} has no subcommands: put its keys directly under [{}]",
                command(at),
                at.join(".")
            ),
            None => format!(
                "a section is named after a command ([prune], [keys.retire]); {} has: {}",
                if top {
                    "outboxd".to_string()
                } else {
                    command(at)
                },
                names.join(", ")
            ),
        };
        refuse(
            self.path,
            format!(
                "[{}] is not a command",
                at.iter()
                    .chain([&key.to_string()])
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(".")
            ),
            fix,
        )
    }

    /// Checks one `key = value` of the section at `at` against the flags it may set (`known`):
    /// returns what it sets, or the refusal with
    /// its fix (a nested file, a confirmation, an unknown or command-line-only flag, a secret
    /// inline).
    fn accepted<'k>(
        &self,
        known: &'k BTreeMap<String, Vec<Arg>>,
        at: &[String],
        key: &'k str,
        item: &toml_edit::Item,
    ) -> Result<Accepted<'k>, Error> {
        let path = self.path;
        let where_ = if at.is_empty() {
            String::new()
        } else {
            format!(" in [{}]", at.join("."))
        };
        if !item.is_value() {
            return Err(refuse(
                path,
                format!("{key:?}{where_} is neither a key nor a command's section"),
                "write key = value, or a [command] section (e.g. [prune])",
            ));
        }
        if key == "config" {
            return Err(refuse(
                path,
                "a config file cannot name another config file",
                "remove the config key",
            ));
        }
        if CONFIRMATIONS.contains(&key) {
            return Err(refuse(
                path,
                format!("{key:?}{where_} confirms a destructive step, which a file never does: it would apply to every later run"),
                format!("remove {key:?} from the file and pass --{key} on the command line of the one run it is meant for"),
            ));
        }
        let Some(args) = known.get(key) else {
            return Err(self.unknown_key(known, at, key, &where_));
        };
        let arg = &args[0];
        let long = arg.get_long().unwrap_or(key);
        if !args.iter().any(|a| a.get_env().is_some()) {
            return Err(refuse(
                path,
                format!("--{long} is a command-line-only flag"),
                format!("remove {key:?} from the file and pass --{long} on the command line"),
            ));
        }
        let lower = key.to_ascii_lowercase();
        let any_env = any_env(args);
        if SECRET_WORDS.iter().any(|w| lower.contains(w)) && !lower.ends_with("_file") {
            return Err(refuse(
                path,
                format!("{key:?} is a secret: the file may only refer to secrets"),
                format!("put it in a file named by {key}_file, or in the environment ({any_env})"),
            ));
        }
        let value = value_text(path, key, item, arg)?;
        if args.iter().any(|a| a.is_hide_env_values_set()) && has_inline_password(&value) {
            return Err(refuse(
                path,
                format!("{key:?} holds a password inline"),
                format!(
                    "remove the password from {key:?} and put it in a file named by {key}_file (the file may hold the whole DSN or only its password), or set {any_env} in the environment"
                ),
            ));
        }
        Ok(Accepted {
            long,
            value,
            any_env,
        })
    }

    /// The refusal of a key no flag of the section's command has, with the nearest name.
    fn unknown_key(
        &self,
        known: &BTreeMap<String, Vec<Arg>>,
        at: &[String],
        key: &str,
        where_: &str,
    ) -> Error {
        let top = at.is_empty();
        let underscored = key.replace('-', "_");
        let help = if top {
            "outboxd run --help".to_string()
        } else {
            format!("{} --help", command(at))
        };
        let fix = if known.contains_key(&underscored) {
            format!("write {underscored:?}: keys are the long flags with '_' for '-'")
        } else {
            match closest(key, known.keys()) {
                Some(k) => format!("did you mean {k:?}? (keys are the long flags with '_' for '-')"),
                None if top => format!("keys are the long flags with '_' for '-' ({help} lists them)"),
                None => format!("{} has no --{}: move the key to the section of the command that takes it ({help} lists this one's flags)", command(at), key.replace('_', "-")),
            }
        };
        refuse(self.path, format!("unknown key {key:?}{where_}"), fix)
    }

    /// Sets the running command's variable of the key's flag, unless a deeper section already
    /// set it.
    fn apply(&self, key: Accepted<'_>, depth: usize, out: &mut BTreeMap<String, (usize, String)>) {
        let Accepted {
            long,
            value,
            any_env,
        } = key;
        // The variable of the running command's own flag: two commands may give one flag
        // different variables. A key the running command does not take sets nothing (a
        // top-level key of another command; the file serves them all).
        let own = self
            .leaf
            .into_iter()
            .flat_map(|l| l.get_arguments())
            .chain(self.root.get_arguments())
            .find(|a| a.get_long() == Some(long))
            .and_then(|a| a.get_env());
        let env = match own {
            Some(e) => e.to_string_lossy().into_owned(),
            // No command named (`load` for the top level alone): the flag's variable.
            None if self.invoked.is_empty() => any_env,
            None => return,
        };
        if out.get(&env).is_none_or(|(d, _)| *d <= depth) {
            out.insert(env, (depth, value));
        }
    }
}

/// A key a section may hold: its flag's long name, its value as the flag's environment text,
/// and the first variable any flag of that name reads.
struct Accepted<'k> {
    long: &'k str,
    value: String,
    any_env: String,
}

/// `outboxd <at…>`, for messages.
fn command(at: &[String]) -> String {
    format!("outboxd {}", at.join(" "))
}

/// The first environment variable any of `args` reads (empty when none does).
fn any_env(args: &[Arg]) -> String {
    args.iter()
        .find_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// A TOML value as the flag's environment text: strings as they are, numbers and booleans
/// as written, arrays joined with the flag's delimiter.
fn value_text(path: &Path, key: &str, item: &toml_edit::Item, arg: &Arg) -> Result<String, Error> {
    use toml_edit::Value as V;
    let scalar = |v: &V| -> Option<String> {
        Some(match v {
            V::String(s) => s.value().clone(),
            V::Integer(i) => i.value().to_string(),
            V::Float(f) => f.value().to_string(),
            V::Boolean(b) => b.value().to_string(),
            _ => return None,
        })
    };
    let Some(v) = item.as_value() else {
        return Err(refuse(
            path,
            format!("{key:?} is a table; the file is flat"),
            format!("write {key} = <value> at the top level"),
        ));
    };
    if let V::Array(a) = v {
        let parts: Option<Vec<String>> = a.iter().map(scalar).collect();
        let Some(parts) = parts else {
            return Err(refuse(
                path,
                format!("{key:?}: an array of nested values"),
                "use an array of strings",
            ));
        };
        return match arg.get_value_delimiter() {
            Some(d) => Ok(parts.join(&d.to_string())),
            None if parts.len() == 1 => Ok(parts.into_iter().next().unwrap_or_default()),
            None => Err(refuse(
                path,
                format!("{key:?} takes one value"),
                format!("write {key} = \"…\""),
            )),
        };
    }
    scalar(v).ok_or_else(|| {
        refuse(
            path,
            format!("{key:?} has a value of a kind flags do not take"),
            "use a string, a number or true/false",
        )
    })
}

/// The valid key nearest to a misspelt one (if any is near).
fn closest<'a>(key: &str, known: impl Iterator<Item = &'a String>) -> Option<&'a String> {
    known
        .map(|k| (strsim::jaro_winkler(key, k), k))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

/// Where a value of `outboxd config` came from.
fn origin(m: &clap::ArgMatches, arg: &Arg) -> &'static str {
    use clap::parser::ValueSource;
    match m.value_source(arg.get_id().as_str()) {
        Some(ValueSource::CommandLine) => "flag",
        Some(ValueSource::EnvVariable) => {
            let from_file = FROM_FILE.get().is_some_and(|(_, vars)| {
                arg.get_env()
                    .is_some_and(|e| vars.contains(&*e.to_string_lossy()))
            });
            if from_file {
                "file"
            } else {
                "env"
            }
        }
        Some(ValueSource::DefaultValue) => "default",
        _ => "unset",
    }
}

/// `outboxd config`: the effective value of every flag of `cmd` (a subcommand's definition)
/// as a config file would write it, with where it came from; secret values redacted.
pub fn render_effective(cmd: &Command, m: &clap::ArgMatches) -> String {
    let mut out = String::new();
    if let Some((path, _)) = FROM_FILE.get() {
        out.push_str(&format!("# config file: {}\n", path.display()));
    }
    out.push_str("# effective configuration of `outboxd run` (flag > env > file > default)\n");
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "version" | "config") {
            continue;
        }
        let key = long.replace('-', "_");
        let id = arg.get_id().as_str();
        let values: Vec<String> = m
            .get_raw(id)
            .map(|vs| vs.map(|v| v.to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let origin = origin(m, arg);
        if values.is_empty() {
            let flag = matches!(
                arg.get_action(),
                clap::ArgAction::SetTrue | clap::ArgAction::SetFalse
            );
            if flag {
                out.push_str(&format!("{key} = false  # {origin}\n"));
            } else {
                out.push_str(&format!("# {key} (not set)\n"));
            }
            continue;
        }
        // A secret named by its key is hidden whole; a DSN (its environment variable's value
        // hidden from `--help`) shows all but its secrets.
        let secret = SECRET_WORDS
            .iter()
            .any(|w| key.contains(w) && !key.ends_with("_file"));
        let dsn = arg.is_hide_env_values_set();
        let show = |v: &str| -> String {
            let v = if secret {
                "***".to_string()
            } else if dsn {
                crate::dsn::redact(v)
            } else {
                v.to_string()
            };
            toml_string(&v)
        };
        let flag = matches!(
            arg.get_action(),
            clap::ArgAction::SetTrue | clap::ArgAction::SetFalse
        );
        let rendered = if flag {
            m.get_flag(id).to_string()
        } else if matches!(arg.get_action(), clap::ArgAction::Append) || values.len() > 1 {
            format!(
                "[{}]",
                values
                    .iter()
                    .map(|v| show(v))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            show(&values[0])
        };
        out.push_str(&format!("{key} = {rendered}  # {origin}\n"));
    }
    out
}

/// A TOML basic string (JSON's string escapes are TOML's).
fn toml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn write(text: &str) -> tempfile::NamedTempFile {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn keys_map_to_environment_variables() {
        let f = write(
            "source_file = \"/run/secrets/dsn\"\nwindow = 7\ntable = [\"a\", \"b\"]\nha = true\nrouting_key = \"{topic}\"\n",
        );
        let vars = load(&crate::commands::Cli::command(), f.path(), &[]).unwrap();
        let get = |k: &str| vars.iter().find(|(e, _)| e == k).map(|(_, v)| v.as_str());
        assert_eq!(get("OUTBOXD_SOURCE_FILE"), Some("/run/secrets/dsn"));
        assert_eq!(get("OUTBOXD_WINDOW"), Some("7"));
        assert_eq!(get("OUTBOXD_TABLE"), Some("a,b"));
        assert_eq!(get("OUTBOXD_HA"), Some("true"));
        assert_eq!(get("OUTBOXD_ROUTING_KEY"), Some("{topic}"));
    }

    #[test]
    fn a_commands_section_applies_to_that_command_alone_and_beats_the_top_level() {
        let cmd = crate::commands::Cli::command();
        let f = write(
            "table = \"shared\"\nbatch = 5\n[prune]\nbatch = 100\n[keys.retire]\ntable = \"retire_only\"\n[run]\nwindow = 9\n",
        );
        let vars = |argv: &[&str]| -> Vec<(String, String)> {
            let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
            let invoked = invoked_path(&cmd, &argv);
            load(&cmd, f.path(), &invoked).unwrap()
        };
        let get = |vars: &[(String, String)], k: &str| {
            vars.iter().find(|(e, _)| e == k).map(|(_, v)| v.clone())
        };
        let retire = vars(&[
            "outboxd",
            "--log-level",
            "debug",
            "keys",
            "retire",
            "k1",
            "--keys",
            "x",
        ]);
        assert_eq!(
            get(&retire, "OUTBOXD_TABLE").as_deref(),
            Some("retire_only")
        );
        assert_eq!(
            get(&retire, "OUTBOXD_BATCH"),
            None,
            "retire takes no --batch"
        );
        assert_eq!(get(&retire, "OUTBOXD_WINDOW"), None, "[run] is run's");
        let prune = vars(&["outboxd", "prune", "--older-than", "7d"]);
        assert_eq!(get(&prune, "OUTBOXD_BATCH").as_deref(), Some("100"));
        let reencrypt = vars(&["outboxd", "reencrypt"]);
        assert_eq!(get(&reencrypt, "OUTBOXD_BATCH").as_deref(), Some("5"));
        assert_eq!(get(&reencrypt, "OUTBOXD_TABLE").as_deref(), Some("shared"));
        let config = vars(&["outboxd", "config", "--config", "f"]);
        assert_eq!(get(&config, "OUTBOXD_WINDOW").as_deref(), Some("9"));
        assert_eq!(
            invoked_path(
                &cmd,
                &["outboxd", "--config", "keys", "keys", "list"].map(OsString::from)
            ),
            ["keys", "list"]
        );
    }

    #[test]
    fn unknown_dashed_secret_and_inline_password_keys_are_refused() {
        let cmd = crate::commands::Cli::command();
        for (text, needle) in [
            ("windw = 3", "did you mean \"window\""),
            ("source-file = \"/x\"", "write \"source_file\""),
            ("source = \"postgres://u:hunter2@db/app\"", "source_file"),
            ("sink = \"amqp://u:hunter2@mq/\"", "sink_file"),
            ("lsn = \"0/1\"", "command-line-only"),
            ("[runn]\nwindow = 3", "did you mean [run]?"),
            ("[run]\nwindw = 3", "did you mean \"window\""),
            (
                "[prune]\nexchange = \"x\"",
                "outboxd prune has no --exchange",
            ),
            ("yes = true", "pass --yes on the command line"),
            (
                "[keys.retire]\nforce = true",
                "pass --force on the command line",
            ),
            ("window = ", "not valid TOML"),
        ] {
            let f = write(text);
            let e = load(&cmd, f.path(), &[]).unwrap_err().to_string();
            assert!(e.contains(needle), "{text}: {e}");
            assert!(!e.contains("hunter2"), "{text}: {e}");
        }
        // A DSN without a password is fine in the file.
        let f = write("source = \"postgres://relay@db/app\"");
        assert!(load(&cmd, f.path(), &[]).is_ok());
    }
}
