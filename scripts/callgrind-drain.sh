#!/usr/bin/env bash
# Instructions the relay spends per event, counted by callgrind (repeatable on a busy host,
# unlike wall or CPU time): a Postgres backlog of EVENTS outbox rows (transactions of 100, the
# benches' ~300-byte body) drained once by `outboxd run` under callgrind into the given sink,
# and once with no backlog, so start-up is subtracted.
#
#   scripts/callgrind-drain.sh rabbitmq       # or: stdout (the source's share alone)
#   EVENTS=20000 OUTBOXD_BIN=target/release/outboxd scripts/callgrind-drain.sh rabbitmq
#
# Needs the local services (scripts/services.sh) and valgrind. Prints the instructions per
# event; the profiles stay in target/callgrind/ for `callgrind_annotate`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SINK=${1:-rabbitmq}
BIN=${OUTBOXD_BIN:-target/release/outboxd}
EVENTS=${EVENTS:-20000}
OUT=target/callgrind
mkdir -p "$OUT"
command -v valgrind >/dev/null || { echo "callgrind-drain.sh: needs valgrind (apt-get install -y valgrind)" >&2; exit 2; }
[[ -x $BIN ]] || { echo "callgrind-drain.sh: no $BIN; build it with cargo build --release" >&2; exit 2; }
case $SINK in
    rabbitmq) sink_args=(--exchange "cg_$$") ; export OUTBOXD_SINK=amqp://guest:guest@127.0.0.1:5672/%2f ;;
    stdout) sink_args=(--commit-offsets) ; export OUTBOXD_SINK=stdout ;;
    *) echo "callgrind-drain.sh: sink is rabbitmq or stdout" >&2; exit 2 ;;
esac
psql_() { psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -qtA "$@"; }

# Instructions of one drain of $1 events (0: start-up and shutdown only).
drain() {
    local n=$1 db="cg_$$_$1"
    psql_ -c "CREATE DATABASE $db" >/dev/null
    local dsn="postgres://postgres@127.0.0.1:5432/$db?sslmode=disable"
    psql_ -d "$db" -f migrations/postgres/001_outbox.sql >/dev/null
    "$BIN" setup --source "$dsn" --name cg >/dev/null
    for ((from = 0; from < n; from += 100)); do
        echo "INSERT INTO outbox (id, aggregate_id, topic, payload) SELECT gen_random_uuid(), 'agg-' || (g % 1000), 'invoice.issued',
          json_build_object('invoice_id', g, 'customer_name', 'Muhammet Şafak', 'tax_id', '1234567890', 'total', '1499.90',
          'currency', 'TRY', 'lines', json_build_array(json_build_object('sku', 'A-100', 'qty', 2, 'price', '499.95'),
          json_build_object('sku', 'B-200', 'qty', 1, 'price', '500.00')), 'note', repeat('x', 60))
          FROM generate_series($from, $((from + 99))) g;"
    done | psql_ -d "$db" >/dev/null
    # One more transaction after the backlog: the drain is over when the slot confirmed it.
    psql_ -d "$db" -c "CREATE TABLE done_marker (x int)" >/dev/null
    local end
    end=$(psql_ -d "$db" -c "SELECT pg_current_wal_lsn()")
    local file="$OUT/$SINK.$n.out"
    valgrind --tool=callgrind --callgrind-out-file="$file" "$BIN" run --snapshot never \
        --source "$dsn" --name cg --log-level warn "${sink_args[@]}" >/dev/null 2>"$OUT/$SINK.$n.log" &
    local pid=$!
    until [[ $(psql_ -d "$db" -c "SELECT confirmed_flush_lsn >= '$end' FROM pg_replication_slots WHERE slot_name = 'outboxd_cg'") == t ]]; do
        kill -0 $pid 2>/dev/null || { cat "$OUT/$SINK.$n.log" >&2; echo "callgrind-drain.sh: the relay exited early" >&2; exit 1; }
        sleep 1
    done
    kill -TERM $pid
    wait $pid || true
    psql_ -c "SELECT pg_drop_replication_slot('outboxd_cg')" >/dev/null
    psql_ -c "DROP DATABASE $db WITH (FORCE)" >/dev/null
    awk '/^totals:|^summary:/ {print $2; exit}' "$file"
}

base=$(drain 0)
full=$(drain "$EVENTS")
echo "$SINK: $full instructions for $EVENTS events, $base with none: $(( (full - base) / EVENTS )) instructions per event (load: $(cut -d' ' -f1-3 /proc/loadavg))"
