#!/usr/bin/env bash
# RabbitMQ streams for the rabbitmq-stream sink's tests: enables the rabbitmq_stream plugin on the
# running node (online, no restart; the plugin list is kept in the node's enabled_plugins file, so
# later boots load it too) and waits until the stream port answers. Idempotent: on a node that
# has it, it only checks. Called by scripts/services.sh after the RabbitMQ section.
set -euo pipefail

STREAM_PORT=${OUTBOXD_STREAM_PORT:-5552}
TIMEOUT=${OUTBOXD_SERVICES_TIMEOUT:-120}

say() { printf '%-9s %s\n' "$1:" "$2"; }
die() {
    printf 'services/rabbitmq-stream.sh: ERROR: %s\n' "$1" >&2
    shift
    local l
    for l in "$@"; do printf 'services/rabbitmq-stream.sh:   %s\n' "$l" >&2; done
    exit 1
}

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$STREAM_PORT" 2>/dev/null; }

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
