//! The library's public surface is a chosen list, not whatever happens to be `pub`. `src/lib.rs`
//! is read as text: its `pub mod`s and `pub use`s must be exactly [`ROOT_MODULES`] and
//! [`ROOT_USES`]; from there every `pub mod` reachable from outside the crate (following each
//! module's own `pub mod` declarations, inline ones included) must be in [`REACHABLE`]; and the
//! `pub` items of those modules must not outnumber [`PUB_ITEMS`]. A new public module fails here
//! until someone adds it to a list, which is the moment to ask whether it should be `pub(crate)`
//! instead, or go through `internal` (src/internal.rs) as one item. A module or item that left
//! the surface must leave the lists too, so that it cannot come back unnoticed.
//! `cargo test --test surface public -- --nocapture` prints what it found.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// lib.rs's `pub mod`s: the documented kits, then the hidden modules the binary's command
/// layer and the repository's tests, benches and fuzz targets name by path.
const ROOT_MODULES: &[&str] = &[
    // The kits services link (documented).
    "consumer",
    "crypto",
    "error",
    "event",
    "outbox",
    // Hidden: named by the binary and by tests, benches or fuzz targets.
    "dsn",
    "fleet",
    "fuzzing",
    "internal",
    "names",
    "pipeline",
    "relay",
    "sink",
    "source",
    "state",
    "stream",
    "telemetry",
    "tls",
];

/// lib.rs's `pub use` lines, as written (whitespace collapsed).
const ROOT_USES: &[&str] = &[
    "pub use error::{should_retry, Error, ErrorKind, ExitStatus, Result, ServerCode};",
    "pub use event::{Checkpoint, OutboxEvent, SourcePosition};",
    "pub use outbox::{ColumnMap, NewEvent, Outbox, OutboxBackend};",
    "pub use sink::{Delivery, Sink, SinkError};",
    "pub use state::{Lease, StateStore, Stored};",
    "pub use sink::memory::{MemoryHandle, MemorySink};",
    "pub use state::memory::{MemoryStore, MemoryStoreHandle};",
];

/// Every module below the root ones that code outside the crate can name.
const REACHABLE: &[&str] = &[
    "consumer::cli",
    "consumer::fault",
    "consumer::inbox",
    "consumer::key",
    "consumer::message",
    "consumer::mysql",
    "consumer::postgres",
    "consumer::processor",
    "consumer::prune",
    "consumer::runner",
    "consumer::runner::options",
    "consumer::setup",
    "crypto::blind",
    "crypto::envelope",
    "crypto::error",
    "crypto::keyring",
    "crypto::reencrypt",
    "crypto::schema",
    "crypto::shred",
    "fleet::members",
    "fleet::status",
    "internal::db",
    "internal::db::mysql",
    "internal::db::postgres",
    "internal::debezium",
    "internal::debezium::config",
    "internal::debezium::offset",
    "internal::diagnostics",
    "internal::progress",
    "internal::secret_file",
    "internal::values",
    "sink::format",
    "sink::headers",
    "sink::kafka",
    "sink::nats",
    "sink::options",
    "sink::partition",
    "sink::rabbitmq",
    "sink::rabbitmq_stream",
    "sink::stdout",
    "sink::template",
    "sink::topology",
    "source::mysql",
    "source::mysql::admin",
    "source::mysql::decode",
    "source::mysql::diagnostics",
    "source::mysql::file",
    "source::mysql::gtid",
    "source::mysql::hub",
    "source::mysql::log",
    "source::mysql::rows",
    "source::mysql::takeover",
    "source::mysql::xa_pin",
    "source::poll",
    "source::postgres",
    "source::postgres::admin",
    "source::postgres::diagnostics",
    "source::postgres::log",
    "source::postgres::pgoutput",
    "source::postgres::poll",
    "source::postgres::snapshot",
    "source::postgres::takeover",
    "source::postgres::tls_bridge",
    "source::postgres::version",
    "source::snapshot",
    "state::checkpoint",
    "state::file",
    "state::mysql",
    "state::postgres",
];

/// The most `pub` items (lines starting `pub ` in the reachable modules' files: functions,
/// types, fields, constants, re-exports) the surface may have. Lower it when the surface
/// shrinks; raising it is a choice to make in review.
// 1,265 when the list was made; 1,327 with the fleet (`fleet`, `fleet::members`,
// `fleet::status`: the binary and the fleet tests) and the shared binlog stream
// (`source::mysql::hub`: its tests and bench); 1,328 with `fleet::Hubs` (named by the
// `Tenant` trait a fleet's tests implement).
const PUB_ITEMS: usize = 1328;

fn strip_comments(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The file of module `path` (`source::mysql`), if it has one of its own.
fn module_file(path: &str) -> Option<PathBuf> {
    let rel = path.replace("::", "/");
    let src = Path::new(ROOT).join("src");
    [src.join(format!("{rel}.rs")), src.join(&rel).join("mod.rs")]
        .into_iter()
        .find(|p| p.exists())
}

/// The `pub mod` names declared at the top level of `text` (out-of-line or inline), each with
/// the text of its body when inline. Nested inline bodies are returned whole.
fn pub_mods(text: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    let bytes = text.as_bytes();
    while i < bytes.len() {
        match bytes[i] {
            b'{' => depth += 1,
            b'}' => depth = depth.saturating_sub(1),
            b'p' if depth == 0 && text[i..].starts_with("pub mod ") => {
                let at_line_start = text[..i]
                    .chars()
                    .rev()
                    .take_while(|c| *c != '\n')
                    .all(char::is_whitespace);
                if at_line_start {
                    let rest = &text[i + "pub mod ".len()..];
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    let after = rest[name.len()..].trim_start();
                    if after.starts_with('{') {
                        // The inline body, up to its matching brace.
                        let open = i + "pub mod ".len() + (rest.len() - after.len());
                        let mut d = 0usize;
                        let mut end = open;
                        for (j, c) in text[open..].char_indices() {
                            match c {
                                '{' => d += 1,
                                '}' => {
                                    d -= 1;
                                    if d == 0 {
                                        end = open + j;
                                        break;
                                    }
                                }
                                _ => {}
                            }
                        }
                        out.push((name, Some(text[open + 1..end].to_string())));
                        i = end + 1;
                        continue;
                    }
                    out.push((name, None));
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The `pub` items of `text` (lines starting `pub `, not `pub(crate)` and the like).
fn count_pub(text: &str) -> usize {
    text.lines()
        .filter(|l| l.trim_start().starts_with("pub "))
        .count()
}

/// The `pub` items of `text` outside its inline `pub mod` bodies (each counted as its own
/// module).
fn count_own_pub(text: &str) -> usize {
    let mut own = text.to_string();
    for (_, inline) in pub_mods(text) {
        if let Some(body) = inline {
            own = own.replacen(&body, "", 1);
        }
    }
    count_pub(&own)
}

/// Walks the public module tree below `path`, whose text is `text`.
fn walk(path: &str, text: &str, found: &mut BTreeSet<String>, items: &mut usize) {
    *items += count_own_pub(text);
    for (name, inline) in pub_mods(text) {
        let child = format!("{path}::{name}");
        found.insert(child.clone());
        let body = match inline {
            Some(body) => body,
            None => match module_file(&child) {
                Some(file) => strip_comments(&std::fs::read_to_string(file).unwrap()),
                None => panic!("no file for module {child}"),
            },
        };
        walk(&child, &body, found, items);
    }
}

fn lib() -> String {
    strip_comments(&std::fs::read_to_string(Path::new(ROOT).join("src/lib.rs")).unwrap())
}

#[test]
fn public_root_modules_and_reexports_are_the_curated_lists() {
    let lib = lib();
    let mods: BTreeSet<String> = pub_mods(&lib).into_iter().map(|(n, _)| n).collect();
    let want: BTreeSet<String> = ROOT_MODULES.iter().map(|s| s.to_string()).collect();
    println!("pub mods in lib.rs: {}", mods.len());
    assert_eq!(
        mods.difference(&want).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "new public modules in src/lib.rs: make them private (`mod x;`), re-export the few items the binary needs through src/internal.rs, or add them to ROOT_MODULES"
    );
    assert_eq!(
        want.difference(&mods).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "no longer public in src/lib.rs: remove them from ROOT_MODULES"
    );
    let uses: Vec<String> = lib
        .lines()
        .filter(|l| l.starts_with("pub use"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        uses, ROOT_USES,
        "src/lib.rs's `pub use` lines differ from ROOT_USES"
    );
}

#[test]
fn public_modules_below_the_root_are_the_curated_list() {
    let lib = lib();
    let mut found = BTreeSet::new();
    let mut items = count_own_pub(&lib);
    for (name, inline) in pub_mods(&lib) {
        let body = match inline {
            Some(body) => body,
            None => strip_comments(
                &std::fs::read_to_string(module_file(&name).expect("a root module's file"))
                    .unwrap(),
            ),
        };
        walk(&name, &body, &mut found, &mut items);
    }
    println!(
        "{} public modules below the root, {items} pub items in the public modules",
        found.len()
    );
    let want: BTreeSet<String> = REACHABLE.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        found.difference(&want).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "modules newly reachable from outside the crate: make them `pub(crate) mod` unless the binary or a test names them, then add them to REACHABLE"
    );
    assert_eq!(
        want.difference(&found).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "no longer reachable from outside the crate: remove them from REACHABLE"
    );
    assert!(
        items <= PUB_ITEMS,
        "{items} pub items in the public modules, more than the {PUB_ITEMS} allowed: make the new ones pub(crate) unless code outside the crate uses them"
    );
}

#[test]
fn public_module_parser_reads_inline_and_nested_modules() {
    let text = "pub mod a;\n    pub mod b {\n    pub mod c {\n        pub use x::y;\n    }\n}\npub(crate) mod d;\nmod e;\n";
    let mods = pub_mods(text);
    assert_eq!(
        mods.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["a", "b"]
    );
    let inner = pub_mods(mods[1].1.as_deref().unwrap());
    assert_eq!(inner.len(), 1);
    assert_eq!(inner[0].0, "c");
    assert_eq!(count_pub(inner[0].1.as_deref().unwrap()), 1);
    // `pub mod a;`, `pub mod b` and `pub mod c`; the `pub use` belongs to `c`.
    assert_eq!(count_own_pub(text), 2);
}
