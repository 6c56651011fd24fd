#!/usr/bin/env bash
# RabbitMQ for outboxd's tests: running, plugins rabbitmq_consistent_hash_exchange and
# rabbitmq_management, a TLS listener on 127.0.0.1:5671 with a self-signed test CA (server and
# client certificates under /etc/rabbitmq/outboxd-tls/).
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd; called by
# scripts/services.sh (every service), or alone. Idempotent (scripts/services/lib.sh).
set -euo pipefail
# shellcheck source=scripts/services/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

RMQ_PORT=5672
RMQ_PLUGINS=(rabbitmq_consistent_hash_exchange rabbitmq_management)
RMQ_TLS_PORT=5671
RMQ_TLS_DIR=/etc/rabbitmq/outboxd-tls
RMQ_CONF=/etc/rabbitmq/rabbitmq.conf
RMQ_STARTED=no

rmq_running() { rabbitmqctl -q status >/dev/null 2>&1; }
rmq_booted() { rabbitmqctl -q await_startup --timeout 10; }

rabbitmq_section() {
    if rmq_running; then
        say rabbitmq "node is running"
    else
        say rabbitmq "node is not running: starting it (rabbitmq-server -detached)"
        local t0=$SECONDS
        rabbitmq-server -detached >/dev/null 2>&1 || true
        wait_until "$TIMEOUT" rmq_booted ||
            die "RabbitMQ did not start within ${TIMEOUT}s" \
                "see /var/log/rabbitmq/ and try by hand: rabbitmq-server -detached && rabbitmqctl await_startup"
        RMQ_STARTED="yes ($((SECONDS - t0))s)"
        changed rabbitmq "started the node in $((SECONDS - t0))s"
    fi

    # A broker test interrupted half-way can leave the application stopped or a memory alarm
    # raised (watermark 0): undo both, or every publish would wait.
    if ! rabbitmqctl -q eval 'rabbit:is_running().' 2>/dev/null | grep -q true; then
        rabbitmqctl -q start_app >/dev/null 2>&1 ||
            die "the RabbitMQ application does not start" "try by hand: rabbitmqctl start_app"
        changed rabbitmq "started the rabbit application (it was stopped)"
    fi
    local wm
    wm=$(rabbitmqctl -q eval 'vm_memory_monitor:get_vm_memory_high_watermark().' 2>/dev/null || echo '?')
    if [[ $wm == 0 || $wm == 0.0 ]]; then
        rabbitmqctl -q set_vm_memory_high_watermark 0.4 >/dev/null ||
            die "could not reset the memory watermark" "rabbitmqctl set_vm_memory_high_watermark 0.4"
        changed rabbitmq "reset the memory high watermark from $wm to 0.4"
    else
        say rabbitmq "memory high watermark $wm (ok)"
    fi

    local list p
    list=$(rabbitmq-plugins -q list)
    for p in "${RMQ_PLUGINS[@]}"; do
        if grep -Eq "^\[E\*\] $p " <<<"$list"; then
            say rabbitmq "plugin $p enabled and running (ok)"
        elif grep -Eq "^\[E \] $p " <<<"$list"; then
            die "plugin $p is enabled but not running on the node" \
                "restart RabbitMQ: rabbitmqctl stop && rabbitmq-server -detached && rabbitmqctl await_startup"
        else
            rabbitmq-plugins -q enable "$p" >/dev/null ||
                die "could not enable RabbitMQ plugin $p" "try by hand: rabbitmq-plugins enable $p"
            changed rabbitmq "enabled plugin $p"
        fi
    done
}

# A test CA with a server certificate for localhost/127.0.0.1 and a client certificate, made once;
# made again only when a file is missing or the server certificate no longer verifies.
rabbitmq_tls_files() {
    local d=$RMQ_TLS_DIR
    if [[ -f $d/ca.pem && -f $d/server.pem && -f $d/server.key && -f $d/client.pem && -f $d/client.key ]] &&
        openssl verify -CAfile "$d/ca.pem" "$d/server.pem" "$d/client.pem" >/dev/null 2>&1 &&
        openssl x509 -checkend 86400 -noout -in "$d/server.pem" >/dev/null 2>&1; then
        say rabbitmq "TLS test certificates in $d (ok)"
        return 0
    fi
    command -v openssl >/dev/null || die "openssl is needed to make the TLS test certificates" "apt-get install -y openssl"
    mkdir -p "$d"
    local tmp
    tmp=$(mktemp -d)
    (
        cd "$tmp"
        openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=outboxd test CA" \
            -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
            -keyout ca.key -out ca.pem
        local who
        for who in server client; do
            local cn=localhost ext="subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
            if [[ $who == client ]]; then
                cn=outboxd-client ext="extendedKeyUsage=clientAuth"
            fi
            openssl req -newkey rsa:2048 -nodes -subj "/CN=$cn" -keyout "$who.key" -out "$who.csr"
            printf '%s\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n' "$ext" >"$who.ext"
            openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
                -extfile "$who.ext" -out "$who.pem"
        done
    ) >/dev/null 2>&1 || die "could not make the TLS test certificates with openssl (in $tmp)"
    install -m 0644 "$tmp/ca.pem" "$tmp/server.pem" "$tmp/client.pem" "$d/"
    install -m 0640 -g rabbitmq "$tmp/server.key" "$d/"
    install -m 0600 "$tmp/ca.key" "$tmp/client.key" "$d/"
    rm -rf "$tmp"
    changed rabbitmq "made a test CA, server and client certificates in $d"
    RMQ_TLS_CERTS_NEW=1
}

# The TLS listener: a marked block in rabbitmq.conf. The node reads its configuration only when it
# boots, so it is restarted when the block changed (or the certificates were made again).
rabbitmq_tls_section() {
    RMQ_TLS_CERTS_NEW=0
    rabbitmq_tls_files
    local block
    block="# outboxd-tls begin (scripts/services.sh)
listeners.ssl.local = 127.0.0.1:$RMQ_TLS_PORT
ssl_options.cacertfile = $RMQ_TLS_DIR/ca.pem
ssl_options.certfile = $RMQ_TLS_DIR/server.pem
ssl_options.keyfile = $RMQ_TLS_DIR/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
# outboxd-tls end"
    local current=""
    if [[ -f $RMQ_CONF ]]; then
        current=$(sed -n '/^# outboxd-tls begin/,/^# outboxd-tls end/p' "$RMQ_CONF")
    fi
    local restart=$RMQ_TLS_CERTS_NEW
    if [[ $current == "$block" ]]; then
        say rabbitmq "TLS listener block in $RMQ_CONF is up to date (ok)"
    else
        local rest=""
        if [[ -f $RMQ_CONF ]]; then
            rest=$(sed '/^# outboxd-tls begin/,/^# outboxd-tls end/d' "$RMQ_CONF")
        fi
        printf '%s\n%s\n' "$rest" "$block" | sed '/./,$!d' >"$RMQ_CONF.outboxd.tmp"
        mv "$RMQ_CONF.outboxd.tmp" "$RMQ_CONF"
        changed rabbitmq "wrote the TLS listener block ($RMQ_TLS_PORT) into $RMQ_CONF"
        restart=1
    fi
    if [[ $restart == 0 ]] && ! rabbitmq-diagnostics -q listeners 2>/dev/null | grep -q "port: $RMQ_TLS_PORT,"; then
        say rabbitmq "TLS listener on $RMQ_TLS_PORT is configured but not running"
        restart=1
    fi
    if [[ $restart == 1 ]]; then
        local t0=$SECONDS
        rabbitmqctl -q stop >/dev/null 2>&1 || true
        wait_until "$TIMEOUT" bash -c '! rabbitmqctl -q status' ||
            die "RabbitMQ did not stop within ${TIMEOUT}s"
        rabbitmq-server -detached >/dev/null 2>&1 || true
        wait_until "$TIMEOUT" rmq_booted ||
            die "RabbitMQ did not start again within ${TIMEOUT}s" \
                "see /var/log/rabbitmq/; the TLS block is in $RMQ_CONF"
        RMQ_STARTED="restarted for TLS ($((SECONDS - t0))s)"
        changed rabbitmq "restarted the node for the TLS listener in $((SECONDS - t0))s"
    fi
}

# Sends the AMQP 0-9-1 protocol header; a broker answers with a Connection.Start frame (type 1).
amqp_answers() {
    local first
    first=$(timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$RMQ_PORT && printf 'AMQP\\x00\\x00\\x09\\x01' >&3 && head -c 1 <&3" |
        od -An -tx1 | tr -d ' \n')
    [[ $first == 01 ]]
}

verify() {
    local failures=()
    if amqp_answers; then
        say verify "rabbitmq answers AMQP 0-9-1 on 127.0.0.1:$RMQ_PORT (ok)"
    else
        failures+=("rabbitmq: no AMQP answer on 127.0.0.1:$RMQ_PORT; see /var/log/rabbitmq/")
    fi
    if wait_until 30 bash -c "echo | timeout 5 openssl s_client -connect 127.0.0.1:$RMQ_TLS_PORT -CAfile $RMQ_TLS_DIR/ca.pem -verify_return_error -brief"; then
        say verify "rabbitmq TLS listener on 127.0.0.1:$RMQ_TLS_PORT verifies with $RMQ_TLS_DIR/ca.pem (ok)"
    else
        failures+=("rabbitmq: no verified TLS handshake on 127.0.0.1:$RMQ_TLS_PORT; see /var/log/rabbitmq/ and $RMQ_CONF")
    fi
    if command -v curl >/dev/null 2>&1; then
        if wait_until 30 curl -fsS -o /dev/null -u guest:guest http://127.0.0.1:15672/api/overview; then
            say verify "rabbitmq management API answers on 127.0.0.1:15672 (ok)"
        else
            failures+=("rabbitmq: management API http://127.0.0.1:15672/api/overview does not answer")
        fi
    fi
    if ((${#failures[@]})); then
        die "verification failed:" "${failures[@]}"
    fi
    echo "rabbitmq  $(rabbitmqctl -q version 2>/dev/null || echo '?') 127.0.0.1:$RMQ_PORT tls=127.0.0.1:$RMQ_TLS_PORT plugins=${RMQ_PLUGINS[*]} started=$RMQ_STARTED changes=$CHANGES"
}

preflight rabbitmq-server rabbitmqctl rabbitmq-plugins rabbitmq-server timeout openssl
rabbitmq_section
rabbitmq_tls_section
verify
