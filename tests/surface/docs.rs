//! The documentation stays true: every flag a command's `--help` lists is documented in
//! `docs/`, and `--help` never shows a secret taken from the environment.

use std::process::Command;
use std::time::Duration;

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .arg("--help")
        .env("OUTBOXD_SOURCE", "postgres://u:hunter2-secret@h/db")
        .output()
        .expect("run outboxd");
    assert!(out.status.success(), "{args:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

fn flags(text: &str) -> Vec<String> {
    let mut v: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2 && w.as_bytes()[2].is_ascii_lowercase())
        .map(str::to_string)
        .collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn every_flag_is_documented() {
    let docs: String = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/docs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "md"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    let commands: &[&[&str]] = &[
        &["run"],
        &["fleet"],
        &["fleet", "status"],
        &["setup"],
        &["check"],
        &["status"],
        &["teardown"],
        &["offset", "set"],
        &["offset", "show"],
        &["health"],
    ];
    let mut missing = Vec::new();
    for cmd in commands {
        let text = help(cmd);
        assert!(
            !text.contains("hunter2-secret"),
            "{cmd:?} --help shows a secret"
        );
        for f in flags(&text) {
            if f == "--help" || f == "--version" {
                continue;
            }
            if !docs.contains(&format!("`{f}`")) && !docs.contains(&format!("`{f} ")) {
                missing.push(format!("{} {f}", cmd.join(" ")));
            }
        }
    }
    assert!(missing.is_empty(), "flags missing from docs/: {missing:?}");
}

/// Every command whose flags the docs describe (`keys` and `offset` by their subcommands).
const COMMANDS: &[&[&str]] = &[
    &["run"],
    &["fleet"],
    &["fleet", "status"],
    &["config"],
    &["setup"],
    &["teardown"],
    &["check"],
    &["status"],
    &["offset", "show"],
    &["offset", "set"],
    &["health"],
    &["topology"],
    &["keys", "generate"],
    &["keys", "rotate"],
    &["keys", "list"],
    &["keys", "retire"],
    &["keys", "blind-index"],
    &["keys", "forget"],
    &["encrypt"],
    &["decrypt"],
    &["reencrypt"],
    &["prune"],
];

/// The flags without their own `OUTBOXD_<FLAG>` variable, as docs/configuration.md ("Global
/// flags") states them: (command, flag, the variable it reads instead).
const NO_OWN_VARIABLE: &[(&str, &str, Option<&str>)] = &[
    ("teardown", "--yes", None),
    ("offset set", "--lsn", None),
    ("offset set", "--replay-since", None),
    ("offset set", "--binlog-position", None),
    ("offset set", "--offset-file", None),
    ("health", "--addr", Some("OUTBOXD_METRICS_ADDR")),
    ("fleet status", "--addr", Some("OUTBOXD_METRICS_ADDR")),
    ("health", "--path", None),
];

/// `--help`'s options: each long flag with the variable clap says it reads (`[env: NAME=…]`).
fn flags_and_variables(help: &str) -> Vec<(String, Option<String>)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let t = line.trim_start();
        let indented = line.len() - t.len() >= 2;
        let flag = t
            .strip_prefix("-")
            .and_then(|r| r.split_once(", ").map(|(_, f)| f))
            .filter(|f| f.starts_with("--"))
            .or_else(|| t.strip_prefix("--").map(|_| t));
        match flag {
            Some(f) if indented => {
                let name = f.split([' ', '<', '=']).next().unwrap().to_string();
                out.push((name, String::new()));
            }
            _ => {
                if let Some(last) = out.last_mut() {
                    last.1.push_str(line);
                }
            }
        }
    }
    out.into_iter()
        .filter(|(f, _)| f != "--help" && f != "--version")
        .map(|(f, text)| {
            let env = text
                .split_once("[env: ")
                .map(|(_, r)| r.split(['=', ']']).next().unwrap().to_string());
            (f, env)
        })
        .collect()
}

/// "Every flag has an `OUTBOXD_<FLAG>` variable" holds for every flag of every command, but for
/// the exceptions docs/configuration.md names, each of which reads what it says.
#[test]
fn every_flag_reads_its_variable_but_the_documented_exceptions() {
    let config = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    let mut wrong = Vec::new();
    let mut seen_exceptions = Vec::new();
    for cmd in COMMANDS {
        let name = cmd.join(" ");
        let flags = flags_and_variables(&help(cmd));
        assert!(flags.len() >= 4, "{name}: no flags parsed from --help");
        for (flag, env) in flags {
            let own = format!(
                "OUTBOXD_{}",
                flag.trim_start_matches("--")
                    .replace('-', "_")
                    .to_uppercase()
            );
            let expected = match NO_OWN_VARIABLE
                .iter()
                .find(|(c, f, _)| *c == name && *f == flag)
            {
                Some((_, _, instead)) => {
                    seen_exceptions.push((name.clone(), flag.clone()));
                    instead.map(str::to_string)
                }
                None => Some(own),
            };
            if env != expected {
                wrong.push(format!(
                    "{name} {flag}: reads {env:?}, expected {expected:?}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "flags and their variables: {wrong:#?}");
    for (cmd, flag, _) in NO_OWN_VARIABLE {
        assert!(
            seen_exceptions.iter().any(|(c, f)| c == cmd && f == flag),
            "{cmd} {flag} is no longer a flag: drop it from the exceptions"
        );
        assert!(
            config.contains(&format!("`{cmd} {flag}`")),
            "docs/configuration.md does not name the exception `{cmd} {flag}`"
        );
    }
}

/// Every flag a table of docs/configuration.md lists (its first column) is a flag of the binary.
#[test]
fn every_flag_in_the_configuration_tables_exists() {
    let config = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    let mut known: Vec<String> = COMMANDS
        .iter()
        .flat_map(|c| flags_and_variables(&help(c)))
        .map(|(f, _)| f)
        .collect();
    known.sort();
    known.dedup();
    let mut unknown = Vec::new();
    for line in config.lines().filter(|l| l.starts_with("| `--")) {
        let first = line.split('|').nth(1).unwrap_or("");
        for f in flags(first) {
            if !known.contains(&f) {
                unknown.push(f);
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "documented flags the binary does not have: {unknown:?}"
    );
}

/// The metrics table of docs/configuration.md ("Metrics and health") is what a running relay
/// serves: every family `/metrics` declares is a row with its type, and every row is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_table_is_what_a_relay_serves() {
    use crate::common::*;
    let config = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/configuration.md"
    ))
    .unwrap();
    let section = config
        .split("## Metrics and health")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("the metrics section");
    // `| `name_total{cause}`, `other` | counter | …`: each name with its type.
    let mut documented: Vec<(String, String)> = Vec::new();
    for line in section.lines().filter(|l| l.starts_with("| `")) {
        let cols: Vec<&str> = line.split('|').map(str::trim).collect();
        for name in cols[1].split(',') {
            let name = name.trim().trim_matches('`');
            let name = name.split('{').next().unwrap();
            documented.push((name.to_string(), cols[2].to_string()));
        }
    }
    documented.sort();

    let db = PgDb::create("metricsdoc").await;
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let dsn = db.dsn();
    let name = unique("r");
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--metrics-addr",
        &addr,
    ]);
    wait_for(
        "the relay's /metrics",
        Duration::from_secs(60),
        || async move { scrape_metrics(port).await.contains("# TYPE") },
    )
    .await;
    let body = scrape_metrics(port).await;
    // OpenMetrics declares a counter without its `_total`, which each sample carries.
    let mut served: Vec<(String, String)> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE outboxd_"))
        .map(|l| {
            let (name, kind) = l.split_once(' ').unwrap();
            let name = match kind {
                "counter" => format!("{name}_total"),
                _ => name.to_string(),
            };
            (name, kind.to_string())
        })
        .collect();
    served.sort();

    // docs/operations.md's samples are the binary's: the same series, the same status lines.
    let ops = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let block_after = |marker: &str| -> Vec<String> {
        let after = ops.split(marker).nth(1).expect(marker);
        let body = after.split("```text\n").nth(1).unwrap();
        body.split("\n```")
            .next()
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    };
    let series = |lines: Vec<String>| -> Vec<String> {
        let mut v: Vec<String> = lines
            .iter()
            .filter(|l| l.starts_with("outboxd_") && !l.contains("_bucket"))
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    let live: Vec<String> = body.lines().map(str::to_string).collect();
    assert_eq!(
        series(block_after("`/metrics` (`--metrics-addr`) of that relay")),
        series(live),
        "docs/operations.md's /metrics sample against /metrics"
    );
    let labels = |lines: Vec<String>| -> Vec<String> {
        lines
            .iter()
            .map(|l| l.get(..17).unwrap_or(l).trim().to_string())
            .collect()
    };
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["status", "--source", &dsn, "--name", &name])
        .output()
        .expect("run outboxd status");
    let status: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(
        labels(block_after("`outboxd status` while a relay runs")),
        labels(status),
        "docs/operations.md's status sample against outboxd status"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(60)).await, 0);
    assert!(served.len() >= 20, "{body}");
    assert_eq!(
        documented, served,
        "docs/configuration.md's metrics table against /metrics"
    );
}

/// Every `x-source-position` example in docs/ is what the relay sends: the zero-padded form
/// (`00000000/016B3748:0000000003`), never a short one.
#[test]
fn source_position_examples_are_the_padded_form() {
    let mut wrong = Vec::new();
    for entry in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "md") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for line in text.lines().filter(|l| l.contains("x-source-position")) {
            for token in line.split(|c: char| c.is_whitespace() || "`(),=".contains(c)) {
                let Some((lsn, index)) = token.rsplit_once(':') else {
                    continue;
                };
                let (Some(lsn), Ok(index)) = (outboxd::event::parse_lsn(lsn), index.parse::<u32>())
                else {
                    continue;
                };
                let sent = outboxd::SourcePosition::Pg {
                    commit_lsn: lsn,
                    index,
                }
                .to_string();
                if token != sent {
                    wrong.push(format!("{}: {token} (sent as {sent})", path.display()));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}
