//! Crypto-shredding: one data key per aggregate, wrapped (sealed) by the keyring and kept in a
//! key table (`--keystore DSN`). An aggregate's sensitive fields are sealed with its data key,
//! so deleting that one key (`outboxd keys forget --aggregate ID`) erases them everywhere they
//! were copied — table, WAL, broker, consumers' stores of ciphertext — without touching any of
//! those copies. Decryption then yields a typed "erased" field instead of failing.
//!
//! Data key ids are `d-` + 16 hex digits; keyring key ids may not start with `d-`, so a value's
//! key id alone says where its key lives.

// Key wrapping serves the keystore, a Postgres table: without `postgres` it has no user.
#![cfg_attr(not(feature = "postgres"), allow(dead_code, unused_imports))]

use super::envelope::{self, KeyBytes};
use super::error::CryptoError;
use super::keyring::Keyring;
use super::{KeyResolver, Resolved};
use crate::Error;
use chacha20poly1305::aead::rand_core::RngCore;
use chacha20poly1305::aead::OsRng;
use std::collections::HashMap;
use uuid::Uuid;
use zeroize::Zeroizing;

pub const DATA_KEY_PREFIX: &str = "d-";
pub const TABLE: &str = "outboxd_data_keys";

/// The key table. `wrapped` is NULL once the key is forgotten; the row stays as a tombstone so
/// that a forgotten key reads as "erased" and a key that was never here as "unknown" (another
/// keystore?). At most one live key per aggregate.
pub const DDL: &str = "
CREATE TABLE IF NOT EXISTS outboxd_data_keys (
    key_id        text PRIMARY KEY,
    aggregate_id  text NOT NULL,
    wrapped       text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    forgotten_at  timestamptz,
    CHECK ((wrapped IS NULL) = (forgotten_at IS NOT NULL))
);
CREATE UNIQUE INDEX IF NOT EXISTS outboxd_data_keys_live
    ON outboxd_data_keys (aggregate_id) WHERE forgotten_at IS NULL;";

pub fn is_data_key_id(id: &str) -> bool {
    id.starts_with(DATA_KEY_PREFIX)
}

/// Where a wrapped key is bound: a wrapped key moved to another row does not unwrap.
fn wrap_pointer(key_id: &str, aggregate_id: &str) -> String {
    format!(
        "/outboxd/data-keys/{key_id}/{}",
        aggregate_id.replace('~', "~0").replace('/', "~1")
    )
}

fn wrap(keyring: &Keyring, key_id: &str, aggregate_id: &str, material: &KeyBytes) -> String {
    let (id, kek) = keyring.current();
    envelope::seal_wrapped_key(
        kek,
        id,
        &wrap_pointer(key_id, aggregate_id),
        material.as_ref(),
    )
}

fn unwrap(
    keyring: &Keyring,
    key_id: &str,
    aggregate_id: &str,
    wrapped: &str,
) -> Result<KeyBytes, CryptoError> {
    let at = wrap_pointer(key_id, aggregate_id);
    let parsed = envelope::parse(wrapped, &at)?;
    let kek = keyring.material(parsed.key_id, &at)?;
    // Keys wrapped before the wrapping label existed were sealed as a field (the field-key
    // label, nil event id): still read, and re-wrapped under the new label by `reencrypt`.
    let plain = match envelope::open_wrapped_key(kek, &parsed, &at) {
        Ok(p) => p,
        Err(e) => envelope::open(kek, &parsed, Uuid::nil(), &at).map_err(|_| e)?,
    };
    let arr: [u8; 32] = plain
        .as_slice()
        .try_into()
        .map_err(|_| CryptoError::malformed(&at, "a data key is not 32 bytes"))?;
    Ok(Zeroizing::new(arr))
}

/// What the keystore holds for a data key id.
pub enum DataKey {
    Live {
        aggregate_id: String,
        material: KeyBytes,
    },
    Forgotten {
        aggregate_id: String,
    },
    Unknown,
}

#[cfg(feature = "postgres")]
/// The key table, on its own connection (never inside a producer's transaction: a data key
/// created for a transaction that rolls back is merely unused).
pub struct Keystore {
    client: tokio_postgres::Client,
}

#[cfg(feature = "postgres")]
impl std::fmt::Debug for Keystore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keystore")
    }
}

#[cfg(feature = "postgres")]
impl Keystore {
    /// Uses `client` and creates the key table if it is missing.
    pub async fn new(client: tokio_postgres::Client) -> Result<Keystore, Error> {
        client.batch_execute(DDL).await?;
        Ok(Keystore { client })
    }

    /// Connects to `dsn` (postgres://…).
    pub async fn connect(dsn: &str) -> Result<Keystore, Error> {
        let crate::dsn::SourceDsn::Postgres(d) = crate::dsn::SourceDsn::parse(dsn)? else {
            return Err(Error::config(
                "the keystore must be a Postgres database",
                "pass --keystore postgres://user@host:5432/db",
            ));
        };
        Keystore::new(crate::db::postgres::connect_sql(&d, "outboxd_keystore").await?).await
    }

    /// The live data key of `aggregate_id`, created (and wrapped by the keyring's current key)
    /// when it has none. Safe against concurrent producers: the partial unique index lets one
    /// insert win and everyone reads the winner.
    pub async fn data_key_for(
        &self,
        keyring: &Keyring,
        aggregate_id: &str,
    ) -> Result<(String, KeyBytes), Error> {
        let select = "SELECT key_id, wrapped FROM outboxd_data_keys WHERE aggregate_id = $1 AND forgotten_at IS NULL";
        for _ in 0..2 {
            if let Some(row) = self.client.query_opt(select, &[&aggregate_id]).await? {
                let key_id: String = row.get(0);
                let wrapped: String = row.get(1);
                let m = unwrap(keyring, &key_id, aggregate_id, &wrapped)?;
                return Ok((key_id, m));
            }
            let mut id = [0u8; 8];
            OsRng.fill_bytes(&mut id);
            let key_id = format!("{DATA_KEY_PREFIX}{}", super::blind::hex(&id));
            let mut material = Zeroizing::new([0u8; 32]);
            OsRng.fill_bytes(material.as_mut());
            let wrapped = wrap(keyring, &key_id, aggregate_id, &material);
            let n = self
                .client
                .execute(
                    "INSERT INTO outboxd_data_keys (key_id, aggregate_id, wrapped) VALUES ($1, $2, $3)
                     ON CONFLICT (aggregate_id) WHERE forgotten_at IS NULL DO NOTHING",
                    &[&key_id, &aggregate_id, &wrapped],
                )
                .await?;
            if n == 1 {
                return Ok((key_id, material));
            }
        }
        Err(Error::Other(format!(
            "keystore: no data key for aggregate {aggregate_id:?} after creating one"
        )))
    }

    /// Looks a data key id up.
    pub async fn lookup(&self, keyring: &Keyring, key_id: &str) -> Result<DataKey, Error> {
        let row = self
            .client
            .query_opt(
                "SELECT aggregate_id, wrapped FROM outboxd_data_keys WHERE key_id = $1",
                &[&key_id],
            )
            .await?;
        Ok(match row {
            None => DataKey::Unknown,
            Some(r) => {
                let aggregate_id: String = r.get(0);
                match r.get::<_, Option<String>>(1) {
                    None => DataKey::Forgotten { aggregate_id },
                    Some(w) => DataKey::Live {
                        material: unwrap(keyring, key_id, &aggregate_id, &w)?,
                        aggregate_id,
                    },
                }
            }
        })
    }

    /// Forgets the live data key of an aggregate: its wrapped key is overwritten with NULL.
    /// Returns the forgotten key id, if there was one.
    pub async fn forget(&self, aggregate_id: &str) -> Result<Option<String>, Error> {
        let row = self
            .client
            .query_opt(
                "UPDATE outboxd_data_keys SET wrapped = NULL, forgotten_at = now()
                  WHERE aggregate_id = $1 AND forgotten_at IS NULL RETURNING key_id",
                &[&aggregate_id],
            )
            .await?;
        Ok(row.map(|r| r.get(0)))
    }

    /// Waits (at most `patience`) until no transaction or replication slot of the server can
    /// still see the row version `aggregate_id`'s key had before it was forgotten: only then
    /// can a rewrite drop it (a `VACUUM FULL` keeps a dead row that some snapshot may still
    /// read). Returns what still holds it when the wait ran out (empty: nothing).
    pub async fn wait_forgotten_removable(
        &self,
        aggregate_id: &str,
        patience: std::time::Duration,
    ) -> Result<Vec<String>, Error> {
        // The forgetting UPDATE's transaction id: the new row version's xmin.
        let Some(row) = self
            .client
            .query_opt(
                "SELECT xmin::text FROM outboxd_data_keys WHERE aggregate_id = $1",
                &[&aggregate_id],
            )
            .await?
        else {
            return Ok(Vec::new());
        };
        let xid: String = row.get(0);
        // A snapshot whose xmin is at or before that transaction may still see the old version.
        const HOLDERS: &str = "
            SELECT 'backend ' || pid || coalesce(' (' || nullif(application_name, '') || ')', '')
              FROM pg_stat_activity
             WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
               AND age(backend_xmin) >= age($1::text::xid)
            UNION ALL
            SELECT 'replication slot ' || slot_name FROM pg_replication_slots
             WHERE xmin IS NOT NULL AND age(xmin) >= age($1::text::xid)
            UNION ALL
            SELECT 'prepared transaction ' || gid FROM pg_prepared_xacts
             WHERE age(transaction) >= age($1::text::xid)";
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let holders: Vec<String> = self
                .client
                .query(HOLDERS, &[&xid])
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            if holders.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(holders);
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Rewrites the key table (`VACUUM FULL`), so that the old row versions of forgotten keys,
    /// which hold their wrapped keys until then, leave its pages: a plain `VACUUM` frees a dead
    /// row's space but can leave its bytes in the page's free space. Holds an exclusive lock on
    /// the table while it runs (producers that make or read data keys wait), and waits for that
    /// lock at most `lock_wait`. Needs the table's owner.
    pub async fn rewrite(&self, lock_wait: std::time::Duration) -> Result<(), Error> {
        // VACUUM runs outside any transaction: one statement per call.
        self.client
            .batch_execute(&format!(
                "SET lock_timeout = {}",
                lock_wait.as_millis().max(1)
            ))
            .await?;
        let r = self
            .client
            .batch_execute("VACUUM FULL outboxd_data_keys")
            .await;
        let _ = self.client.batch_execute("RESET lock_timeout").await;
        let fix = "VACUUM FULL outboxd_data_keys;  (as the table's owner, at a quiet moment: it locks the key table while it runs)";
        match r {
            Ok(()) => Ok(()),
            Err(e) => match e.code() {
                Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => Err(Error::config(
                    format!(
                        "the key was forgotten, but its old row version stays in outboxd_data_keys' pages: this role may not rewrite the table ({})",
                        crate::db::postgres::describe_pg_error(&e)
                    ),
                    fix,
                )),
                Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => Err(Error::config(
                    format!(
                        "the key was forgotten, but its old row version stays in outboxd_data_keys' pages: the table was busy for {lock_wait:?}, so it was not rewritten"
                    ),
                    fix,
                )),
                _ => Err(e.into()),
            },
        }
    }

    /// Re-wraps every live data key still wrapped by an older keyring key under the current
    /// one (part of `reencrypt`, so that old keyring keys can be retired). Returns how many.
    pub async fn rewrap(&self, keyring: &Keyring) -> Result<u64, Error> {
        let current = keyring.current_id();
        let pattern = format!("enc:v1:{}:%", current.replace('_', "\\_"));
        let rows = self
            .client
            .query(
                "SELECT key_id, aggregate_id, wrapped FROM outboxd_data_keys
                  WHERE wrapped IS NOT NULL AND wrapped NOT LIKE $1",
                &[&pattern],
            )
            .await?;
        let mut n = 0;
        for r in rows {
            let (key_id, agg, w): (String, String, String) = (r.get(0), r.get(1), r.get(2));
            let m = unwrap(keyring, &key_id, &agg, &w)?;
            n += self
                .client
                .execute(
                    "UPDATE outboxd_data_keys SET wrapped = $2 WHERE key_id = $1 AND wrapped = $3",
                    &[&key_id, &wrap(keyring, &key_id, &agg, &m), &w],
                )
                .await?;
        }
        Ok(n)
    }

    /// How many live data keys each keyring key wraps.
    pub async fn count_wrapped_by(&self) -> Result<HashMap<String, i64>, Error> {
        let rows = self
            .client
            .query(
                "SELECT split_part(wrapped, ':', 3), count(*) FROM outboxd_data_keys
                  WHERE wrapped IS NOT NULL GROUP BY 1",
                &[],
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Resolves the data keys a payload uses, for [`super::decrypt_payload_with`].
    pub async fn resolver<'a>(
        &self,
        keyring: &'a Keyring,
        payload: &serde_json::Value,
    ) -> Result<DataKeys<'a>, Error> {
        let mut keys = HashMap::new();
        for id in super::key_ids_in(payload).into_keys() {
            if is_data_key_id(&id) {
                let k = self.lookup(keyring, &id).await?;
                keys.insert(id, k);
            }
        }
        Ok(DataKeys { keyring, keys })
    }
}

/// A value of an aggregate's row that would stay readable once the aggregate's data key is
/// forgotten, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StillReadable {
    /// The row's event id, as text (a UUID; MySQL tables may store it in other forms).
    pub event_id: String,
    pub why: String,
}

#[cfg(feature = "postgres")]
/// The rows of `aggregate_id` in a Postgres outbox table: (event id, payload text).
pub async fn aggregate_rows_pg(
    client: &tokio_postgres::Client,
    table: &crate::names::TableName,
    columns: &crate::names::ColumnMap,
    aggregate_id: &str,
) -> Result<Vec<(String, String)>, Error> {
    use crate::names::pg_ident;
    let sql = format!(
        "SELECT {id}::text, {payload}::text FROM {t} WHERE {agg}::text = $1 ORDER BY {id}",
        t = table.pg_quoted(),
        id = pg_ident(columns.get(crate::names::Column::Id)),
        payload = pg_ident(columns.get(crate::names::Column::Payload)),
        agg = pg_ident(columns.get(crate::names::Column::AggregateId)),
    );
    Ok(client
        .query(&sql, &[&aggregate_id])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// The rows of `aggregate_id` in a MySQL/MariaDB outbox table: (event id, payload text). A
/// 16-byte id is the contract's `BINARY(16)` UUID; any other id is shown as its text.
#[cfg(feature = "mysql")]
pub async fn aggregate_rows_mysql(
    conn: &mut mysql_async::Conn,
    table: &crate::names::TableName,
    columns: &crate::names::ColumnMap,
    aggregate_id: &str,
) -> Result<Vec<(String, String)>, Error> {
    use crate::names::my_ident;
    use mysql_async::prelude::Queryable;
    let t = match &table.schema {
        Some(db) => format!("{}.{}", my_ident(db), my_ident(&table.name)),
        None => my_ident(&table.name),
    };
    let sql = format!(
        "SELECT {id}, CAST({payload} AS CHAR CHARACTER SET utf8mb4) FROM {t} WHERE {agg} = ? ORDER BY {id}",
        id = my_ident(columns.get(crate::names::Column::Id)),
        payload = my_ident(columns.get(crate::names::Column::Payload)),
        agg = my_ident(columns.get(crate::names::Column::AggregateId)),
    );
    let rows: Vec<(Vec<u8>, String)> = conn
        .exec(sql, (aggregate_id,))
        .await
        .map_err(crate::db::mysql::classify)?;
    Ok(rows
        .into_iter()
        .map(|(id, payload)| {
            let id = match uuid::Uuid::from_slice(&id) {
                Ok(u) if id.len() == 16 => u.to_string(),
                _ => String::from_utf8_lossy(&id).into_owned(),
            };
            (id, payload)
        })
        .collect())
}

#[cfg(feature = "postgres")]
/// Every value in `rows` (an aggregate's rows: event id, payload text) that forgetting the
/// aggregate's data key would not erase: values under a keyring key, under another
/// aggregate's data key or a data key this keystore does not hold, and clear fields `schema`
/// marks. Empty when forgetting erases all of them. Needs no keyring: a value's key id says
/// where its key lives.
pub async fn readable_after_forget(
    ks: &Keystore,
    rows: &[(String, String)],
    schema: &super::Schema,
    aggregate_id: &str,
) -> Result<Vec<StillReadable>, Error> {
    let mut owners: HashMap<String, Option<String>> = HashMap::new();
    let mut out = Vec::new();
    for (event_id, text) in rows {
        let Ok(payload) = serde_json::from_str::<serde_json::Value>(text) else {
            // Not JSON: nothing in it is an outboxd value, and nothing is marked either.
            continue;
        };
        let mut push = |why: String| {
            out.push(StillReadable {
                event_id: event_id.clone(),
                why,
            })
        };
        for u in super::outside_data_keys(schema, &payload) {
            push(match u.key_id {
                Some(k) => format!(
                    "{} is sealed under keyring key {k}, which forgetting does not touch",
                    u.pointer
                ),
                None => format!("{} is a sensitive field stored in clear", u.pointer),
            });
        }
        for key_id in super::key_ids_in(&payload).into_keys() {
            if !is_data_key_id(&key_id) {
                continue;
            }
            if !owners.contains_key(&key_id) {
                let owner = owner_of(ks, &key_id).await?;
                owners.insert(key_id.clone(), owner);
            }
            match &owners[&key_id] {
                Some(owner) if owner == aggregate_id => {}
                Some(owner) => push(format!(
                    "values are sealed under data key {key_id} of another aggregate ({owner:?})"
                )),
                None => push(format!(
                    "values are sealed under data key {key_id}, which this keystore does not hold"
                )),
            }
        }
    }
    Ok(out)
}

#[cfg(feature = "postgres")]
/// The aggregate a data key id belongs to (live or forgotten), if the keystore holds it.
async fn owner_of(ks: &Keystore, key_id: &str) -> Result<Option<String>, Error> {
    Ok(ks
        .client
        .query_opt(
            "SELECT aggregate_id FROM outboxd_data_keys WHERE key_id = $1",
            &[&key_id],
        )
        .await?
        .map(|r| r.get(0)))
}

/// The keyring plus the data keys of one payload, looked up in advance.
pub struct DataKeys<'a> {
    keyring: &'a Keyring,
    keys: HashMap<String, DataKey>,
}

impl KeyResolver for DataKeys<'_> {
    fn resolve(&self, key_id: &str, pointer: &str) -> Result<Resolved<'_>, CryptoError> {
        if !is_data_key_id(key_id) {
            return self.keyring.resolve(key_id, pointer);
        }
        match self.keys.get(key_id) {
            Some(DataKey::Live { material, .. }) => Ok(Resolved::Key(material)),
            Some(DataKey::Forgotten { .. }) => Ok(Resolved::Erased),
            Some(DataKey::Unknown) | None => Err(CryptoError::UnknownKeyId {
                pointer: pointer.to_string(),
                key_id: key_id.to_string(),
                known: "per-aggregate data keys of the given keystore".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapped_keys_use_their_own_label_and_old_wraps_still_open() {
        let k = Keyring::generate(8).unwrap();
        let material: KeyBytes = Zeroizing::new([7u8; 32]);
        let wrapped = wrap(&k, "dk1", "order-1", &material);
        assert_eq!(*unwrap(&k, "dk1", "order-1", &wrapped).unwrap(), [7u8; 32]);
        // Not a field value: opening it as one (field-key label) fails.
        let at = wrap_pointer("dk1", "order-1");
        let (_, kek) = k.current();
        let parsed = envelope::parse(&wrapped, &at).unwrap();
        assert!(envelope::open(kek, &parsed, Uuid::nil(), &at).is_err());
        // Moved to another aggregate's row: refused.
        assert!(unwrap(&k, "dk1", "order-2", &wrapped).is_err());
        // A key wrapped by an earlier build (sealed as a field for the nil event id).
        let (id, kek) = k.current();
        let legacy = envelope::seal(kek, id, Uuid::nil(), &at, material.as_ref());
        assert_eq!(*unwrap(&k, "dk1", "order-1", &legacy).unwrap(), [7u8; 32]);
    }
}
