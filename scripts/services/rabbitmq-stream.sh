#!/usr/bin/env bash
# RabbitMQ streams for the rabbitmq-stream sink's tests: enables the rabbitmq_stream plugin on the
# running node (online, no restart; the plugin list is kept in the node's enabled_plugins file, so
# later boots load it too) and waits until the stream port answers; adds a stream TLS listener
# (stream.listeners.ssl, 127.0.0.1:5551, with the test CA rabbitmq.sh makes) as a marked block in
# rabbitmq.conf. The node reads that file only when it boots, so it is restarted when the block was
# added or changed, never otherwise. Idempotent: on a node that has both, it only checks. Called by
# scripts/services.sh after the RabbitMQ section.
set -euo pipefail

STREAM_PORT=${OUTBOXD_STREAM_PORT:-5552}
STREAM_TLS_PORT=5551
RMQ_CONF=/etc/rabbitmq/rabbitmq.conf
RMQ_TLS_DIR=/etc/rabbitmq/outboxd-tls
TIMEOUT=${OUTBOXD_SERVICES_TIMEOUT:-120}

say() { printf '%-9s %s\n' "$1:" "$2"; }
die() {
    printf 'services/rabbitmq-stream.sh: ERROR: %s\n' "$1" >&2
    shift
    local l
    for l in "$@"; do printf 'services/rabbitmq-stream.sh:   %s\n' "$l" >&2; done
    exit 1
}

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/${1:-$STREAM_PORT}" 2>/dev/null; }

# The stream TLS listener's block (the server certificate is the one the AMQP TLS listener uses,
# from rabbitmq.sh, which runs first).
[[ -f $RMQ_TLS_DIR/server.pem ]] ||
    die "no test CA in $RMQ_TLS_DIR" "run scripts/services/rabbitmq.sh first (scripts/services.sh does)"
block="# outboxd-stream-tls begin (scripts/services.sh)
stream.listeners.ssl.local = 127.0.0.1:$STREAM_TLS_PORT
# outboxd-stream-tls end"
current=$(sed -n '/^# outboxd-stream-tls begin/,/^# outboxd-stream-tls end/p' "$RMQ_CONF" 2>/dev/null || true)
if [[ $current == "$block" ]]; then
    say stream "TLS listener block in $RMQ_CONF is up to date (ok)"
else
    rest=$(sed '/^# outboxd-stream-tls begin/,/^# outboxd-stream-tls end/d' "$RMQ_CONF" 2>/dev/null || true)
    printf '%s\n%s\n' "$rest" "$block" | sed '/./,$!d' >"$RMQ_CONF.outboxd.tmp"
    mv "$RMQ_CONF.outboxd.tmp" "$RMQ_CONF"
    say stream "CHANGED: wrote the stream TLS listener block ($STREAM_TLS_PORT) into $RMQ_CONF"
    rabbitmqctl -q stop >/dev/null 2>&1 || true
    deadline=$((SECONDS + TIMEOUT))
    while rabbitmqctl -q status >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "RabbitMQ did not stop within ${TIMEOUT}s"
        sleep 0.5
    done
    rabbitmq-server -detached >/dev/null 2>&1 || true
    until rabbitmqctl -q await_startup --timeout 10 >/dev/null 2>&1; do
        ((SECONDS < deadline)) ||
            die "RabbitMQ did not start again within ${TIMEOUT}s" "see /var/log/rabbitmq/; the block is in $RMQ_CONF"
        sleep 0.5
    done
    say stream "CHANGED: restarted the node for the stream TLS listener"
fi

list=$(rabbitmq-plugins -q list)
if grep -Eq '^\[E\*\] rabbitmq_stream ' <<<"$list"; then
    say stream "plugin rabbitmq_stream enabled and running (ok)"
else
    rabbitmq-plugins -q enable rabbitmq_stream >/dev/null ||
        die "could not enable the RabbitMQ stream plugin" "try by hand: rabbitmq-plugins enable rabbitmq_stream"
    say stream "CHANGED: enabled plugin rabbitmq_stream"
fi

deadline=$((SECONDS + TIMEOUT))
until port_open; do
    ((SECONDS < deadline)) ||
        die "the stream port 127.0.0.1:$STREAM_PORT does not answer within ${TIMEOUT}s" \
            "check: rabbitmq-diagnostics listeners | grep stream; see /var/log/rabbitmq/"
    sleep 0.5
done
say stream "stream protocol listens on 127.0.0.1:$STREAM_PORT (ok)"

deadline=$((SECONDS + TIMEOUT))
until echo | timeout 5 openssl s_client -connect 127.0.0.1:$STREAM_TLS_PORT -CAfile "$RMQ_TLS_DIR/ca.pem" -verify_return_error -brief >/dev/null 2>&1; do
    ((SECONDS < deadline)) ||
        die "no verified TLS handshake on the stream TLS port 127.0.0.1:$STREAM_TLS_PORT within ${TIMEOUT}s" \
            "check: rabbitmq-diagnostics listeners | grep stream; the block is in $RMQ_CONF"
    sleep 0.5
done
say stream "stream TLS listens on 127.0.0.1:$STREAM_TLS_PORT and verifies with $RMQ_TLS_DIR/ca.pem (ok)"
