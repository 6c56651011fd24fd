#!/usr/bin/env bash
# Records the fuzzers' seed corpora from the local services (scripts/services.sh): pgoutput
# messages from a throwaway logical slot on Postgres, and a raw MariaDB binlog file holding
# outbox transactions. Writes fuzz/seeds/{pgoutput,binlog}/seed-*; re-run after a format change.
set -euo pipefail
cd "$(dirname "$0")"
PG="psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres"
MY="mariadb -h 127.0.0.1 -u root"
DB=outboxd_fuzz_seeds

# --- Postgres: pgoutput bytes as the relay receives them --------------------------------------
$PG -d postgres -c "DROP DATABASE IF EXISTS $DB" -c "CREATE DATABASE $DB"
$PG -d $DB -f ../migrations/postgres/001_outbox.sql
$PG -d $DB >/dev/null <<'SQL'
CREATE TABLE other (id int PRIMARY KEY, note text);
CREATE PUBLICATION fuzz_pub FOR TABLE outbox, other;
SELECT pg_create_logical_replication_slot('outboxd_fuzz_seeds', 'pgoutput');
-- one event, minimal
INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES (gen_random_uuid(), '1', 'order.created', '{"n":1}');
-- several events and another table in one transaction, headers and version set
BEGIN;
INSERT INTO other VALUES (1, 'x');
INSERT INTO outbox (id, aggregate_id, topic, payload, headers, version)
  VALUES (gen_random_uuid(), 'a-2', 'order.paid', '{"total":"19.90","lines":[1,2,3],"note":"ünï"}', '{"trace":"t-1"}', 7);
INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES (gen_random_uuid(), 'a-2', 'order.shipped', '[]');
UPDATE other SET note = 'y' WHERE id = 1;
DELETE FROM other WHERE id = 1;
COMMIT;
-- rolled back: nothing of it in the stream
BEGIN;
INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES (gen_random_uuid(), 'rb', 'never', '{}');
ROLLBACK;
-- a logical message and a truncate of the other table
SELECT pg_logical_emit_message(true, 'fuzz', 'hello');
TRUNCATE other;
-- a payload of a few KB
INSERT INTO outbox (id, aggregate_id, topic, payload)
  VALUES (gen_random_uuid(), 'big', 'blob', json_build_object('s', repeat('x', 3000)));
SQL
# Each message framed as a big-endian u32 length and its bytes (what outboxd::fuzzing::pgoutput
# reads). One seed: a Relation message comes once per session, so transactions cut apart
# would not decode on their own.
$PG -d $DB -At -c "
  SELECT encode(string_agg(int4send(length(data)) || data, ''::bytea ORDER BY n), 'hex')
    FROM (SELECT row_number() OVER () AS n, data
            FROM pg_logical_slot_peek_binary_changes('outboxd_fuzz_seeds', NULL, NULL,
                 'proto_version', '1', 'publication_names', 'fuzz_pub', 'messages', 'true')) m" |
  xxd -r -p > seeds/pgoutput/seed-all
$PG -d $DB -o /dev/null -c "SELECT pg_drop_replication_slot('outboxd_fuzz_seeds')"
$PG -d postgres -c "DROP DATABASE $DB"

# --- MariaDB: a raw binlog file with outbox transactions --------------------------------------
# `outboxd_fuzz`.`outbox` is the table outboxd::fuzzing::binlog maps.
$MY -e "DROP DATABASE IF EXISTS outboxd_fuzz; CREATE DATABASE outboxd_fuzz"
$MY outboxd_fuzz < ../migrations/mysql/001_outbox.sql
$MY outboxd_fuzz -e "ALTER TABLE outbox ADD COLUMN headers JSON NULL, ADD COLUMN version BIGINT NULL;
  CREATE TABLE other (id INT PRIMARY KEY, note TEXT)"
read -r FILE START < <($MY -N -e "SHOW MASTER STATUS" | awk '{print $1, $2}')
$MY outboxd_fuzz <<'SQL'
INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
  VALUES (UNHEX(REPLACE(UUID(), '-', '')), 1, 'order.created', '{"n":1}', NOW(6));
BEGIN;
INSERT INTO other VALUES (1, 'x');
INSERT INTO outbox (id, aggregate_id, topic, payload, created_at, headers, version)
  VALUES (UNHEX(REPLACE(UUID(), '-', '')), 2, 'order.paid', '{"total":"19.90","lines":[1,2,3],"note":"ünï"}', NOW(6), '{"trace":"t-1"}', 7),
         (UNHEX(REPLACE(UUID(), '-', '')), 2, 'order.shipped', '[]', NOW(6), NULL, NULL);
UPDATE other SET note = 'y' WHERE id = 1;
DELETE FROM other WHERE id = 1;
COMMIT;
BEGIN;
INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (UNHEX(REPLACE(UUID(), '-', '')), 9, 'never', '{}', NOW(6));
ROLLBACK;
CREATE TABLE ddl_between (x INT);
INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
  VALUES (UNHEX(REPLACE(UUID(), '-', '')), 3, 'blob', JSON_OBJECT('s', REPEAT('x', 3000)), NOW(6));
SQL
read -r _ END < <($MY -N -e "SHOW MASTER STATUS" | awk '{print $1, $2}')
tmp=$(mktemp -d)
mariadb-binlog --read-from-remote-server --raw --host=127.0.0.1 --user=root \
  --start-position="$START" --result-file="$tmp/" "$FILE"
# Keep the file header (magic, format description, GTID list …) and our events; cut at END
# (events carry their end position in the header; other writers may have added more).
python3 - "$tmp/$FILE" "$END" seeds/binlog/seed-mariadb <<'PY'
import struct, sys
data, end = open(sys.argv[1], 'rb').read(), int(sys.argv[2])
out, pos = bytearray(data[:4]), 4
while pos + 19 <= len(data):
    size, log_pos = struct.unpack_from('<II', data, pos + 9)
    if log_pos > end:
        break
    out += data[pos:pos + size]
    pos += size
open(sys.argv[3], 'wb').write(out)
PY
rm -r "$tmp"
$MY -e "DROP DATABASE outboxd_fuzz"
ls -l seeds/pgoutput seeds/binlog
