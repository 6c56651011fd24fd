//! docker-compose.yml and the Dockerfile as a user with Docker would run them. No Docker engine
//! runs here: `docker-compose config` (Debian's docker-compose package, installed by
//! scripts/services.sh) validates the file with and without the `mysql8` profile, and the
//! Dockerfile is checked statically (every COPY source exists, the binaries it installs are the
//! crate's, the healthchecks call a subcommand the binary has).

use crate::common;

use common::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn compose(args: &[&str]) -> String {
    let out = Command::new("docker-compose")
        .current_dir(ROOT)
        .args(["-f", "docker-compose.yml"])
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "docker-compose cannot run ({e}): install it with `sudo scripts/services.sh` (or `sudo apt-get install -y docker-compose`)"
            )
        });
    assert!(
        out.status.success(),
        "docker-compose {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The resolved configuration as JSON: docker-compose prints YAML, read here with the PyYAML
/// docker-compose itself runs on (a dependency of Debian's package).
fn config_json(args: &[&str]) -> serde_json::Value {
    let yaml = compose(args);
    let mut py = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 (docker-compose's interpreter)");
    use std::io::Write;
    py.stdin.take().unwrap().write_all(yaml.as_bytes()).unwrap();
    let out = py.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "docker-compose config printed no YAML"
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn services(profile: Option<&str>) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(p) = profile {
        args.extend(["--profile", p]);
    }
    args.extend(["config", "--services"]);
    compose(&args).lines().map(str::to_string).collect()
}

#[test]
fn compose_config_is_valid_with_and_without_the_mysql8_profile() {
    let doc = config_json(&["config"]);
    let default = services(None);
    for s in [
        "postgres",
        "mariadb",
        "rabbitmq",
        "outboxd-postgres",
        "outboxd-mariadb",
        "consumer-setup",
        "consumer",
    ] {
        assert!(default.iter().any(|x| x == s), "service {s} in {default:?}");
    }
    let with = services(Some("mysql8"));
    for s in ["mysql8", "outboxd-mysql8"] {
        assert!(with.iter().any(|x| x == s), "service {s} in {with:?}");
    }
    let full = config_json(&["--profile", "mysql8", "config"]);

    // Healthchecks everywhere but the consumer (it serves no endpoint, see the file); the
    // relays' through `outboxd health` (/readyz).
    for (name, svc) in full["services"].as_object().unwrap() {
        if name.starts_with("consumer") {
            continue;
        }
        let test = &svc["healthcheck"]["test"];
        assert!(!test.is_null(), "{name} has a healthcheck");
        if name.starts_with("outboxd-") {
            let t: Vec<&str> = test
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|v| v.as_str())
                .collect();
            assert_eq!(
                &t[..3],
                ["CMD", "/usr/local/bin/outboxd", "health"],
                "{name}"
            );
            assert!(
                svc["command"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|v| v.as_str() == Some("--metrics-addr")),
                "{name} serves /readyz"
            );
        }
    }
    // docker-compose 1.x lists every service in `config`; the profile keeps MySQL 8 out of a
    // plain `up`.
    for (name, svc) in full["services"].as_object().unwrap() {
        let profiles = svc["profiles"].as_array().cloned().unwrap_or_default();
        if name.contains("mysql8") {
            assert_eq!(
                profiles,
                ["mysql8"],
                "{name} runs only with --profile mysql8"
            );
        } else {
            assert!(profiles.is_empty(), "{name} runs by default");
        }
    }
    for name in ["mysql8", "outboxd-mysql8"] {
        assert_eq!(
            full["services"][name]["labels"]["outboxd.support"].as_str(),
            Some("proven on binlog fixtures only"),
            "{name} is labelled"
        );
    }
    let my8: Vec<&str> = full["services"]["mysql8"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    for opt in ["--gtid-mode=ON", "--binlog-row-metadata=FULL"] {
        assert!(my8.contains(&opt), "mysql8 runs with {opt}");
    }
    assert_eq!(
        full["services"]["mysql8"]["image"].as_str(),
        Some("mysql:8.4")
    );
    let rabbit = doc["services"]["rabbitmq"]["image"].as_str().unwrap();
    assert!(rabbit.ends_with("-management"), "{rabbit}");
    // A supported RabbitMQ release: 3.13 or 4.x.
    let tag = rabbit.trim_start_matches("rabbitmq:");
    assert!(
        tag.starts_with("3.13") || tag.starts_with("4"),
        "compose runs RabbitMQ {tag}: use a supported release (3.13 or 4.x)"
    );

    // Every file a service mounts exists.
    for (name, svc) in full["services"].as_object().unwrap() {
        for v in svc["volumes"].as_array().into_iter().flatten() {
            let src = match v {
                serde_json::Value::String(s) => s.split(':').next().unwrap().to_string(),
                other => other["source"].as_str().unwrap_or_default().to_string(),
            };
            assert!(
                Path::new(&src).exists(),
                "{name} mounts {src}, which does not exist"
            );
        }
    }
}

#[test]
fn dockerfile_copies_what_exists_and_installs_the_crates_binaries() {
    let dockerfile = std::fs::read_to_string(Path::new(ROOT).join("Dockerfile")).unwrap();
    let manifest = std::fs::read_to_string(Path::new(ROOT).join("Cargo.toml")).unwrap();
    let targets = manifest_targets(&manifest);
    let bin = targets
        .iter()
        .find(|(kind, _, _)| kind == "bin")
        .map(|(_, name, _)| name.clone())
        .expect("a [[bin]] in Cargo.toml");
    let stages = dockerfile
        .lines()
        .filter(|l| l.trim_start().starts_with("FROM "))
        .count();
    assert!(stages >= 2, "multi-stage: {stages} FROM lines");
    let runtime = dockerfile
        .lines()
        .rfind(|l| l.trim_start().starts_with("FROM "))
        .unwrap();
    assert!(
        runtime.contains("distroless") || runtime.contains("slim"),
        "small runtime image: {runtime}"
    );
    for line in dockerfile.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("COPY ") else {
            continue;
        };
        if rest.starts_with("--from=") {
            continue;
        }
        let parts: Vec<&str> = rest.split_whitespace().collect();
        for src in &parts[..parts.len() - 1] {
            assert!(
                Path::new(ROOT).join(src).exists(),
                "COPY {src}: no such file in the repository"
            );
        }
    }
    // Every path a [[bench]] / [[bin]] target names must be copied, or `cargo build` refuses
    // the manifest.
    for (kind, name, path) in &targets {
        let path = path.clone().unwrap_or_else(|| format!("benches/{name}.rs"));
        let top = path.split('/').next().unwrap();
        assert!(
            dockerfile.contains(&format!("COPY {top} ")),
            "{kind} {path}: its directory {top} is not copied into the build stage"
        );
    }
    assert!(
        dockerfile.contains(&format!("--bin {bin}"))
            && dockerfile.contains(&format!("target/release/{bin} ")),
        "the Dockerfile builds and installs the binary {bin}"
    );
    assert!(
        dockerfile.contains(&format!("ENTRYPOINT [\"/usr/local/bin/{bin}\"]")),
        "the entrypoint is {bin}"
    );
    let example = "invoice_projection";
    assert!(Path::new(ROOT)
        .join(format!("examples/{example}.rs"))
        .exists());
    assert!(dockerfile.contains(&format!("--example {example}")));

    // The healthcheck's subcommand exists in this binary.
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["health", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "outboxd health --help");
}

/// `outboxd health`, the relays' healthcheck: exit 1 with the reason while nothing answers,
/// 0 once the relay is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_probes_readyz() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let t = Duration::from_secs(60);
    let mut down = Relay::start(&["health", "--addr", &addr]);
    assert_eq!(down.wait_exit(t).await, 1, "nothing listens yet");
    assert!(
        down.stderr_plain().contains("cannot connect"),
        "{}",
        down.stderr()
    );

    let db = PgDb::create("health").await;
    let dsn = db.dsn();
    let relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        "health",
        "--commit-offsets",
        "--metrics-addr",
        &addr,
    ]);
    wait_for("outboxd health to pass", t, || async {
        let mut probe = Relay::start(&["health", "--addr", &addr]);
        probe.wait_exit(t).await == 0 && probe.lines().iter().any(|l| l.starts_with("ok   /readyz"))
    })
    .await;
    let mut live = Relay::start(&["health", "--addr", &addr, "--path", "/healthz"]);
    assert_eq!(live.wait_exit(t).await, 0, "{}", live.stderr());
    relay.signal("TERM");
}

/// `[[bin]]` / `[[bench]]` targets of a Cargo manifest: (kind, name, path when given).
fn manifest_targets(manifest: &str) -> Vec<(String, String, Option<String>)> {
    let mut out: Vec<(String, String, Option<String>)> = Vec::new();
    let mut kind: Option<String> = None;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            kind = line
                .strip_prefix("[[")
                .and_then(|l| l.strip_suffix("]]"))
                .filter(|k| *k == "bin" || *k == "bench")
                .map(str::to_string);
            if let Some(k) = &kind {
                out.push((k.clone(), String::new(), None));
            }
            continue;
        }
        let (Some(_), Some((key, value))) = (&kind, line.split_once('=')) else {
            continue;
        };
        let value = value.trim().trim_matches('"').to_string();
        let last = out.last_mut().expect("pushed at the header");
        match key.trim() {
            "name" => last.1 = value,
            "path" => last.2 = Some(value),
            _ => {}
        }
    }
    out
}
