#!/usr/bin/env bash
# Configure the local PostgreSQL, MariaDB and RabbitMQ for outboxd's CDC tests:
#   - PostgreSQL: wal_level=logical, replication slots/senders, replication lines in pg_hba.conf,
#                 TLS with a test CA (server certificate for localhost and 127.0.0.1)
#   - MariaDB:    binary log in ROW format with FULL row image and FULL row metadata, TLS with
#                 the same test CA (its own server certificate, mariadb.crt)
#   - RabbitMQ:   running, plugins rabbitmq_consistent_hash_exchange and rabbitmq_management,
#                 a TLS listener on 127.0.0.1:5671 with a self-signed test CA (server and client
#                 certificates under /etc/rabbitmq/outboxd-tls/)
#   - NATS:       nats-server with JetStream on 127.0.0.1:4222, file store in /var/lib/nats-server
#                 (installed from the distribution when missing; started when not answering)
#   - docker-compose: Debian's package, installed when missing (validates docker-compose.yml;
#                 no Docker engine runs here); a warning, not a failure, when apt is unreachable
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd.
# Idempotent: every run checks everything (one line per check) and changes or restarts a service
# only when something actually differs from what the tests need. A second run changes nothing.
#
# Environment (all optional):
#   OUTBOXD_SERVICES_TIMEOUT  seconds to wait for a service to come up (default 120)
#   OUTBOXD_PG_VERSION        PostgreSQL major version (default: newest in /etc/postgresql)
#   OUTBOXD_PG_CLUSTER        cluster name (default main)
#   OUTBOXD_PG_TLS_DIR        where the test CA and server certificate live (default /etc/outboxd/tls;
#                             the tests read the same variable)
set -euo pipefail

TIMEOUT=${OUTBOXD_SERVICES_TIMEOUT:-120}
PG_HOST=127.0.0.1
PG_DB="test"
# Not under /etc/postgresql: tools (and older copies of this script) take every directory there
# for a PostgreSQL version.
PG_TLS_DIR=${OUTBOXD_PG_TLS_DIR:-/etc/outboxd/tls}
PG_TLS_DAYS=3650
PG_TLS_MIN_LEFT=$((30 * 86400)) # renew certificates that expire within 30 days
MY_HOST=127.0.0.1
MY_PORT=3306
MY_DB="test"
MY_CONF_DIR=/etc/mysql/mariadb.conf.d
MY_CONF_FILE=$MY_CONF_DIR/60-outboxd.cnf
MY_MAIN_CNF=/etc/mysql/my.cnf
MARIADBD=/usr/sbin/mariadbd
RMQ_PORT=5672
RMQ_PLUGINS=(rabbitmq_consistent_hash_exchange rabbitmq_management)
RMQ_TLS_PORT=5671
RMQ_TLS_DIR=/etc/rabbitmq/outboxd-tls
RMQ_CONF=/etc/rabbitmq/rabbitmq.conf

CHANGES=0
PG_RESTARTED=no
MY_RESTARTED=no
RMQ_STARTED=no

say() { printf '%-9s %s\n' "$1:" "$2"; }
changed() { CHANGES=$((CHANGES + 1)); say "$1" "CHANGED: $2"; }
die() {
    printf 'services.sh: ERROR: %s\n' "$1" >&2
    shift
    local l
    for l in "$@"; do printf 'services.sh:   %s\n' "$l" >&2; done
    exit 1
}

# wait_until SECONDS CMD...: run CMD until it succeeds or the deadline passes.
wait_until() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

preflight() {
    if [[ $EUID -ne 0 ]]; then
        die "scripts/services.sh configures system services and must run as root." \
            "Run it once as root: sudo scripts/services.sh" \
            "If your services are managed elsewhere (e.g. docker-compose up), run the tests with OUTBOXD_SKIP_SERVICES=1 scripts/test.sh"
    fi
    local missing=() c
    for c in pg_lsclusters pg_ctlcluster pg_isready psql runuser mysql mysqladmin \
        start-stop-daemon rabbitmqctl rabbitmq-plugins rabbitmq-server timeout openssl; do
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    [[ -x $MARIADBD ]] || missing+=("$MARIADBD")
    if ((${#missing[@]})); then
        die "missing commands: ${missing[*]}" \
            "install the services: apt-get install -y postgresql mariadb-server mariadb-client rabbitmq-server"
    fi
}

# ---------------------------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------------------------

# name | value for ALTER SYSTEM | pg_settings.setting when applied (wal_sender_timeout is in ms)
PG_WANTED=(
    "wal_level|logical|logical"
    "max_replication_slots|20|20"
    "max_wal_senders|20|20"
    "wal_sender_timeout|60s|60000"
    "ssl|on|on"
    "ssl_cert_file|$PG_TLS_DIR/server.crt|$PG_TLS_DIR/server.crt"
    "ssl_key_file|$PG_TLS_DIR/server.key|$PG_TLS_DIR/server.key"
)
# Order matters (missing lines go to the top in this order): the role outboxd_tls_only may log
# in over TLS only, so a test can prove that a connection used TLS (tests/postgres/pg_poll.rs).
PG_HBA_LINES=(
    "host replication all 127.0.0.1/32 trust"
    "host replication all ::1/128 trust"
    "hostssl all outboxd_tls_only 127.0.0.1/32 trust"
    "hostssl all outboxd_tls_only ::1/128 trust"
    "host all outboxd_tls_only 0.0.0.0/0 reject"
    "host all outboxd_tls_only ::/0 reject"
)

# Admin queries go through the Unix socket as the postgres OS user (works with Debian's default
# peer authentication as well as with trust).
pgq() {
    runuser -u postgres -- psql -X -q -At -v ON_ERROR_STOP=1 \
        -h /var/run/postgresql -p "$PG_PORT" -d postgres -c "$1"
}

pg_ready() { pg_isready -q -h "$PG_HOST" -p "$PG_PORT" && pgq "SELECT 1" >/dev/null; }

pg_wait() {
    wait_until "$TIMEOUT" pg_ready ||
        die "PostgreSQL $PG_VERSION/$PG_CLUSTER did not accept connections on $PG_HOST:$PG_PORT within ${TIMEOUT}s" \
            "see its log: tail -n 50 $PG_LOG" \
            "start it by hand: pg_ctlcluster --skip-systemctl-redirect $PG_VERSION $PG_CLUSTER start"
}

pg_cluster_field() { # column number of `pg_lsclusters -h` for our cluster
    pg_lsclusters -h | awk -v v="$PG_VERSION" -v c="$PG_CLUSTER" -v f="$1" '$1 == v && $2 == c { print $f }'
}

pg_setting() { pgq "SELECT setting FROM pg_settings WHERE name = '$1'"; }

postgres_section() {
    [[ -d /etc/postgresql ]] || die "no /etc/postgresql directory" "install PostgreSQL: apt-get install -y postgresql"
    # shellcheck disable=SC2012 # version directories are plain numbers; skip anything else
    PG_VERSION=${OUTBOXD_PG_VERSION:-$(ls /etc/postgresql | { grep -E '^[0-9]+(\.[0-9]+)?$' || true; } | sort -V | tail -n 1)}
    PG_CLUSTER=${OUTBOXD_PG_CLUSTER:-main}
    [[ -n $PG_VERSION && -d /etc/postgresql/$PG_VERSION/$PG_CLUSTER ]] ||
        die "no PostgreSQL cluster /etc/postgresql/$PG_VERSION/$PG_CLUSTER" \
            "create one: pg_createcluster $PG_VERSION $PG_CLUSTER (or set OUTBOXD_PG_VERSION / OUTBOXD_PG_CLUSTER)"
    PG_PORT=$(pg_cluster_field 3)
    PG_LOG=$(pg_cluster_field 7)
    [[ -n $PG_PORT ]] || die "pg_lsclusters does not list $PG_VERSION/$PG_CLUSTER"

    local status
    status=$(pg_cluster_field 4)
    if [[ $status == online* ]]; then
        say postgres "cluster $PG_VERSION/$PG_CLUSTER is running (port $PG_PORT)"
    else
        say postgres "cluster $PG_VERSION/$PG_CLUSTER is $status: starting it"
        local t0=$SECONDS
        pg_ctlcluster --skip-systemctl-redirect "$PG_VERSION" "$PG_CLUSTER" start ||
            die "could not start PostgreSQL $PG_VERSION/$PG_CLUSTER" "see its log: tail -n 50 $PG_LOG"
        pg_wait
        changed postgres "started cluster $PG_VERSION/$PG_CLUSTER in $((SECONDS - t0))s"
    fi
    pg_wait

    # TLS files first: the ssl_* settings below point at them.
    local reload=no
    pg_tls_files
    if [[ $PG_TLS_CHANGED == yes ]]; then
        reload=yes # the server reads certificate and key files on reload only
    fi

    # Settings: ALTER SYSTEM only when the configuration files do not already say so.
    local entry name value applied file_value
    for entry in "${PG_WANTED[@]}"; do
        IFS='|' read -r name value applied <<<"$entry"
        file_value=$(pgq "SELECT setting FROM pg_file_settings WHERE name = '$name' AND error IS NULL ORDER BY seqno DESC LIMIT 1")
        if [[ $file_value == "$value" ]]; then
            say postgres "config $name = '$value' (ok)"
        else
            pgq "ALTER SYSTEM SET $name = '$value'"
            changed postgres "ALTER SYSTEM SET $name = '$value' (config had '${file_value:-default}')"
            reload=yes
        fi
    done

    # pg_hba.conf: replication connections are matched only by `replication` lines.
    local hba line re missing=()
    hba=$(pgq "SHOW hba_file")
    [[ -f $hba ]] || die "pg_hba.conf not found at '$hba' (SHOW hba_file)"
    for line in "${PG_HBA_LINES[@]}"; do
        re="^[[:space:]]*$(sed -e 's/[.]/[.]/g' -e 's/ /[[:space:]]+/g' <<<"$line")([[:space:]]|\$)"
        if grep -Eq "$re" "$hba"; then
            say postgres "pg_hba.conf has '$line' (ok)"
        else
            missing+=("$line")
        fi
    done
    if ((${#missing[@]})); then
        local tmp
        tmp=$(mktemp)
        {
            echo "# added by outboxd scripts/services.sh: replication connections and a TLS-only role for the tests"
            printf '%s\n' "${missing[@]}"
            cat "$hba"
        } >"$tmp"
        cat "$tmp" >"$hba" # keeps the file's owner and mode
        rm -f "$tmp"
        for line in "${missing[@]}"; do changed postgres "added '$line' at the top of $hba"; done
        reload=yes
    fi

    if [[ $reload == yes ]]; then
        local errors
        errors=$(pgq "SELECT count(*) FROM pg_hba_file_rules WHERE error IS NOT NULL")
        [[ $errors == 0 ]] || die "$hba has errors; PostgreSQL would keep the old rules" \
            "see: psql -h $PG_HOST -U postgres -c 'SELECT line_number, error FROM pg_hba_file_rules WHERE error IS NOT NULL'"
        pgq "SELECT pg_reload_conf()" >/dev/null
        say postgres "reloaded the configuration (pg_reload_conf)"
        # the postmaster applies SIGHUP asynchronously: wait until new sessions see it
        wait_until 10 pg_sighup_applied || true
        if [[ $PG_TLS_CHANGED == yes ]]; then
            wait_until 10 pg_tls_serves || true # new certificate: verify() says if it never came
        fi
    fi

    # Restart only when a setting that needs one differs from what the server runs with.
    local restart_for=() context running
    for entry in "${PG_WANTED[@]}"; do
        IFS='|' read -r name value applied <<<"$entry"
        context=$(pgq "SELECT context FROM pg_settings WHERE name = '$name'")
        running=$(pg_setting "$name")
        if [[ $running == "$applied" ]]; then
            say postgres "running $name = $running (ok)"
        elif [[ $context == postmaster ]]; then
            say postgres "running $name = $running, wanted $applied: needs a restart"
            restart_for+=("$name")
        else
            die "PostgreSQL runs with $name = $running after a reload, wanted $applied" \
                "something overrides it (a -c option in /etc/postgresql/$PG_VERSION/$PG_CLUSTER/pg_ctl.conf, or a role/database setting)"
        fi
    done
    if ((${#restart_for[@]})); then
        local t0=$SECONDS
        say postgres "restarting cluster $PG_VERSION/$PG_CLUSTER (for ${restart_for[*]})"
        pg_ctlcluster --skip-systemctl-redirect "$PG_VERSION" "$PG_CLUSTER" restart ||
            die "could not restart PostgreSQL $PG_VERSION/$PG_CLUSTER" "see its log: tail -n 50 $PG_LOG"
        pg_wait
        PG_RESTARTED="yes ($((SECONDS - t0))s)"
        changed postgres "restarted cluster $PG_VERSION/$PG_CLUSTER in $((SECONDS - t0))s"
        for entry in "${PG_WANTED[@]}"; do
            IFS='|' read -r name value applied <<<"$entry"
            running=$(pg_setting "$name")
            [[ $running == "$applied" ]] ||
                die "after the restart PostgreSQL still runs with $name = $running, wanted $applied" \
                    "something overrides it: look for -c options in /etc/postgresql/$PG_VERSION/$PG_CLUSTER/pg_ctl.conf"
        done
    fi

    if [[ $(pgq "SELECT count(*) FROM pg_database WHERE datname = '$PG_DB'") == 1 ]]; then
        say postgres "database $PG_DB exists (ok)"
    else
        pgq "CREATE DATABASE $PG_DB"
        changed postgres "created database $PG_DB"
    fi
    # The TLS-only role of PG_HBA_LINES (a superuser, as postgres is here: tests own their
    # databases and need no grants).
    if [[ $(pgq "SELECT count(*) FROM pg_roles WHERE rolname = 'outboxd_tls_only'") == 1 ]]; then
        say postgres "role outboxd_tls_only exists (ok)"
    else
        pgq "CREATE ROLE outboxd_tls_only LOGIN SUPERUSER"
        changed postgres "created role outboxd_tls_only (may log in over TLS only)"
    fi
}

# ---- PostgreSQL TLS: a test CA, a server certificate it signs, and an unrelated CA ----------
#
#   ca.key        root 0600      the test CA's key (only this script signs with it)
#   ca.crt        0644           the test CA: sslrootcert for the tests
#   server.crt    0644           CN localhost, SAN DNS:localhost + IP:127.0.0.1, signed by ca.crt
#   server.key    postgres 0600  (PostgreSQL refuses a key readable by others)
#   ca-other.crt  0644           a CA that signed nothing here: verification must fail with it
#   mariadb.crt   0644           MariaDB's server certificate (same names, same CA)
#   mariadb.key   mysql 0600

PG_TLS_CHANGED=no
PG_TLS_TMP=""
PG_TLS_SAN="DNS:localhost, IP Address:127.0.0.1"

tls_ok_for() { # FILE: a certificate that stays valid for PG_TLS_MIN_LEFT more seconds
    [[ -s $1 ]] && openssl x509 -in "$1" -noout -checkend "$PG_TLS_MIN_LEFT" >/dev/null 2>&1
}

tls_key_matches() { # CERT KEY: the certificate holds the key's public half
    local a b
    a=$(openssl x509 -in "$1" -noout -pubkey 2>/dev/null) || return 1
    b=$(openssl pkey -in "$2" -pubout 2>/dev/null) || return 1
    [[ -n $a && $a == "$b" ]]
}

tls_new_ca() { # KEYFILE CERTFILE CN: a self-signed CA (EC P-256)
    openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$1" -out "$2" -days "$PG_TLS_DAYS" -subj "/CN=$3" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" >/dev/null 2>&1 ||
        die "openssl could not create the CA '$3' in $(dirname "$2")"
}

# tls_server_cert SECTION NAME OWNER NEW_CA: $PG_TLS_DIR/NAME.crt (CN localhost, SAN
# $PG_TLS_SAN, signed by the test CA) and NAME.key (OWNER, 0600: the servers refuse a key others
# can read). Makes them when missing, expiring, not matching or not signed by the CA (or when
# NEW_CA is yes). Succeeds when it changed something.
tls_server_cert() {
    local section=$1 name=$2 owner=$3 new_ca=$4 d=$PG_TLS_DIR tmp san made=1
    local crt="$d/$name.crt" key="$d/$name.key"
    san=$(openssl x509 -in "$crt" -noout -ext subjectAltName 2>/dev/null | tail -n +2 | sed 's/^[[:space:]]*//') || true
    if [[ $new_ca == no ]] && tls_ok_for "$crt" && [[ -s $key ]] &&
        [[ $san == "$PG_TLS_SAN" ]] && tls_key_matches "$crt" "$key" &&
        openssl verify -CAfile "$d/ca.crt" "$crt" >/dev/null 2>&1; then
        say "$section" "server certificate $crt ($san) is signed by the test CA (ok)"
    else
        tmp=$(mktemp -d)
        openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
            -keyout "$tmp/server.key" -out "$tmp/server.csr" -subj "/CN=localhost" >/dev/null 2>&1 ||
            die "openssl could not create the server key and request for $crt"
        printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
            "extendedKeyUsage=serverAuth" "subjectAltName=DNS:localhost,IP:127.0.0.1" \
            "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid" >"$tmp/server.ext"
        openssl x509 -req -in "$tmp/server.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" \
            -set_serial "0x$(openssl rand -hex 16)" -days "$PG_TLS_DAYS" -sha256 \
            -extfile "$tmp/server.ext" -out "$tmp/server.crt" >/dev/null 2>&1 ||
            die "openssl could not sign $crt with $d/ca.key"
        install -o "$owner" -g "$owner" -m 0600 "$tmp/server.key" "$key"
        install -o root -g root -m 0644 "$tmp/server.crt" "$crt"
        rm -rf "$tmp"
        made=0
        changed "$section" "created server certificate $crt for $PG_TLS_SAN, signed by the test CA"
    fi
    if [[ $(stat -c '%U %a' "$key") == "$owner 600" ]]; then
        say "$section" "server key $key is owned by $owner, mode 0600 (ok)"
    else
        chown "$owner:$owner" "$key"
        chmod 0600 "$key"
        made=0
        changed "$section" "set $key to $owner, mode 0600"
    fi
    return $made
}

pg_tls_files() {
    local d=$PG_TLS_DIR tmp was
    was=$(stat -c '%U %a' "$d" 2>/dev/null) || true
    if [[ $was == "root 755" ]]; then
        say postgres "TLS directory $d exists, root, mode 0755 (ok)"
    elif [[ -d $d ]]; then
        chown root:root "$d"
        chmod 0755 "$d"
        changed postgres "set TLS directory $d to root, mode 0755 (was $was)"
    else
        install -d -o root -g root -m 0755 "$d"
        changed postgres "created TLS directory $d (root, mode 0755)"
    fi
    PG_TLS_TMP=$(mktemp -d)
    trap 'rm -rf "$PG_TLS_TMP"' EXIT
    tmp=$PG_TLS_TMP

    local new_ca=no
    if tls_ok_for "$d/ca.crt" && [[ -s $d/ca.key ]] && tls_key_matches "$d/ca.crt" "$d/ca.key"; then
        say postgres "test CA $d/ca.crt is valid until $(openssl x509 -in "$d/ca.crt" -noout -enddate | cut -d= -f2) (ok)"
    else
        tls_new_ca "$tmp/ca.key" "$tmp/ca.crt" "outboxd test CA"
        install -o root -g root -m 0600 "$tmp/ca.key" "$d/ca.key"
        install -o root -g root -m 0644 "$tmp/ca.crt" "$d/ca.crt"
        new_ca=yes
        PG_TLS_CHANGED=yes
        changed postgres "created the test CA $d/ca.crt (key $d/ca.key)"
    fi

    tls_server_cert postgres server postgres $new_ca && PG_TLS_CHANGED=yes

    if tls_ok_for "$d/ca-other.crt" && ! openssl verify -CAfile "$d/ca-other.crt" "$d/server.crt" >/dev/null 2>&1; then
        say postgres "unrelated CA $d/ca-other.crt (does not verify the server) (ok)"
    else
        tls_new_ca "$tmp/other.key" "$tmp/ca-other.crt" "outboxd unrelated test CA"
        install -o root -g root -m 0644 "$tmp/ca-other.crt" "$d/ca-other.crt"
        changed postgres "created the unrelated CA $d/ca-other.crt (its key is thrown away)"
    fi
    rm -rf "$tmp"
}

pg_tls_serves() { # a new session gets the certificate the test CA signed for localhost
    psql -X -At "host=localhost port=$PG_PORT user=postgres dbname=$PG_DB sslmode=verify-full sslrootcert=$PG_TLS_DIR/ca.crt" \
        -c "SELECT 1" >/dev/null 2>&1
}

pg_sighup_applied() {
    local entry name value applied context
    for entry in "${PG_WANTED[@]}"; do
        IFS='|' read -r name value applied <<<"$entry"
        context=$(pgq "SELECT context FROM pg_settings WHERE name = '$name'")
        [[ $context == postmaster || $(pg_setting "$name") == "$applied" ]] || return 1
    done
}

# ---------------------------------------------------------------------------------------------
# MariaDB
# ---------------------------------------------------------------------------------------------

MY_CONF_CONTENT="# Written by outboxd scripts/services.sh: binary log and TLS for the CDC tests.
# Changing it needs a server restart; scripts/services.sh does that when the values differ.
[mariadbd]
server_id=1
log_bin=mariadb-bin
binlog_format=ROW
binlog_row_image=FULL
binlog_row_metadata=FULL
gtid_strict_mode=0
expire_logs_days=7
ssl_ca=$PG_TLS_DIR/ca.crt
ssl_cert=$PG_TLS_DIR/mariadb.crt
ssl_key=$PG_TLS_DIR/mariadb.key"

# option (dashes) | value the server must read from its option files
MY_WANTED_OPTS=(
    "server-id|1"
    "log-bin|mariadb-bin"
    "binlog-format|ROW"
    "binlog-row-image|FULL"
    "binlog-row-metadata|FULL"
    "ssl-cert|$PG_TLS_DIR/mariadb.crt"
    "ssl-key|$PG_TLS_DIR/mariadb.key"
    "ssl-ca|$PG_TLS_DIR/ca.crt"
)

myq() { mysql -uroot -h"$MY_HOST" -P"$MY_PORT" --protocol=TCP --connect-timeout=5 -N -B -e "$1"; }
my_ping() { mysqladmin -uroot -h"$MY_HOST" -P"$MY_PORT" --protocol=TCP --connect-timeout=2 ping; }
my_ready() { my_ping && myq "SELECT 1"; }

# The options mariadbd would start with, one `name=value` per line (last one wins), names with
# dashes.
my_effective_opts() {
    "$MARIADBD" --print-defaults | tail -n +2 | tr ' ' '\n' | sed -n 's/^--//p' |
        awk '{ i = index($0, "="); n = (i ? substr($0, 1, i - 1) : $0); v = (i ? substr($0, i + 1) : "");
               gsub("_", "-", n); val[n] = v; if (!(n in seen)) { seen[n] = 1; order[++k] = n } }
             END { for (j = 1; j <= k; j++) print order[j] "=" val[order[j]] }'
}

my_opts_mismatch() { # prints the wanted options mariadbd would not start with
    local eff entry name value got
    eff=$(my_effective_opts)
    for entry in "${MY_WANTED_OPTS[@]}"; do
        IFS='|' read -r name value <<<"$entry"
        got=$(sed -n "s/^$name=//p" <<<"$eff")
        [[ ${got^^} == "${value^^}" ]] || echo "$name=${got:-<unset>} (wanted $value)"
    done
}

my_error_log() { my_effective_opts | sed -n 's/^log-error=//p'; }

my_process_gone() { ! start-stop-daemon --status --exec "$MARIADBD"; }

my_start() {
    install -d -m 0755 -o mysql -g mysql /run/mysqld
    start-stop-daemon --start --oknodo --background --exec "$MARIADBD" >/dev/null
    wait_until "$TIMEOUT" my_ready ||
        die "MariaDB did not answer on $MY_HOST:$MY_PORT within ${TIMEOUT}s" \
            "see its log: tail -n 50 $(my_error_log)" \
            "start it by hand: start-stop-daemon --start --oknodo --background --exec $MARIADBD"
}

my_tls_running() { # TLS is on with our certificate
    [[ $(myq "SELECT @@have_ssl = 'YES' AND @@ssl_cert = '$PG_TLS_DIR/mariadb.crt'") == 1 ]]
}

my_tls_serves() { # CA: a session verified against CA (host name checked) is encrypted
    [[ -n $(mysql -uroot -hlocalhost -P"$MY_PORT" --protocol=TCP --connect-timeout=5 -N -B \
        --ssl --ssl-ca="$1" --ssl-verify-server-cert \
        -e "SHOW SESSION STATUS LIKE 'Ssl_version'" 2>/dev/null | cut -f2) ]]
}

my_running_values() {
    myq "SELECT @@log_bin, @@binlog_format, @@binlog_row_image, @@binlog_row_metadata, @@server_id,
                IFNULL(@@log_bin_basename, '-'), TRIM(TRAILING '/' FROM @@datadir)"
}

mariadb_section() {
    # 0. TLS files (the option file points at them; the test CA comes from the PostgreSQL part)
    local my_tls_changed=no
    tls_server_cert mariadb mariadb mysql no && my_tls_changed=yes

    # 1. our option file
    if [[ ! -d $MY_CONF_DIR ]]; then
        mkdir -p "$MY_CONF_DIR"
        changed mariadb "created $MY_CONF_DIR"
    fi
    if [[ -f $MY_CONF_FILE ]] && [[ $(cat "$MY_CONF_FILE") == "$MY_CONF_CONTENT" ]]; then
        say mariadb "$MY_CONF_FILE is up to date (ok)"
    else
        printf '%s\n' "$MY_CONF_CONTENT" >"$MY_CONF_FILE"
        chmod 0644 "$MY_CONF_FILE"
        changed mariadb "wrote $MY_CONF_FILE"
    fi

    # 2. does mariadbd read it? (Debian's /etc/mysql/mariadb.cnf includes mariadb.conf.d; a
    #    hand-written /etc/mysql/my.cnf may not.)
    local mismatch
    mismatch=$(my_opts_mismatch)
    if [[ -n $mismatch ]]; then
        local main
        main=$(readlink -f "$MY_MAIN_CNF" || true)
        [[ -n $main && -f $main ]] ||
            die "mariadbd does not read $MY_CONF_FILE and $MY_MAIN_CNF does not exist" \
                "add '!includedir $MY_CONF_DIR/' to the option file mariadbd reads (see: $MARIADBD --help --verbose | head)"
        if grep -Eq "^[[:space:]]*!includedir[[:space:]]+$MY_CONF_DIR/?[[:space:]]*$" "$main"; then
            die "mariadbd reads $MY_CONF_DIR (included from $main) but something overrides $MY_CONF_FILE:" \
                "$(tr '\n' ';' <<<"$mismatch")" "see: $MARIADBD --print-defaults"
        fi
        printf '\n# added by outboxd scripts/services.sh\n!includedir %s/\n' "$MY_CONF_DIR" >>"$main"
        changed mariadb "added '!includedir $MY_CONF_DIR/' to $main"
        mismatch=$(my_opts_mismatch)
        [[ -z $mismatch ]] ||
            die "mariadbd still does not start with the wanted options: $(tr '\n' ';' <<<"$mismatch")" \
                "see: $MARIADBD --print-defaults"
    fi
    say mariadb "$MARIADBD --print-defaults has server-id=1 log-bin=mariadb-bin ROW/FULL/FULL (ok)"

    # 3. running?
    if my_ping >/dev/null 2>&1; then
        say mariadb "server is running on $MY_HOST:$MY_PORT"
    else
        say mariadb "server is not running: starting it"
        local t0=$SECONDS
        my_start
        changed mariadb "started the server in $((SECONDS - t0))s"
    fi
    wait_until "$TIMEOUT" my_ready ||
        die "MariaDB answers ping but refuses 'mysql -uroot -h$MY_HOST' (root must log in over TCP with an empty password)"

    # 4. restart when the running server differs
    local log_bin format image metadata server_id basename datadir
    IFS=$'\t' read -r log_bin format image metadata server_id basename datadir <<<"$(my_running_values)"
    local want_basename="$datadir/mariadb-bin"
    local tls=on
    my_tls_running || tls=off
    if [[ $log_bin == 1 && $format == ROW && $image == FULL && $metadata == FULL && $server_id == 1 &&
        $basename == "$want_basename" && $tls == on ]]; then
        say mariadb "running log_bin=1 binlog_format=ROW binlog_row_image=FULL binlog_row_metadata=FULL server_id=1 ssl=on (ok)"
        if [[ $my_tls_changed == yes ]]; then
            myq "FLUSH SSL"
            changed mariadb "FLUSH SSL (reloaded the new certificate)"
        fi
    else
        say mariadb "running log_bin=$log_bin ($basename) binlog_format=$format binlog_row_image=$image binlog_row_metadata=$metadata server_id=$server_id ssl=$tls: needs a restart"
        local t0=$SECONDS pid_file pid
        pid_file=$(myq "SELECT @@pid_file")
        pid=$(cat "$pid_file" 2>/dev/null || true)
        mysqladmin -uroot -h"$MY_HOST" -P"$MY_PORT" --protocol=TCP shutdown ||
            die "mysqladmin shutdown failed" "stop MariaDB by hand, then run this script again"
        if [[ -n $pid ]]; then
            wait_until "$TIMEOUT" test ! -d "/proc/$pid" ||
                die "MariaDB (pid $pid) did not exit within ${TIMEOUT}s after mysqladmin shutdown"
        fi
        wait_until "$TIMEOUT" my_process_gone ||
            die "a $MARIADBD process is still running ${TIMEOUT}s after mysqladmin shutdown"
        my_start
        MY_RESTARTED="yes ($((SECONDS - t0))s)"
        changed mariadb "restarted the server in $((SECONDS - t0))s"
        IFS=$'\t' read -r log_bin format image metadata server_id basename datadir <<<"$(my_running_values)"
        [[ $log_bin == 1 && $format == ROW && $image == FULL && $metadata == FULL && $server_id == 1 ]] ||
            die "after the restart MariaDB runs with log_bin=$log_bin binlog_format=$format binlog_row_image=$image binlog_row_metadata=$metadata server_id=$server_id" \
                "see: $MARIADBD --print-defaults"
        my_tls_running ||
            die "after the restart MariaDB runs without TLS (have_ssl = $(myq "SELECT @@have_ssl"))" \
                "see its log: tail -n 50 $(my_error_log)"
    fi

    # 5. dynamic settings (no restart needed)
    if [[ $(myq "SELECT @@gtid_strict_mode = 0 AND @@expire_logs_days = 7") == 1 ]]; then
        say mariadb "running gtid_strict_mode=0 expire_logs_days=7 (ok)"
    else
        myq "SET GLOBAL gtid_strict_mode = 0; SET GLOBAL expire_logs_days = 7"
        changed mariadb "SET GLOBAL gtid_strict_mode = 0, expire_logs_days = 7"
    fi

    if [[ -n $(myq "SHOW DATABASES LIKE '$MY_DB'") ]]; then
        say mariadb "database $MY_DB exists (ok)"
    else
        myq "CREATE DATABASE \`$MY_DB\`"
        changed mariadb "created database $MY_DB"
    fi

    # 6. prepared XA transactions an interrupted test run left behind (tests name theirs xa_…):
    #    they outlive their session and hold back the position every later relay can store
    local xid left=0
    while IFS=$'\t' read -r _ _ _ xid; do
        [[ $xid == xa_* ]] || continue
        myq "XA ROLLBACK '$xid'" && left=$((left + 1))
    done < <(myq "XA RECOVER")
    if [[ $left -gt 0 ]]; then
        changed mariadb "rolled back $left prepared XA transaction(s) left by tests (xa_…)"
    else
        say mariadb "no prepared XA transaction left by tests (ok)"
    fi
}

# ---------------------------------------------------------------------------------------------
# RabbitMQ
# ---------------------------------------------------------------------------------------------

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

# ---------------------------------------------------------------------------------------------
# docker-compose (only to validate docker-compose.yml in tests/surface/compose.rs; no Docker engine runs)
# ---------------------------------------------------------------------------------------------

# ---- NATS with JetStream: the NATS sink's tests ---------------------------------------------
NATS_PORT=4222
NATS_STORE=/var/lib/nats-server
NATS_LOG=/var/log/nats-server.log
NATS_STARTED=no

nats_jetstream_ok() { # the monitoring-free check: the server's INFO line advertises JetStream
    timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$NATS_PORT && head -n1 <&3" 2>/dev/null |
        grep -q '"jetstream":true'
}

nats_section() {
    echo "== nats"
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

docker_compose_section() {
    if command -v docker-compose >/dev/null 2>&1; then
        say compose "ok: docker-compose $(docker-compose version --short 2>/dev/null || echo present)"
        return
    fi
    # Not a service the relay needs: when apt cannot reach its mirrors, warn and go on.
    # A fresh machine may have no package lists yet: update once and try again.
    if DEBIAN_FRONTEND=noninteractive apt-get install -y docker-compose >/tmp/outboxd-docker-compose.log 2>&1 \
        || { apt-get update >>/tmp/outboxd-docker-compose.log 2>&1 \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y docker-compose >>/tmp/outboxd-docker-compose.log 2>&1; }; then
        changed compose "installed Debian's docker-compose package"
    else
        say compose "WARNING: apt-get install -y docker-compose failed (see /tmp/outboxd-docker-compose.log); tests/surface/compose.rs fails until it is installed"
    fi
}

# python3-cryptography: scripts/crypto-vector.py (the independent known answer of
# docs/encryption.md, run by tests/kit/crypto_cli.rs) needs its ChaCha20-Poly1305.
crypto_vector_section() {
    if python3 -c 'import cryptography.hazmat.primitives.ciphers.aead' >/dev/null 2>&1; then
        say crypto "ok: python3 cryptography"
        return
    fi
    if DEBIAN_FRONTEND=noninteractive apt-get install -y python3-cryptography >/tmp/outboxd-python-crypto.log 2>&1 \
        || { apt-get update >>/tmp/outboxd-python-crypto.log 2>&1 \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y python3-cryptography >>/tmp/outboxd-python-crypto.log 2>&1; }; then
        changed crypto "installed Debian's python3-cryptography package"
    else
        say crypto "WARNING: apt-get install -y python3-cryptography failed (see /tmp/outboxd-python-crypto.log); tests/kit/crypto_cli.rs fails until it is installed"
    fi
}

# ---------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------

verify() {
    local failures=()
    local wal_level ident
    wal_level=$(psql -X -At -h "$PG_HOST" -p "$PG_PORT" -U postgres -d "$PG_DB" -c "SHOW wal_level" 2>&1) || true
    if [[ $wal_level == logical ]]; then
        say verify "postgres wal_level = logical (ok)"
    else
        failures+=("postgres: SHOW wal_level gave '$wal_level', wanted logical")
    fi
    if ident=$(psql -X -At "host=$PG_HOST port=$PG_PORT user=postgres dbname=$PG_DB replication=database" \
        -c "IDENTIFY_SYSTEM" 2>&1); then
        say verify "postgres replication connection: IDENTIFY_SYSTEM -> $ident (ok)"
    else
        failures+=("postgres: replication connection failed: $ident" "  check the 'replication' lines at the top of $(pgq 'SHOW hba_file')")
    fi

    # TLS, checked with libpq (psql) against the test CA: `host` lines in pg_hba.conf match SSL
    # connections too, so no `hostssl` lines are needed.
    local tls_opts="port=$PG_PORT user=postgres dbname=$PG_DB sslmode=verify-full sslrootcert=$PG_TLS_DIR/ca.crt"
    local tls_sql tls_ident tls_other
    if tls_sql=$(psql -X -At "host=localhost $tls_opts" \
        -c "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()" 2>&1) && [[ $tls_sql == t ]]; then
        say verify "postgres TLS: sslmode=verify-full to localhost with $PG_TLS_DIR/ca.crt (ok)"
    else
        failures+=("postgres: TLS connection (verify-full, host=localhost, sslrootcert=$PG_TLS_DIR/ca.crt) failed: $tls_sql"
            "  see the log: tail -n 50 $PG_LOG")
    fi
    if tls_ident=$(psql -X -At "host=127.0.0.1 $tls_opts replication=database" -c "IDENTIFY_SYSTEM" 2>&1); then
        say verify "postgres TLS: replication connection, sslmode=verify-full to 127.0.0.1 (ok)"
    else
        failures+=("postgres: TLS replication connection (verify-full, host=127.0.0.1) failed: $tls_ident")
    fi
    if tls_other=$(psql -X -At "host=localhost ${tls_opts/ca.crt/ca-other.crt}" -c "SELECT 1" 2>&1); then
        failures+=("postgres: a TLS connection verified with $PG_TLS_DIR/ca-other.crt succeeded; it must fail")
    elif [[ $tls_other == *certificate* ]]; then
        say verify "postgres TLS: $PG_TLS_DIR/ca-other.crt is refused (ok)"
    else
        failures+=("postgres: the connection with $PG_TLS_DIR/ca-other.crt failed, but not on the certificate: $tls_other")
    fi

    local log_bin format image metadata server_id basename datadir
    IFS=$'\t' read -r log_bin format image metadata server_id basename datadir <<<"$(my_running_values)"
    if [[ $log_bin == 1 && $format == ROW && $image == FULL && $metadata == FULL ]]; then
        say verify "mariadb log_bin=1 ($basename) binlog_format=ROW row_image=FULL row_metadata=FULL (ok)"
    else
        failures+=("mariadb: log_bin=$log_bin binlog_format=$format binlog_row_image=$image binlog_row_metadata=$metadata")
    fi

    if my_tls_serves "$PG_TLS_DIR/ca.crt"; then
        say verify "mariadb TLS: --ssl-verify-server-cert to localhost with $PG_TLS_DIR/ca.crt (ok)"
    else
        failures+=("mariadb: TLS connection (--ssl-verify-server-cert, host localhost, --ssl-ca=$PG_TLS_DIR/ca.crt) failed"
            "  see the log: tail -n 50 $(my_error_log)")
    fi
    if my_tls_serves "$PG_TLS_DIR/ca-other.crt"; then
        failures+=("mariadb: a TLS connection verified with $PG_TLS_DIR/ca-other.crt succeeded; it must fail")
    else
        say verify "mariadb TLS: $PG_TLS_DIR/ca-other.crt is refused (ok)"
    fi

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

    local pg_version my_version rmq_version
    pg_version=$(pgq "SHOW server_version" | cut -d' ' -f1)
    my_version=$(myq "SELECT VERSION()")
    rmq_version=$(rabbitmqctl -q version 2>/dev/null || echo '?')
    echo "== summary"
    echo "postgres  $pg_version ($PG_VERSION/$PG_CLUSTER) $PG_HOST:$PG_PORT db=$PG_DB wal_level=logical slots=20 senders=20 replication=ok tls=$PG_TLS_DIR/ca.crt restarted=$PG_RESTARTED"
    echo "mariadb   $my_version $MY_HOST:$MY_PORT db=$MY_DB log_bin=1 ROW/FULL/FULL server_id=1 tls=$PG_TLS_DIR/ca.crt restarted=$MY_RESTARTED"
    echo "rabbitmq  $rmq_version 127.0.0.1:$RMQ_PORT tls=127.0.0.1:$RMQ_TLS_PORT plugins=${RMQ_PLUGINS[*]} started=$RMQ_STARTED"
    echo "nats      127.0.0.1:$NATS_PORT jetstream store=$NATS_STORE started=$NATS_STARTED"
    echo "changes   $CHANGES"
}

main() {
    local t0=$SECONDS
    preflight
    postgres_section
    mariadb_section
    rabbitmq_section
    rabbitmq_tls_section
    bash "$(dirname "${BASH_SOURCE[0]}")/services/rabbitmq-stream.sh"
    nats_section
    docker_compose_section
    crypto_vector_section
    verify
    echo "services.sh done in $((SECONDS - t0))s"
}

main "$@"
