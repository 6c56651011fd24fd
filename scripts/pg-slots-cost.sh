#!/usr/bin/env bash
# What K logical replication slots in use cost a PostgreSQL server while its relays are idle
# (docs/scaling.md, "Many databases"): a private PostgreSQL 15 cluster in a temporary directory
# (never the shared server on 5432), K databases each with an outbox table, a publication and a
# pgoutput slot streamed by pg_recvlogical (a walsender each, as a relay's), and in each database
# one session updating a state row once a second (a relay's lease renewal, which every walsender
# of the cluster reads). After all K walsenders stream, over SECONDS (default 60): the
# walsenders' CPU (utime + stime from /proc/PID/stat), resident and private memory (VmRSS;
# Private_Clean + Private_Dirty of /proc/PID/smaps_rollup), and the whole cluster's CPU.
#
#   scripts/pg-slots-cost.sh K [SECONDS]
#
# Run as root (the cluster runs as the postgres user). OUTBOXD_PG_COST_PORT picks its port
# (default 55461).
set -euo pipefail

K=${1:?usage: pg-slots-cost.sh K [SECONDS]}
SECS=${2:-60}
PORT=${OUTBOXD_PG_COST_PORT:-55461}
BIN=/usr/lib/postgresql/15/bin
[[ $EUID -eq 0 ]] || { echo "pg-slots-cost.sh: run as root" >&2; exit 1; }

DIR=$(mktemp -d /tmp/pg-slots-cost.XXXXXX)
chown postgres "$DIR"
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    runuser -u postgres -- "$BIN/pg_ctl" -D "$DIR/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$DIR"
}
trap cleanup EXIT

runuser -u postgres -- "$BIN/initdb" -D "$DIR/data" -A trust >/dev/null
cat >>"$DIR/data/postgresql.conf" <<EOF
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DIR'
wal_level = logical
max_replication_slots = $((K + 5))
max_wal_senders = $((K + 5))
max_connections = $((2 * K + 20))
EOF
runuser -u postgres -- "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/log" -w start >/dev/null

q() { psql -h 127.0.0.1 -p "$PORT" -U postgres -qAtX "$@"; }

for i in $(seq 1 "$K"); do
    q -c "CREATE DATABASE t$i" >/dev/null
    q -d "t$i" -c "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload text);
        CREATE TABLE outboxd_state (name text PRIMARY KEY, renewed bigint);
        INSERT INTO outboxd_state VALUES ('relay', 0);
        CREATE PUBLICATION p FOR TABLE outbox;" >/dev/null
    q -d "t$i" -c "SELECT 1 FROM pg_create_logical_replication_slot('s$i', 'pgoutput')" >/dev/null
    pg_recvlogical -h 127.0.0.1 -p "$PORT" -U postgres -d "t$i" -S "s$i" --start \
        -o proto_version=1 -o publication_names=p -s 10 -f /dev/null &
    PIDS+=($!)
    # One session per database renewing once a second, as a relay's lease keeper.
    (while :; do echo "UPDATE outboxd_state SET renewed = renewed + 1;"; sleep 1; done |
        q -d "t$i" >/dev/null) &
    PIDS+=($!)
done

deadline=$((SECONDS + 120))
until [[ $(q -c "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'") -eq $K ]]; do
    ((SECONDS < deadline)) || { echo "the $K walsenders did not stream within 120 s" >&2; exit 1; }
    sleep 0.2
done

ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat" 2>/dev/null || echo 0; }
mapfile -t WS < <(q -c "SELECT pid FROM pg_stat_replication")
POSTMASTER=$(head -1 "$DIR/data/postmaster.pid")
cluster_ticks() {
    local t=0 p
    for p in "$POSTMASTER" $(pgrep -P "$POSTMASTER"); do
        t=$((t + $(ticks "$p")))
    done
    echo "$t"
}
declare -A T0
for p in "${WS[@]}"; do T0[$p]=$(ticks "$p"); done
C0=$(cluster_ticks)
start=$(date +%s.%N)
sleep "$SECS"
end=$(date +%s.%N)
C1=$(cluster_ticks)
hz=$(getconf CLK_TCK)
total=0 rss=0 priv=0
for p in "${WS[@]}"; do
    total=$((total + $(ticks "$p") - T0[$p]))
    rss=$((rss + $(awk '/^VmRSS/ { print $2 }' "/proc/$p/status")))
    priv=$((priv + $(awk '/^Private_(Clean|Dirty)/ { s += $2 } END { print s }' "/proc/$p/smaps_rollup")))
done
awk -v k="$K" -v t="$total" -v c="$((C1 - C0))" -v r="$rss" -v pv="$priv" -v hz="$hz" \
    -v s="$start" -v e="$end" 'BEGIN {
    per_min = 60 / (e - s); ms = 1000 / hz
    printf "| %d | %.0f | %.1f | %.1f | %.2f | %.0f |\n", k, t * ms * per_min, t * ms * per_min / k,
        r / k / 1024, pv / k / 1024, c * ms * per_min
}'
