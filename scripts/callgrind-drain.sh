#!/usr/bin/env bash
# Instructions the relay spends per event, counted by callgrind (repeatable on a busy host,
# unlike wall or CPU time): a backlog of EVENTS outbox rows (transactions of 100, the benches'
# ~300-byte body) drained once by `outboxd run` under callgrind into the given sink, and once
# with no backlog, so start-up is subtracted. SOURCE picks the database: postgres (the
# logical slot) or mariadb (the binlog).
#
#   scripts/callgrind-drain.sh rabbitmq       # or: stdout (the source's share alone)
#   SOURCE=mariadb scripts/callgrind-drain.sh rabbitmq
#   EVENTS=20000 OUTBOXD_BIN=target/release/outboxd scripts/callgrind-drain.sh rabbitmq
#
# Needs the local services (scripts/services.sh) and valgrind. Prints the instructions per
# event; the profiles stay in target/callgrind/ for `callgrind_annotate`. Each drain's
# database (and slot) is dropped after it, and the exchanges and queues the relay declared
# are deleted when the script ends, also when it fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SINK=${1:-rabbitmq}
SOURCE=${SOURCE:-postgres}
BIN=${OUTBOXD_BIN:-target/release/outboxd}
EVENTS=${EVENTS:-20000}
OUT=target/callgrind
mkdir -p "$OUT"
command -v valgrind >/dev/null || { echo "callgrind-drain.sh: needs valgrind (apt-get install -y valgrind)" >&2; exit 2; }
[[ -x $BIN ]] || { echo "callgrind-drain.sh: no $BIN; build it with cargo build --release" >&2; exit 2; }
X="cg_$$"
case $SINK in
    rabbitmq) sink_args=(--exchange "$X") ; export OUTBOXD_SINK=amqp://guest:guest@127.0.0.1:5672/%2f ;;
    stdout) sink_args=(--commit-offsets) ; export OUTBOXD_SINK=stdout ;;
    *) echo "callgrind-drain.sh: sink is rabbitmq or stdout" >&2; exit 2 ;;
esac
case $SOURCE in
    postgres | mariadb) ;;
    *) echo "callgrind-drain.sh: SOURCE is postgres or mariadb" >&2; exit 2 ;;
esac
psql_() { psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -qtA "$@"; }
my_() { mariadb -h 127.0.0.1 -u root -N -B "$@"; }

# What the relay declares (`<exchange>`, `<exchange>.unrouted`, the queues `<exchange>.unrouted`
# and `<exchange>.dead`), removed on every exit.
cleanup() {
    [[ $SINK == rabbitmq ]] || return 0
    for q in "$X.unrouted" "$X.dead"; do
        rabbitmqadmin -q delete queue name="$q" >/dev/null 2>&1 || true
    done
    for x in "$X" "$X.unrouted"; do
        rabbitmqadmin -q delete exchange name="$x" >/dev/null 2>&1 || true
    done
}
trap cleanup EXIT

# The backlog: rows $1 to $2 - 1 in transactions of 100 (SQL on stdout).
pg_rows() {
    for ((from = $1; from < $2; from += 100)); do
        echo "INSERT INTO outbox (id, aggregate_id, topic, payload) SELECT gen_random_uuid(), 'agg-' || (g % 1000), 'invoice.issued',
          json_build_object('invoice_id', g, 'customer_name', 'Muhammet Şafak', 'tax_id', '1234567890', 'total', '1499.90',
          'currency', 'TRY', 'lines', json_build_array(json_build_object('sku', 'A-100', 'qty', 2, 'price', '499.95'),
          json_build_object('sku', 'B-200', 'qty', 1, 'price', '500.00')), 'note', repeat('x', 60))
          FROM generate_series($from, $((from + 99))) g;"
    done
}
my_rows() {
    for ((from = $1; from < $2; from += 100)); do
        echo "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
          SELECT UNHEX(REPLACE(UUID(), '-', '')), seq % 1000, 'invoice.issued',
            JSON_OBJECT('invoice_id', seq, 'customer_name', 'Muhammet Şafak', 'tax_id', '1234567890',
              'total', '1499.90', 'currency', 'TRY', 'lines', JSON_ARRAY(
              JSON_OBJECT('sku', 'A-100', 'qty', 2, 'price', '499.95'),
              JSON_OBJECT('sku', 'B-200', 'qty', 1, 'price', '500.00')), 'note', REPEAT('x', 60)),
            NOW(6)
          FROM seq_${from}_to_$((from + 99));"
    done
}

# Messages the relay handed over so far: in the queue behind the alternate exchange (nothing
# else is bound), or lines on stdout.
delivered() {
    if [[ $SINK == rabbitmq ]]; then
        rabbitmqctl -q list_queues name messages 2>/dev/null | awk -v q="$X.unrouted" '$1 == q {print $2}'
    else
        wc -l <"$1"
    fi
}

# Instructions of one drain of $1 events (0: start-up and shutdown only), into $result.
drain() {
    local n=$1 db="cg_$$_$1" dsn done_sql=() want=0
    local file="$OUT/$SOURCE.$SINK.$n.out" printed="$OUT/$SOURCE.$SINK.$n.stdout"
    if [[ $SOURCE == postgres ]]; then
        psql_ -c "CREATE DATABASE $db" >/dev/null
        dsn="postgres://postgres@127.0.0.1:5432/$db?sslmode=disable"
        psql_ -d "$db" -f migrations/postgres/001_outbox.sql >/dev/null
        "$BIN" setup --source "$dsn" --name cg >/dev/null
        pg_rows 0 "$n" | psql_ -d "$db" >/dev/null
        # One more transaction after the backlog: the drain is over when the slot confirmed it.
        psql_ -d "$db" -c "CREATE TABLE done_marker (x int)" >/dev/null
        local end
        end=$(psql_ -d "$db" -c "SELECT pg_current_wal_lsn()")
        done_sql=(psql_ -d "$db" -c "SELECT confirmed_flush_lsn >= '$end' FROM pg_replication_slots WHERE slot_name = 'outboxd_cg'")
    else
        my_ -e "CREATE DATABASE $db"
        my_ "$db" <migrations/mysql/001_outbox.sql
        dsn="mysql://root@127.0.0.1:3306/$db?ssl-mode=disabled"
        local start
        start=$(my_ -e "SHOW MASTER STATUS" | awk '{print $1 ":" $2}')
        # The relay starts where the backlog starts (a first start would begin at the head).
        "$BIN" offset set --source "$dsn" --name cg --binlog-position "$start" >/dev/null
        # Plus one row after the backlog, in both drains (so it cancels out): the drain is over
        # when every row was handed over (a stored binlog position cannot say it: other
        # databases' transactions move the server's head).
        { my_rows 0 "$n"; my_rows "$n" $((n + 100)) | sed "s/seq_${n}_to_$((n + 99))/seq_${n}_to_${n}/"; } | my_ "$db"
        want=$((n + 1))
    fi
    valgrind --tool=callgrind --callgrind-out-file="$file" "$BIN" run --snapshot never \
        --source "$dsn" --name cg --log-level warn "${sink_args[@]}" >"$printed" 2>"$OUT/$SOURCE.$SINK.$n.log" &
    local pid=$!
    while true; do
        if [[ $SOURCE == postgres ]]; then
            [[ $("${done_sql[@]}") == t ]] && break
        else
            [[ $(delivered "$printed") -ge $want ]] 2>/dev/null && break
        fi
        kill -0 $pid 2>/dev/null || { cat "$OUT/$SOURCE.$SINK.$n.log" >&2; echo "callgrind-drain.sh: the relay exited early" >&2; exit 1; }
        sleep 1
    done
    kill -TERM $pid
    wait $pid || true
    if [[ $SOURCE == postgres ]]; then
        psql_ -c "SELECT pg_drop_replication_slot('outboxd_cg')" >/dev/null
        psql_ -c "DROP DATABASE $db WITH (FORCE)" >/dev/null
    else
        my_ -e "DROP DATABASE $db"
    fi
    # The next drain counts its own messages from zero.
    [[ $SINK != rabbitmq ]] || rabbitmqctl -q purge_queue "$X.unrouted" >/dev/null 2>&1 || true
    result=$(awk '/^totals:|^summary:/ {print $2; exit}' "$file")
}

drain 0
base=$result
drain "$EVENTS"
full=$result
echo "$SOURCE → $SINK: $full instructions for $EVENTS events, $base with none: $(( (full - base) / EVENTS )) instructions per event (load: $(cut -d' ' -f1-3 /proc/loadavg))"
