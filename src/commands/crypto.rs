//! The encryption commands (docs/encryption.md): `keys generate|rotate|list|retire|blind-index`,
//! `encrypt`, `decrypt` and `reencrypt`. The command enum in `commands/mod.rs` only names them.
//! Payloads and blind-index values come on stdin, never in argv (the process list is public);
//! output goes to stdout, diagnostics to stderr; key material is never printed.

use crate::crypto::keyring::KeyringFile;
use crate::crypto::shred::{self, Keystore};
use crate::crypto::{blind, reencrypt, schema::Schema, Encryptor, Keyring};
use crate::outbox::{ColumnMap, TableName};
use crate::progress::{Progress, Unit};
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Subcommand};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;
use zeroize::Zeroizing;

/// The largest stdin accepted (the relay's own message cap).
const MAX_STDIN: u64 = 16 * 1024 * 1024;

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a keyring file (mode 0600) with one encryption key and one blind-index key.
    /// Never overwrites a file. Back it up: losing the keyring loses the encrypted data.
    Generate(GenerateArgs),
    /// Add a new current key; old keys stay for decryption (`--blind-index`: rotate the
    /// blind-index key instead).
    Rotate(RotateArgs),
    /// List the keys (ids, status, dates; never key material) after checking every canary.
    List(KeyringArgs),
    /// Remove a previous key's material. Counts the rows still using it when --source is given;
    /// it cannot see messages queued in the broker nor what consumers stored.
    Retire(RetireArgs),
    /// Print the blind index of the value read on stdin: `<index key id> <hex>`.
    BlindIndex(BlindIndexArgs),
    /// Crypto-shredding: forget an aggregate's data key, erasing its encrypted fields
    /// everywhere they were copied (complete once WAL, binlogs and backups holding the key
    /// have rolled off).
    Forget(ForgetArgs),
}

/// The key table of per-aggregate data keys (crypto-shredding).
#[derive(Debug, Clone, Args)]
pub struct KeystoreArgs {
    /// Database holding the per-aggregate data keys (postgres://…); table outboxd_data_keys,
    /// created on first use.
    #[arg(long, env = "OUTBOXD_KEYSTORE", hide_env_values = true)]
    pub keystore: Option<crate::dsn::DsnArg>,
    /// File holding the keystore DSN, or only its password.
    #[arg(long, env = "OUTBOXD_KEYSTORE_FILE")]
    pub keystore_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct ForgetArgs {
    /// The aggregate whose data key is deleted.
    #[arg(long, env = "OUTBOXD_AGGREGATE")]
    pub aggregate: String,
    #[command(flatten)]
    pub keystore: KeystoreArgs,
    /// Outbox database, to verify first that every encrypted value of the aggregate is under
    /// its data key (postgres://…). Required: forgetting is refused while anything of the
    /// aggregate would still open.
    #[arg(long, env = "OUTBOXD_SOURCE", hide_env_values = true)]
    pub source: Option<crate::dsn::DsnArg>,
    /// File holding the source DSN, or only its password.
    #[arg(long, env = "OUTBOXD_SOURCE_FILE")]
    pub source_file: Option<PathBuf>,
    /// Outbox table.
    #[arg(long, env = "OUTBOXD_TABLE", default_value = "outbox")]
    pub table: String,
    /// Column renames (as for run).
    #[arg(long = "column", env = "OUTBOXD_COLUMN", value_delimiter = ';')]
    pub columns: Vec<String>,
    /// Schema file: fields it marks that are still clear in the aggregate's rows count as
    /// readable too.
    #[arg(long, env = "OUTBOXD_SCHEMA")]
    pub schema: Option<PathBuf>,
    /// Confirm: the aggregate's encrypted fields become unreadable for good.
    #[arg(long, env = "OUTBOXD_YES")]
    pub yes: bool,
    /// Then rewrite the key table (VACUUM FULL outboxd_data_keys, as its owner), so that the
    /// forgotten key's old row version leaves its pages; locks the key table while it runs.
    #[arg(long, env = "OUTBOXD_VACUUM")]
    pub vacuum: bool,
}

/// The keyring: a file, or (when not given) the JSON in OUTBOXD_KEYRING.
#[derive(Debug, Clone, Args)]
pub struct KeyringArgs {
    /// Keyring file (refused when group/world readable). Without it the keyring JSON is read
    /// from the environment variable OUTBOXD_KEYRING.
    #[arg(long, env = "OUTBOXD_KEYS")]
    pub keys: Option<PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct KeyringFileArgs {
    /// Keyring file.
    #[arg(long, env = "OUTBOXD_KEYS")]
    pub keys: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub file: KeyringFileArgs,
    /// Bytes kept of each blind-index HMAC (1–32; see docs/encryption.md for sizing).
    #[arg(long, env = "OUTBOXD_BLIND_INDEX_LENGTH", default_value_t = crate::crypto::keyring::DEFAULT_BLIND_LEN)]
    pub blind_index_length: usize,
}

#[derive(Debug, Clone, Args)]
pub struct RotateArgs {
    #[command(flatten)]
    pub file: KeyringFileArgs,
    /// Rotate the blind-index key instead of the encryption key (indexes must then be rebuilt).
    #[arg(long, env = "OUTBOXD_BLIND_INDEX")]
    pub blind_index: bool,
    /// With --blind-index: bytes kept of each HMAC under the new key (default: as the current).
    #[arg(long, env = "OUTBOXD_BLIND_INDEX_LENGTH")]
    pub blind_index_length: Option<usize>,
}

#[derive(Debug, Clone, Args)]
pub struct RetireArgs {
    /// The key id to retire (see keys list).
    pub id: String,
    #[command(flatten)]
    pub file: KeyringFileArgs,
    /// Outbox database to count the rows still using the key (postgres://…).
    #[arg(long, env = "OUTBOXD_SOURCE", hide_env_values = true)]
    pub source: Option<crate::dsn::DsnArg>,
    /// File holding the source DSN, or only its password.
    #[arg(long, env = "OUTBOXD_SOURCE_FILE")]
    pub source_file: Option<PathBuf>,
    /// Outbox table.
    #[arg(long, env = "OUTBOXD_TABLE", default_value = "outbox")]
    pub table: String,
    /// Column renames (as for run).
    #[arg(long = "column", env = "OUTBOXD_COLUMN", value_delimiter = ';')]
    pub columns: Vec<String>,
    /// Retire even though rows in the table still use the key, or a relay has not yet
    /// published the log up to now (they become unreadable).
    #[arg(long, env = "OUTBOXD_FORCE")]
    pub force: bool,
    /// With --source: how long to wait for every relay of the database to store a position
    /// past the log's head (events not yet published may carry the key).
    #[arg(long, env = "OUTBOXD_CATCH_UP_TIMEOUT", value_parser = crate::commands::parse_duration, default_value = "60s")]
    pub catch_up_timeout: std::time::Duration,
    /// Confirm: the key material is removed from the keyring file.
    #[arg(long, env = "OUTBOXD_YES")]
    pub yes: bool,
    /// Also count the per-aggregate data keys this key still wraps.
    #[command(flatten)]
    pub keystore: KeystoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct BlindIndexArgs {
    #[command(flatten)]
    pub keyring: KeyringArgs,
    /// The field: a top-level name (`tax_id`) or a JSON Pointer (`/customer/email`). The same
    /// value in two fields gives two different indexes.
    #[arg(long, env = "OUTBOXD_FIELD")]
    pub field: String,
    /// Normalisation steps, comma separated: trim, lowercase, digits, alnum, collapse-space,
    /// or none. Default: the schema's x-blind-index for the field, else trim.
    #[arg(long, env = "OUTBOXD_NORMALIZE")]
    pub normalize: Option<String>,
    /// Schema file, for the field's x-blind-index normalisation.
    #[arg(long, env = "OUTBOXD_SCHEMA")]
    pub schema: Option<PathBuf>,
    /// Bytes of the HMAC to print (default: the key's length).
    #[arg(long, env = "OUTBOXD_LENGTH")]
    pub length: Option<usize>,
    /// One line per blind-index key, current first (for searching during a re-index).
    #[arg(long, env = "OUTBOXD_ALL")]
    pub all: bool,
}

#[derive(Debug, Clone, Args)]
pub struct EncryptArgs {
    #[command(flatten)]
    pub keyring: KeyringArgs,
    /// Schema file marking the sensitive fields with "x-gdpr-sensitive": true.
    #[arg(long, env = "OUTBOXD_SCHEMA")]
    pub schema: PathBuf,
    /// The event id (UUID) the payload belongs to: the values are bound to it.
    #[arg(long, env = "OUTBOXD_EVENT_ID")]
    pub event_id: String,
    #[command(flatten)]
    pub keystore: KeystoreArgs,
    /// With --keystore: the event's aggregate, whose data key seals the fields.
    #[arg(long, env = "OUTBOXD_AGGREGATE")]
    pub aggregate: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct DecryptArgs {
    #[command(flatten)]
    pub keyring: KeyringArgs,
    /// The event id (UUID) the payload belongs to.
    #[arg(long, env = "OUTBOXD_EVENT_ID")]
    pub event_id: String,
    #[command(flatten)]
    pub keystore: KeystoreArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ReencryptArgs {
    /// Outbox database: postgres://user@host:5432/db (MySQL comes later).
    #[arg(long, env = "OUTBOXD_SOURCE", hide_env_values = true)]
    pub source: Option<crate::dsn::DsnArg>,
    /// File holding the source DSN, or only its password.
    #[arg(long, env = "OUTBOXD_SOURCE_FILE")]
    pub source_file: Option<PathBuf>,
    /// Outbox table (`schema.table`).
    #[arg(long, env = "OUTBOXD_TABLE", default_value = "outbox")]
    pub table: String,
    /// Column renames (as for run).
    #[arg(long = "column", env = "OUTBOXD_COLUMN", value_delimiter = ';')]
    pub columns: Vec<String>,
    #[command(flatten)]
    pub keyring: KeyringArgs,
    /// Schema file: clear fields it marks are encrypted too.
    #[arg(long, env = "OUTBOXD_SCHEMA")]
    pub schema: PathBuf,
    /// Rows per transaction.
    #[arg(long, env = "OUTBOXD_BATCH", default_value_t = 500)]
    pub batch: i64,
    /// Resume after this id (printed with every progress line).
    #[arg(long, env = "OUTBOXD_AFTER")]
    pub after: Option<Uuid>,
    /// Rewrite rows whose status is still `pending` too: for a table only CDC mode reads (it
    /// never changes the status). Without it pending rows are left for a later run, so that a
    /// poll relay never publishes an aggregate's later events first.
    #[arg(long, env = "OUTBOXD_INCLUDE_PENDING")]
    pub include_pending: bool,
    /// Also re-wrap the per-aggregate data keys of this keystore under the current key.
    #[command(flatten)]
    pub keystore: KeystoreArgs,
}

fn read_stdin(what: &str) -> Result<Zeroizing<Vec<u8>>, Error> {
    let mut buf = Zeroizing::new(Vec::new());
    std::io::stdin()
        .take(MAX_STDIN + 1)
        .read_to_end(&mut buf)
        .map_err(|e| Error::Other(format!("cannot read {what} from stdin: {e}")))?;
    if buf.len() as u64 > MAX_STDIN {
        return Err(Error::Other(format!(
            "{what} on stdin is larger than {MAX_STDIN} bytes"
        )));
    }
    Ok(buf)
}

fn parse_event_id(s: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(s.trim()).map_err(|_| {
        Error::config(
            format!("--event-id {s:?} is not a UUID"),
            "pass the outbox row's id, e.g. --event-id 0192f3a4-5b6c-7d8e-9f00-112233445566",
        )
    })
}

fn read_payload() -> Result<serde_json::Value, Error> {
    let buf = read_stdin("the payload")?;
    serde_json::from_slice(&buf)
        .map_err(|e| Error::Other(format!("the payload on stdin is not JSON: {e}")))
}

fn print_json(v: &serde_json::Value) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer(&mut out, v)
        .map_err(std::io::Error::from)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush())
        .map_err(|e| Error::Other(format!("cannot write to stdout: {e}")))
}

/// `outboxd keys …`
pub async fn keys(cmd: KeysCommand, m: &ArgMatches) -> Result<(), Error> {
    let sub = m.subcommand().map(|(_, s)| s).unwrap_or(m);
    match cmd {
        KeysCommand::Generate(a) => generate(a),
        KeysCommand::Rotate(a) => rotate(a),
        KeysCommand::List(a) => list(a),
        KeysCommand::Retire(a) => retire(a, sub).await,
        KeysCommand::BlindIndex(a) => blind_index(a),
        KeysCommand::Forget(a) => forget(a, sub).await,
    }
}

fn generate(a: GenerateArgs) -> Result<(), Error> {
    let k = Keyring::generate(a.blind_index_length)?;
    k.save_new(&a.file.keys)?;
    println!(
        "created keyring {} (mode 0600): encryption key {}, blind-index key {}",
        a.file.keys.display(),
        k.current_id(),
        k.blind_current().id
    );
    eprintln!(
        "outboxd: back this file up now, somewhere other than this machine: losing it loses every value encrypted with it"
    );
    Ok(())
}

/// The keyring file held for a change, its lock taken (saying so when another command holds
/// it), and read.
fn lock_keyring(path: &Path) -> Result<(KeyringFile, Keyring), Error> {
    let mut file = KeyringFile::lock(path, |lock| {
        eprintln!(
            "outboxd: waiting for the keyring lock {} (another outboxd keys command is changing this keyring)",
            lock.display()
        )
    })?;
    let k = file.read()?;
    Ok((file, k))
}

fn rotate(a: RotateArgs) -> Result<(), Error> {
    let (file, mut k) = lock_keyring(&a.file.keys)?;
    if a.blind_index {
        let len = a
            .blind_index_length
            .unwrap_or_else(|| k.blind_current().length);
        let old = k.blind_current().id.clone();
        let id = k.rotate_blind(len)?;
        file.replace(&k)?;
        println!("blind-index key {id} is now current ({len} bytes); {old} stays for searching");
        eprintln!(
            "outboxd: index new rows under {id} and rebuild the existing indexes; search under both (keys blind-index --all) until then"
        );
    } else {
        let old = k.current_id().to_string();
        let id = k.rotate();
        file.replace(&k)?;
        println!("encryption key {id} is now current; {old} stays for decryption");
        eprintln!(
            "outboxd: deploy the new keyring to consumers before producers use it; then `outboxd reencrypt` moves stored rows to {id}. Back the file up again."
        );
    }
    Ok(())
}

fn list(a: KeyringArgs) -> Result<(), Error> {
    let k = Keyring::resolve(a.keys.as_deref())?;
    println!(
        "{:<12} {:<12} {:<9} {:<21} notes",
        "id", "kind", "status", "created_at"
    );
    for i in k.list() {
        let notes = match (&i.retired_at, i.blind_length) {
            (Some(r), _) => format!("retired {r}, material removed"),
            (None, Some(n)) => format!("{n}-byte index"),
            _ => String::new(),
        };
        println!(
            "{:<12} {:<12} {:<9} {:<21} {}",
            i.id, i.kind, i.status, i.created_at, notes
        );
    }
    eprintln!("outboxd: every key passed its canary check");
    Ok(())
}

async fn retire(a: RetireArgs, m: &ArgMatches) -> Result<(), Error> {
    // The lock is held through the scans below, so a rotation meanwhile waits rather than
    // being undone by this command's write.
    let (file, mut k) = lock_keyring(&a.file.keys)?;
    // Validate first (current key, unknown id, already retired), on a copy.
    k.clone().retire(&a.id)?;
    eprintln!(
        "outboxd: warning: outboxd can count rows in the outbox table only. It cannot see messages still queued in the broker \
         (or in dead-letter queues) nor values consumers stored: whatever there is encrypted under {} becomes unreadable \
         once its material is removed. Back the keyring up before retiring.",
        a.id
    );
    if a.source.is_some() || a.source_file.is_some() {
        let (client, table, columns) = connect(
            a.source.as_deref(),
            a.source_file.as_deref(),
            &a.table,
            &a.columns,
            m,
        )
        .await?;
        // The head first: every event committed before it is either in the table (counted
        // next) or was deleted from it and lives on in the log until a relay publishes it.
        let head = crate::source::postgres::diagnostics::wal_head(&client).await?;
        let counts = reencrypt::count_by_key(&client, &table, &columns).await?;
        let n = counts.get(&a.id).copied().unwrap_or(0);
        if n > 0 {
            if !a.force {
                return Err(Error::Other(format!(
                    "{n} row{} of {} still use key {}; run `outboxd reencrypt` first (or add --force to make them unreadable)",
                    if n == 1 { "" } else { "s" },
                    table.pg_quoted(),
                    a.id
                )));
            }
            eprintln!(
                "outboxd: warning: --force: {n} rows still use {} and become unreadable",
                a.id
            );
        } else {
            eprintln!("outboxd: no row of {} uses key {}", table.pg_quoted(), a.id);
        }
        let behind = relays_caught_up(&client, head, a.catch_up_timeout).await?;
        if !behind.is_empty() {
            let list = behind.join("; ");
            if !a.force {
                return Err(Error::Other(format!(
                    "{list}: events in the log not yet published may still carry key {}\n  \
                     fix: start the relay (or wait until `outboxd status --name NAME` shows it caught up) and retire again; \
                     a relay no longer used: outboxd teardown --name NAME --yes; or add --force to retire anyway",
                    a.id
                )));
            }
            eprintln!("outboxd: warning: --force: {list}");
        }
    } else {
        eprintln!(
            "outboxd: warning: no --source given: rows in the outbox table were not checked for key {}",
            a.id
        );
    }
    if let Some(ks) = keystore(&a.keystore, m).await? {
        let n = ks
            .count_wrapped_by()
            .await?
            .get(&a.id)
            .copied()
            .unwrap_or(0);
        if n > 0 && !a.force {
            return Err(Error::Other(format!(
                "{n} data key{} of the keystore are still wrapped by key {}; run `outboxd reencrypt --keystore …` first (or add --force)",
                if n == 1 { "" } else { "s" },
                a.id
            )));
        }
    }
    if !a.yes {
        return Err(Error::config(
            format!(
                "retiring removes the material of key {} from {}",
                a.id,
                a.file.keys.display()
            ),
            "add --yes to confirm",
        ));
    }
    k.retire(&a.id)?;
    file.replace(&k)?;
    println!("retired key {}", a.id);
    Ok(())
}

/// Waits (up to `timeout`) until every relay whose state lives in this database has stored a
/// position at or past `head`; returns one line for each that has not. Reuses the state rows
/// `outboxd status` reads. A database without relay state (poll mode, or state elsewhere) has
/// nothing in its log that the table count missed only if no relay reads it: said on stderr.
async fn relays_caught_up(
    client: &tokio_postgres::Client,
    head: u64,
    timeout: std::time::Duration,
) -> Result<Vec<String>, Error> {
    use crate::event::format_lsn;
    use crate::state::postgres as state;
    if !state::table_exists(client).await? {
        eprintln!(
            "outboxd: no relay state in this database (outboxd_state): no relay's unpublished events were checked"
        );
        return Ok(Vec::new());
    }
    let deadline = std::time::Instant::now() + timeout;
    let mut said = false;
    loop {
        let names: Vec<String> = client
            .query(
                "SELECT name FROM outboxd_state WHERE slot IS NOT NULL ORDER BY name",
                &[],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let mut behind = Vec::new();
        for name in &names {
            let Some(row) = state::load(client, name).await? else {
                continue;
            };
            match row.position_lsn {
                Some(p) if p >= head => {}
                p => behind.push(format!(
                    "relay {name:?} has stored {} (the log's head was {} when this command started)",
                    p.map(format_lsn).unwrap_or_else(|| "no position".into()),
                    format_lsn(head)
                )),
            }
        }
        if behind.is_empty() || std::time::Instant::now() >= deadline {
            return Ok(behind);
        }
        if !said {
            eprintln!(
                "outboxd: waiting up to {timeout:?} for relays to publish the log up to {}: {}",
                format_lsn(head),
                behind.join("; ")
            );
            said = true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

fn blind_index(a: BlindIndexArgs) -> Result<(), Error> {
    let k = Keyring::resolve(a.keyring.keys.as_deref())?;
    let field = blind::field_pointer(&a.field);
    let steps = match (&a.normalize, &a.schema) {
        (Some(n), _) => blind::Normalize::parse_list(n)?,
        (None, Some(s)) => Schema::load(s)?
            .normalization(&field)
            .unwrap_or_else(|| blind::DEFAULT_NORMALIZE.to_vec()),
        (None, None) => blind::DEFAULT_NORMALIZE.to_vec(),
    };
    if let Some(l) = a.length {
        if !(1..=32).contains(&l) {
            return Err(Error::config(
                format!("--length {l} is not 1 to 32 bytes"),
                "use e.g. --length 8",
            ));
        }
    }
    let raw = read_stdin("the value")?;
    let text = std::str::from_utf8(&raw)
        .map_err(|_| Error::Other("the value on stdin is not UTF-8".into()))?;
    // One trailing newline is the shell's, not the value's: `echo x` and `printf x` agree.
    let value = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(text);
    let keys = if a.all {
        k.blind_keys()
    } else {
        vec![k.blind_current()]
    };
    for key in keys {
        println!(
            "{}",
            blind::blind_index(key, &field, value, &steps, a.length)
        );
    }
    Ok(())
}

async fn keystore(a: &KeystoreArgs, m: &ArgMatches) -> Result<Option<Keystore>, Error> {
    let from_argv = m.value_source("keystore") == Some(ValueSource::CommandLine);
    match crate::commands::resolve_dsn(
        a.keystore.as_deref(),
        a.keystore_file.as_deref(),
        from_argv,
        "keystore",
    )? {
        Some(dsn) => Ok(Some(Keystore::connect(&dsn).await?)),
        None => Ok(None),
    }
}

async fn forget(a: ForgetArgs, m: &ArgMatches) -> Result<(), Error> {
    let ks = keystore(&a.keystore, m).await?.ok_or_else(|| {
        Error::config(
            "keys forget needs the keystore",
            "pass --keystore postgres://user@host:5432/db",
        )
    })?;
    if a.source.is_none() && a.source_file.is_none() {
        return Err(Error::config(
            format!(
                "keys forget verifies that nothing of aggregate {:?} stays readable once its data key is gone, and needs the outbox table for that",
                a.aggregate
            ),
            "pass --source postgres://user@host:5432/db (the outbox database; --table and --column as for run)",
        ));
    }
    let schema = match &a.schema {
        Some(p) => Schema::load(p)?,
        None => Schema::default(),
    };
    if !a.yes {
        return Err(Error::config(
            format!(
                "forgetting the data key of aggregate {:?} makes its encrypted fields unreadable for good, wherever they were copied",
                a.aggregate
            ),
            "add --yes to confirm",
        ));
    }
    let (rows, mysql) = aggregate_rows(&a, m).await?;
    let table = TableName::parse(&a.table)?;
    let left = shred::readable_after_forget(&ks, &rows, &schema, &a.aggregate).await?;
    if !left.is_empty() {
        for l in left.iter().take(20) {
            eprintln!("outboxd: row {}: {}", l.event_id, l.why);
        }
        let rows: std::collections::BTreeSet<_> = left.iter().map(|l| &l.event_id).collect();
        return Err(Error::Other(format!(
            "nothing was forgotten: {} value{} in {} row{} of aggregate {:?} in {} would stay readable after its data key is gone\n  \
             fix: {}, then keys forget again",
            left.len(),
            if left.len() == 1 { "" } else { "s" },
            rows.len(),
            if rows.len() == 1 { "" } else { "s" },
            a.aggregate,
            table,
            if mysql {
                // reencrypt reads Postgres tables only in this build.
                "rewrite those rows with the producer's Encryptor::with_keystore (or delete them once published)".to_string()
            } else {
                format!("run `outboxd reencrypt --source … --table {} --keys … --schema … --keystore …` first (it seals them under the aggregate's data key)", a.table)
            },
        )));
    }
    match ks.forget(&a.aggregate).await? {
        Some(id) => {
            println!("forgot data key {id} of aggregate {:?}", a.aggregate);
            eprintln!(
                "outboxd: every encrypted value of the aggregate in {table} was under its data key"
            );
            // The UPDATE leaves the old row version, wrapped key and all, in the table's
            // pages: rewritten now, or the exact statement for later (docs/encryption.md).
            if a.vacuum {
                // A snapshot older than the forgetting keeps the old row version alive through
                // a rewrite: wait for those to end first, and say so when they do not.
                let holders = ks
                    .wait_forgotten_removable(&a.aggregate, VACUUM_HORIZON_WAIT)
                    .await?;
                ks.rewrite(VACUUM_LOCK_WAIT).await?;
                if holders.is_empty() {
                    println!("rewrote outboxd_data_keys (VACUUM FULL): the wrapped key is gone from its pages");
                } else {
                    return Err(Error::config(
                        format!(
                            "rewrote outboxd_data_keys, but the forgotten key's old row version stays in its pages: {} can still read it",
                            holders.join(", ")
                        ),
                        "once those end, run VACUUM FULL outboxd_data_keys; as the table's owner",
                    ));
                }
            } else {
                eprintln!(
                    "outboxd: the wrapped key stays in outboxd_data_keys' pages (the old row version) until the table is rewritten: \
                     VACUUM FULL outboxd_data_keys;  (as its owner, or `keys forget --vacuum`; a plain VACUUM can leave its bytes in a page's free space)"
                );
            }
            eprintln!(
                "outboxd: erasure is complete only once the rest have rolled off: the WAL holding the key (recycled after checkpoints, unless a replication slot, \
                 wal_keep_size or WAL archiving keeps it), replicas' WAL likewise, and backups of the keystore until they expire; values consumers stored in clear are out of reach (docs/encryption.md)"
            );
            Ok(())
        }
        None => Err(Error::Other(format!(
            "aggregate {:?} has no live data key (never had one, or already forgotten)",
            a.aggregate
        ))),
    }
}

/// How long `keys forget --vacuum` waits for the transactions that could still read the old
/// row version to end before it rewrites the table.
const VACUUM_HORIZON_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long `keys forget --vacuum` waits for the key table's lock: a rewrite queued behind a
/// long transaction would hold up every producer queued behind it.
const VACUUM_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The aggregate's rows of the outbox table `keys forget` verifies, Postgres or MySQL (the
/// flag says which).
async fn aggregate_rows(
    a: &ForgetArgs,
    m: &ArgMatches,
) -> Result<(Vec<(String, String)>, bool), Error> {
    let from_argv = m.value_source("source") == Some(ValueSource::CommandLine);
    let Some(dsn) = crate::commands::resolve_dsn(
        a.source.as_deref(),
        a.source_file.as_deref(),
        from_argv,
        "source",
    )?
    else {
        return Err(Error::config(
            "no source given",
            "pass --source postgres://user@host:5432/db (or mysql://…)",
        ));
    };
    let table = TableName::parse(&a.table)?;
    let columns = ColumnMap::parse(&a.columns)?;
    match crate::dsn::SourceDsn::parse(&dsn)? {
        crate::dsn::SourceDsn::Postgres(d) => {
            let client = crate::db::postgres::connect_sql(&d, "outboxd_keys_forget").await?;
            Ok((
                shred::aggregate_rows_pg(&client, &table, &columns, &a.aggregate).await?,
                false,
            ))
        }
        crate::dsn::SourceDsn::Mysql(d) => {
            let mut conn = crate::db::mysql::connect_sql(&d).await?;
            Ok((
                shred::aggregate_rows_mysql(&mut conn, &table, &columns, &a.aggregate).await?,
                true,
            ))
        }
        _ => Err(Error::config(
            "keys forget reads the outbox table of a database",
            "pass --source postgres://… or mysql://… (the outbox database)",
        )),
    }
}

/// `outboxd encrypt`
pub async fn encrypt(a: EncryptArgs, m: &ArgMatches) -> Result<(), Error> {
    let event = parse_event_id(&a.event_id)?;
    let mut enc = Encryptor::load(a.keyring.keys.as_deref(), &a.schema)?;
    if let Some(ks) = keystore(&a.keystore, m).await? {
        enc = enc.with_keystore(ks);
    }
    let payload = read_payload()?;
    let out = match (enc.keystore().is_some(), &a.aggregate) {
        (true, Some(agg)) => enc.encrypt_event(event, agg, &payload).await?,
        (true, None) => {
            return Err(Error::config(
                "--keystore seals with the aggregate's data key, but no aggregate was given",
                "add --aggregate ID",
            ))
        }
        (false, _) => enc.encrypt_payload(event, &payload)?,
    };
    print_json(&out)
}

/// `outboxd decrypt`: fields whose data key was forgotten print as `null` and are listed on
/// stderr.
pub async fn decrypt(a: DecryptArgs, m: &ArgMatches) -> Result<(), Error> {
    let event = parse_event_id(&a.event_id)?;
    let mut enc = Encryptor::new(
        Keyring::resolve(a.keyring.keys.as_deref())?,
        Schema::default(),
    );
    if let Some(ks) = keystore(&a.keystore, m).await? {
        enc = enc.with_keystore(ks);
    }
    let payload = read_payload()?;
    let d = enc.decrypt_event(event, &payload).await?;
    for p in &d.erased {
        eprintln!("outboxd: {p}: erased (its aggregate's data key was forgotten)");
    }
    print_json(&d.payload)
}

async fn connect(
    source: Option<&str>,
    source_file: Option<&Path>,
    table: &str,
    columns: &[String],
    m: &ArgMatches,
) -> Result<(tokio_postgres::Client, TableName, ColumnMap), Error> {
    let from_argv = m.value_source("source") == Some(ValueSource::CommandLine);
    let dsn = crate::commands::resolve_dsn(source, source_file, from_argv, "source")?.ok_or_else(
        || {
            Error::config(
            "no source given",
            "pass --source postgres://user@host:5432/db (or set OUTBOXD_SOURCE, or --source-file)",
        )
        },
    )?;
    let crate::dsn::SourceDsn::Postgres(dsn) = crate::dsn::SourceDsn::parse(&dsn)? else {
        return Err(Error::config(
            "re-encryption supports Postgres sources in this build",
            "use a postgres:// source",
        ));
    };
    let client = crate::db::postgres::connect_sql(&dsn, "outboxd_reencrypt").await?;
    Ok((client, TableName::parse(table)?, ColumnMap::parse(columns)?))
}

fn print_counts(
    keyring: &Keyring,
    table: &TableName,
    counts: &std::collections::BTreeMap<String, i64>,
) {
    println!(
        "rows of {} holding values under each key:",
        table.pg_quoted()
    );
    let mut shown = std::collections::BTreeSet::new();
    for id in keyring.encryption_key_ids().iter().rev() {
        let status = if *id == keyring.current_id() {
            "current"
        } else {
            "old"
        };
        println!(
            "  {:<12} {:<8} {}",
            id,
            status,
            counts.get(*id).copied().unwrap_or(0)
        );
        shown.insert(id.to_string());
    }
    for (id, n) in counts.iter().filter(|(id, _)| !shown.contains(*id)) {
        let what = if id == "d-*" {
            "per-aggregate data keys"
        } else {
            "unknown"
        };
        println!("  {:<12} {:<8} {}", id, what, n);
    }
}

/// `--include-pending` while a poll relay is connected to the database would lock rows it is
/// about to claim: refused. Poll relays name their session `outboxd_<name>_poll`.
async fn refuse_pending_with_poll_relays(client: &tokio_postgres::Client) -> Result<(), Error> {
    let rows = client
        .query(
            "SELECT DISTINCT application_name FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name LIKE 'outboxd\\_%\\_poll' \
             ORDER BY 1",
            &[],
        )
        .await?;
    if rows.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    Err(Error::config(
        format!(
            "--include-pending, but a poll relay is connected to this database ({}): locking its \
             pending rows would make it publish an aggregate's later events first",
            names.join(", ")
        ),
        "run `outboxd reencrypt` without --include-pending (pending rows are re-sealed by a later run once published)",
    ))
}

/// `outboxd reencrypt`
pub async fn reencrypt(
    a: ReencryptArgs,
    m: &ArgMatches,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    if a.batch < 1 {
        return Err(Error::config(
            "--batch must be at least 1",
            "use --batch 500",
        ));
    }
    let mut enc = Encryptor::load(a.keyring.keys.as_deref(), &a.schema)?;
    if let Some(ks) = keystore(&a.keystore, m).await? {
        let n = ks.rewrap(enc.keyring()).await?;
        eprintln!(
            "outboxd: re-wrapped {n} data key{} under {}",
            if n == 1 { "" } else { "s" },
            enc.keyring().current_id()
        );
        // Old rows' values then go under their aggregate's data key, not the keyring's key:
        // otherwise `keys forget` would leave them readable.
        enc = enc.with_keystore(ks);
    }
    let (mut client, table, columns) = connect(
        a.source.as_deref(),
        a.source_file.as_deref(),
        &a.table,
        &a.columns,
        m,
    )
    .await?;
    if a.include_pending {
        refuse_pending_with_poll_relays(&client).await?;
    }
    let before = reencrypt::count_by_key(&client, &table, &columns).await?;
    let old: i64 = before
        .iter()
        .filter(|(id, _)| id.as_str() != enc.keyring().current_id())
        .map(|(_, n)| n)
        .sum();
    if enc.keystore().is_some() {
        eprintln!(
            "outboxd: re-encrypting {} under each row's aggregate's data key (clear marked fields and values under keyring keys), {} rows per transaction",
            table.pg_quoted(),
            a.batch
        );
    } else {
        eprintln!(
            "outboxd: re-encrypting {} under key {} ({old} row-key pairs under older keys), {} rows per transaction",
            table.pg_quoted(),
            enc.keyring().current_id(),
            a.batch
        );
    }
    let opts = reencrypt::Options {
        batch: a.batch,
        after: a.after,
        limit: None,
        include_pending: a.include_pending,
    };
    let filter = match a.after {
        Some(after) => format!(
            "WHERE {} > '{after}'",
            crate::outbox::pg_ident(columns.get(crate::outbox::Column::Id))
        ),
        None => String::new(),
    };
    let estimate = crate::source::postgres::admin::estimate_rows(&client, &table, &filter).await;
    let mut progress = Progress::command("reencrypt", table.pg_quoted(), Unit::Rows, estimate);
    let p = reencrypt::run(&mut client, &table, &columns, &enc, &opts, &shutdown, |p| {
        progress.set(p.scanned);
        // Every batch's resume point, for a run killed without a chance to say it (a batch is
        // `--batch` rows: a line per batch, not per row).
        tracing::info!(
            batch = p.batches,
            scanned = p.scanned,
            rewritten = p.rewritten,
            failed = p.failed,
            "reencrypt: resume with --after {}",
            p.last_id.map(|u| u.to_string()).unwrap_or_default()
        );
    })
    .await?;
    if !p.interrupted {
        progress.finish();
    }
    let after = reencrypt::count_by_key(&client, &table, &columns).await?;
    print_counts(enc.keyring(), &table, &after);
    println!(
        "scanned {} rows, rewrote {}, failed {}, left {} pending",
        p.scanned, p.rewritten, p.failed, p.skipped_pending
    );
    if p.skipped_pending > 0 {
        eprintln!(
            "outboxd: {} row{} still pending were left alone (a poll relay may be claiming them); \
             run `outboxd reencrypt` again once they are published, or add --include-pending if \
             only CDC mode reads {} (it never marks rows published)",
            p.skipped_pending,
            if p.skipped_pending == 1 { "" } else { "s" },
            table.pg_quoted()
        );
    }
    for (id, why) in p.failures.iter().take(20) {
        eprintln!("outboxd: row {id}: {why}");
    }
    if p.interrupted {
        return Err(Error::Other(format!(
            "interrupted; resume with --after {}",
            p.last_id.map(|u| u.to_string()).unwrap_or_default()
        )));
    }
    if p.failed > 0 {
        return Err(Error::Other(format!(
            "{} row{} could not be re-encrypted (left as they were)",
            p.failed,
            if p.failed == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}
