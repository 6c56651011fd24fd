#!/usr/bin/env bash
# Resident memory (VmRSS) of one outboxd relay, idle and at full speed, into RabbitMQ:
#   1. first start on an empty outbox table, ready (/readyz 200): idle RSS for IDLE_S seconds;
#   2. the relay stopped, EVENTS rows committed (in 1,000-row transactions) behind its position;
#   3. restarted: RSS sampled every 100 ms while it drains the backlog into RabbitMQ (done when
#      <exchange>.unrouted holds EVENTS messages; no queue is bound, so every message lands
#      there, kept, never dropped);
#   4. idle again for IDLE_S seconds after the drain.
# Usage: scripts/rss.sh postgres|mariadb [BINARY]   (default target/release/outboxd)
# Needs the services of scripts/services.sh. Cleans up its database, slot and queues.
set -euo pipefail

SOURCE=${1:?usage: scripts/rss.sh postgres|mariadb [BINARY]}
BIN=${2:-target/release/outboxd}
EVENTS=${EVENTS:-200000}
IDLE_S=${IDLE_S:-10}
TAG="rss_$$"
X="rss_x_$$"
PORT=$((19000 + $$ % 1000))
SINK="amqp://guest:guest@127.0.0.1:5672/%2f"

case $SOURCE in
postgres)
    DSN="postgres://postgres@127.0.0.1:5432/$TAG"
    psql -qX -h 127.0.0.1 -U postgres -d test -c "CREATE DATABASE $TAG"
    psql -qX -h 127.0.0.1 -U postgres -d "$TAG" -f migrations/postgres/001_outbox.sql
    backlog() {
        for ((i = 0; i < EVENTS; i += 1000)); do
            echo "INSERT INTO outbox (id, aggregate_id, topic, payload)
                  SELECT gen_random_uuid(), 'agg-' || (g % 1000), 'invoice.issued',
                         json_build_object('invoice_id', g, 'customer_name', 'Muhammet Şafak', 'total', '1499.90',
                                           'currency', 'TRY', 'note', repeat('x', 60))
                    FROM generate_series($i, $((i + 999))) g;"
        done | psql -qX -h 127.0.0.1 -U postgres -d "$TAG"
    }
    cleanup_db() {
        "$BIN" teardown --source "$DSN" --name rss --yes >/dev/null 2>&1 || true
        psql -qX -h 127.0.0.1 -U postgres -d test -c "DROP DATABASE IF EXISTS $TAG WITH (FORCE)" || true
    }
    ;;
mariadb)
    DSN="mysql://root@127.0.0.1:3306/$TAG"
    mysql -uroot -h127.0.0.1 --protocol=TCP -e "CREATE DATABASE $TAG"
    mysql -uroot -h127.0.0.1 --protocol=TCP "$TAG" <migrations/mysql/001_outbox.sql
    backlog() {
        for ((i = 0; i < EVENTS; i += 1000)); do
            echo "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
                  SELECT UNHEX(REPLACE(UUID(), '-', '')), seq % 1000, 'invoice.issued',
                         JSON_OBJECT('invoice_id', seq, 'customer_name', 'Muhammet Şafak', 'total', '1499.90',
                                     'currency', 'TRY', 'note', REPEAT('x', 60)), NOW(6)
                    FROM seq_${i}_to_$((i + 999));"
        done | mysql -uroot -h127.0.0.1 --protocol=TCP "$TAG"
    }
    cleanup_db() { mysql -uroot -h127.0.0.1 --protocol=TCP -e "DROP DATABASE IF EXISTS $TAG" || true; }
    ;;
*) echo "usage: scripts/rss.sh postgres|mariadb [BINARY]" >&2; exit 2 ;;
esac

PID=
cleanup() {
    [[ -n $PID ]] && kill -TERM "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
    cleanup_db
    for q in "$X.unrouted" "$X.dead"; do rabbitmqctl -q delete_queue "$q" >/dev/null 2>&1 || true; done
    for e in "$X" "$X.unrouted"; do rabbitmqadmin -q delete exchange name="$e" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

start() {
    OUTBOXD_SINK=$SINK "$BIN" run --source "$DSN" --name rss --exchange "$X" \
        --metrics-addr "127.0.0.1:$PORT" --log-level warn --snapshot never &
    PID=$!
    for _ in $(seq 600); do
        "$BIN" health --addr "127.0.0.1:$PORT" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "relay not ready in 60 s" >&2
    exit 1
}
stop() { kill -TERM "$PID"; wait "$PID" || true; PID=; }
rss() { awk '/^VmRSS:/ {print $2}' "/proc/$PID/status"; }
# summary of KiB samples on stdin: median and max in MiB
summary() { sort -n | awk '{a[NR]=$1} END {printf "median %.1f MiB, max %.1f MiB (%d samples)", a[int((NR+1)/2)]/1024, a[NR]/1024, NR}'; }
queued() { rabbitmqctl -q list_queues name messages 2>/dev/null | awk -v q="$X.unrouted" '$1 == q {print $2}'; }

start
idle1=$(for _ in $(seq $((IDLE_S * 10))); do rss; sleep 0.1; done | summary)
stop
backlog
t0=$(date +%s.%N)
start
samples=$(mktemp)
# Sampled every 100 ms in the background while the queue depth is polled (about 1 s a call).
(while kill -0 "$PID" 2>/dev/null; do rss >>"$samples" 2>/dev/null || true; sleep 0.1; done) &
SAMPLER=$!
while :; do
    n=$(queued)
    ((${n:-0} >= EVENTS)) && break
    if (($(date +%s) - ${t0%.*} > 900)); then echo "drain not done in 15 min ($n)" >&2; exit 1; fi
    sleep 0.2
done
t1=$(date +%s.%N)
kill "$SAMPLER" 2>/dev/null || true
wait "$SAMPLER" 2>/dev/null || true
busy=$(summary <"$samples")
rm -f "$samples"
idle2=$(for _ in $(seq $((IDLE_S * 10))); do rss; sleep 0.1; done | summary)
rate=$(awk -v n="$EVENTS" -v a="$t0" -v b="$t1" 'BEGIN {printf "%.0f", n / (b - a)}')
echo "| $SOURCE | idle (first start, ready) | $idle1 |"
echo "| $SOURCE | draining $EVENTS events → RabbitMQ ($rate events/s incl. start) | $busy |"
echo "| $SOURCE | idle after the drain | $idle2 |"
