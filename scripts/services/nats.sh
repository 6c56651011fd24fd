#!/usr/bin/env bash
# NATS for outboxd's NATS sink tests: nats-server with JetStream on 127.0.0.1:4222, file store
# in /var/lib/nats-server (installed from the distribution when missing; started when not
# answering).
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd; called by
# scripts/services.sh (every service), or alone. Idempotent (scripts/services/lib.sh).
set -euo pipefail
# shellcheck source=scripts/services/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

NATS_PORT=4222
NATS_STORE=/var/lib/nats-server
NATS_LOG=/var/log/nats-server.log
NATS_STARTED=no

nats_jetstream_ok() { # the monitoring-free check: the server's INFO line advertises JetStream
    timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$NATS_PORT && head -n1 <&3" 2>/dev/null |
        grep -q '"jetstream":true'
}

nats_section() {
    if ! command -v nats-server >/dev/null; then
        changed nats "installing nats-server"
        apt-get install -y nats-server >/dev/null 2>&1 ||
            { apt-get update >/dev/null 2>&1 && apt-get install -y nats-server >/dev/null; } ||
            die "cannot install nats-server" "apt-get install -y nats-server"
    fi
    if [[ ! -d $NATS_STORE ]]; then
        mkdir -p "$NATS_STORE"
        chmod 750 "$NATS_STORE"
        changed nats "created the JetStream store $NATS_STORE"
    fi
    if nats_jetstream_ok; then
        say nats "ok: JetStream on 127.0.0.1:$NATS_PORT"
        return
    fi
    if pgrep -x nats-server >/dev/null; then
        die "a nats-server runs but does not offer JetStream on 127.0.0.1:$NATS_PORT" \
            "stop it and let this script start one: nats-server -a 127.0.0.1 -p $NATS_PORT -js -sd $NATS_STORE"
    fi
    start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
        -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$NATS_STORE" -l "$NATS_LOG"
    NATS_STARTED=yes
    wait_until "$TIMEOUT" nats_jetstream_ok ||
        die "nats-server did not offer JetStream within ${TIMEOUT}s" "see $NATS_LOG"
    changed nats "started nats-server with JetStream (store $NATS_STORE, log $NATS_LOG)"
}


# nats-server itself is installed by nats_section when missing.
preflight dpkg start-stop-daemon timeout
nats_section
echo "nats      127.0.0.1:$NATS_PORT jetstream store=$NATS_STORE started=$NATS_STARTED changes=$CHANGES"
