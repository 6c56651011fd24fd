#!/usr/bin/env bash
# Zero to a message in one command (as root, as scripts/test.sh): configures the local services
# with scripts/services.sh (idempotent: nothing changes when they are ready), builds outboxd if
# needed, creates a demo database (a unique name) with the outbox table,
# runs `outboxd check` and `outboxd setup`, starts the relay to the local RabbitMQ, binds a
# queue, writes three events in one business transaction, consumes them and prints each
# (message id, routing key, headers, body), shows `outboxd status` and /metrics, stops the
# relay with SIGTERM and removes everything it created. Exit 0 when all three arrived.
#
# Environment (all optional):
#   OUTBOXD_SKIP_SERVICES=1  do not run scripts/services.sh (services are managed elsewhere)
#   OUTBOXD_BIN   the outboxd binary to use (default: target/debug/outboxd, built with cargo)
#   PGHOST/PGPORT/PGUSER   Postgres (default 127.0.0.1:5432, user postgres, as services.sh)
#   RABBIT_URL    the AMQP URL (default amqp://guest:guest@127.0.0.1:5672/%2f)
#   RABBIT_API    the management API (default http://127.0.0.1:15672/api, user guest/guest)
# Needs psql, python3 (standard library only) and curl.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
RABBIT_URL=${RABBIT_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
RABBIT_API=${RABBIT_API:-http://127.0.0.1:15672/api}
export RABBIT_API

say() { printf '\n== %s\n' "$*"; }
die() { echo "quickstart: $*" >&2; exit 1; }

if [[ ${OUTBOXD_SKIP_SERVICES:-0} == 1 ]]; then
    say "services: skipped (OUTBOXD_SKIP_SERVICES=1)"
else
    say "services (scripts/services.sh: Postgres, MariaDB, RabbitMQ, NATS; changes nothing when ready)"
    scripts/services.sh >"${TMPDIR:-/tmp}/outboxd-quickstart-services.log" 2>&1 || {
        cat "${TMPDIR:-/tmp}/outboxd-quickstart-services.log" >&2
        die "scripts/services.sh failed (its output is above)"
    }
    grep -E '^(postgres|mariadb|rabbitmq|nats) +[0-9]' "${TMPDIR:-/tmp}/outboxd-quickstart-services.log" || true
fi

for tool in psql python3 curl; do
    command -v "$tool" >/dev/null || die "$tool is missing: run scripts/services.sh (as root) first"
done
psql -d postgres -XAtqc 'SELECT 1' >/dev/null 2>&1 \
    || die "Postgres does not answer at $PGHOST:$PGPORT as $PGUSER: run scripts/services.sh (as root) first"
curl -fsS -u guest:guest "$RABBIT_API/overview" >/dev/null 2>&1 \
    || die "RabbitMQ's management API does not answer at $RABBIT_API: run scripts/services.sh (as root) first"

if [[ -z ${OUTBOXD_BIN:-} ]]; then
    say "build (cargo build --bin outboxd; nothing to do when it is up to date)"
    cargo build --quiet --locked --bin outboxd
    OUTBOXD_BIN=target/debug/outboxd
fi
outboxd() { "$OUTBOXD_BIN" "$@"; }

# Unique names: several quickstarts (or tests) may run on one machine at once.
ID=$(python3 -c 'import uuid; print(uuid.uuid4().hex[:10])')
DB=outboxd_demo_$ID
NAME=demo_$ID
EXCHANGE=demo_$ID
QUEUE=$EXCHANGE.invoices
METRICS_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG=$(mktemp)
DSN="postgres://$PGUSER@$PGHOST:$PGPORT/$DB"
export OUTBOXD_SOURCE=$DSN OUTBOXD_NAME=$NAME OUTBOXD_SINK=$RABBIT_URL OUTBOXD_EXCHANGE=$EXCHANGE
# lapin logs a failed passive declaration (check's probe before the relay declared) as an
# error of its own; outboxd's check line already says it.
export OUTBOXD_LOG_LEVEL=${OUTBOXD_LOG_LEVEL:-info,lapin=off,tokio_postgres=warn}
RELAY_PID=""

# The management API: api METHOD PATH [JSON-BODY]
api() {
    local args=(-fsS -u guest:guest -X "$1" "$RABBIT_API/$2")
    if [[ $# -gt 2 ]]; then args+=(-H 'content-type: application/json' --data-binary "$3"); fi
    curl "${args[@]}"
}

cleanup() {
    local rc=$?
    if [[ -n $RELAY_PID ]] && kill -0 "$RELAY_PID" 2>/dev/null; then
        kill -TERM "$RELAY_PID" 2>/dev/null || true
        wait "$RELAY_PID" 2>/dev/null || true
    fi
    outboxd teardown --yes >/dev/null 2>&1 || true
    psql -d postgres -XAtqc "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
    for q in "$QUEUE" "$EXCHANGE.unrouted" "$EXCHANGE.dead"; do
        api DELETE "queues/%2F/$q" >/dev/null 2>&1 || true
    done
    for x in "$EXCHANGE" "$EXCHANGE.unrouted"; do
        api DELETE "exchanges/%2F/$x" >/dev/null 2>&1 || true
    done
    if [[ $rc -ne 0 && -s $LOG ]]; then
        echo "quickstart: failed (exit $rc); the relay's log:" >&2
        tail -n 30 "$LOG" >&2
    fi
    rm -f "$LOG"
    echo "== cleaned up: database $DB, slot outboxd_$NAME, exchange $EXCHANGE and its queues"
    exit "$rc"
}
trap cleanup EXIT

say "database $DB with the outbox table (migrations/postgres/001_outbox.sql)"
psql -d postgres -XAtqc "CREATE DATABASE $DB" >/dev/null
psql -d "$DB" -Xqv ON_ERROR_STOP=1 -f migrations/postgres/001_outbox.sql >/dev/null
psql -d "$DB" -Xqv ON_ERROR_STOP=1 -c 'CREATE TABLE invoices (id bigint PRIMARY KEY, customer text NOT NULL, total numeric NOT NULL)' >/dev/null

say "outboxd check (before setup: the slot and publication are missing)"
outboxd check || true

say "outboxd setup"
outboxd setup

say "outboxd check (after setup)"
outboxd check

say "outboxd run → RabbitMQ exchange $EXCHANGE (metrics on 127.0.0.1:$METRICS_PORT)"
# The binary itself in the background (not the shell function): $! is then the relay's pid.
"$OUTBOXD_BIN" run --metrics-addr "127.0.0.1:$METRICS_PORT" >"$LOG" 2>&1 &
RELAY_PID=$!
for _ in $(seq 1 300); do
    if curl -fs "http://127.0.0.1:$METRICS_PORT/readyz" >/dev/null 2>&1; then break; fi
    kill -0 "$RELAY_PID" 2>/dev/null || die "the relay exited early"
    sleep 0.1
done
curl -fs "http://127.0.0.1:$METRICS_PORT/readyz" >/dev/null || die "the relay did not become ready within 30 s"

say "bind queue $QUEUE to $EXCHANGE with 'invoice.#'"
api PUT "queues/%2F/$QUEUE" '{"durable": true}' >/dev/null
api POST "bindings/%2F/e/$EXCHANGE/q/$QUEUE" '{"routing_key": "invoice.#"}' >/dev/null

say "one business transaction: an invoice row and three outbox events"
psql -d "$DB" -Xqv ON_ERROR_STOP=1 <<'SQL'
BEGIN;
INSERT INTO invoices (id, customer, total) VALUES (42, 'Ayşe', 1499.90);
INSERT INTO outbox (id, aggregate_id, topic, payload, headers, version) VALUES
  (gen_random_uuid(), '42', 'invoice.issued',  '{"invoice_id": 42, "total": "1499.90"}',
   '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}', 1),
  (gen_random_uuid(), '42', 'invoice.sent',    '{"invoice_id": 42, "channel": "email"}', NULL, 2),
  (gen_random_uuid(), '42', 'invoice.paid',    '{"invoice_id": 42, "amount": "1499.90"}', NULL, 3);
COMMIT;
SQL

say "consume from $QUEUE"
python3 - "$QUEUE" <<'PY'
import base64, json, os, sys, time, urllib.request

api, queue = os.environ["RABBIT_API"], sys.argv[1]
auth = "Basic " + base64.b64encode(b"guest:guest").decode()
got, deadline = [], time.time() + 30
while len(got) < 3 and time.time() < deadline:
    req = urllib.request.Request(
        f"{api}/queues/%2F/{queue}/get", method="POST",
        data=json.dumps({"count": 3 - len(got), "ackmode": "ack_requeue_false",
                         "encoding": "auto"}).encode(),
        headers={"Authorization": auth, "content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        got += json.load(r)
    if len(got) < 3:
        time.sleep(0.2)
for m in got:
    p = m["properties"]
    print(f"message {p['message_id']}  routing key {m['routing_key']}")
    for k, v in sorted(p.get("headers", {}).items()):
        print(f"  header {k} = {v}")
    print(f"  body   {m['payload']}")
if len(got) != 3:
    sys.exit(f"quickstart: {len(got)} of 3 messages arrived within 30 s")
PY

say "outboxd status"
outboxd status

say "/metrics (the outboxd_ lines)"
curl -fsS "http://127.0.0.1:$METRICS_PORT/metrics" | grep '^outboxd_' | grep -v '_bucket{' | head -n 40

say "stop the relay (SIGTERM)"
kill -TERM "$RELAY_PID"
rc=0
wait "$RELAY_PID" || rc=$?
RELAY_PID=""
[[ $rc -eq 0 ]] || die "the relay exited with $rc after SIGTERM"
tail -n 1 "$LOG" | sed "s/\x1b\[[0-9;]*m//g"
echo "quickstart: ok — three events committed in one transaction, published, consumed"
