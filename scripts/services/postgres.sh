#!/usr/bin/env bash
# PostgreSQL for outboxd's CDC tests: wal_level=logical, replication slots/senders,
# replication lines in pg_hba.conf, a TLS-only role, TLS with the test CA (server certificate
# for localhost and 127.0.0.1).
#
# Environment (all optional, besides lib.sh's):
#   OUTBOXD_PG_VERSION        PostgreSQL major version (default: newest in /etc/postgresql)
#   OUTBOXD_PG_CLUSTER        cluster name (default main)
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd; called by
# scripts/services.sh (every service), or alone. Idempotent (scripts/services/lib.sh).
set -euo pipefail
# shellcheck source=scripts/services/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PG_HOST=127.0.0.1
PG_DB="test"
PG_RESTARTED=no
PG_TLS_CHANGED=no

# name | value for ALTER SYSTEM | pg_settings.setting when applied (wal_sender_timeout is in ms)
# Slots, senders and connections leave room for the idle bench's 200-source fleet
# (`OUTBOXD_BENCH_IDLE_FLEET_PROCESS`; each source holds one slot, one walsender and one more
# session for its lease). What they cost while unused: shared memory sized by them at start
# (a connection slot's share of the lock table and its process entry, some tens of KiB, about
# 10 MB for 500; a replication slot or sender much less) and nothing else until one is used;
# changing them restarts the cluster once.
PG_WANTED=(
    "wal_level|logical|logical"
    "max_replication_slots|220|220"
    "max_wal_senders|220|220"
    "max_connections|500|500"
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

pg_tls_files() {
    tls_test_ca postgres
    tls_server_cert postgres server postgres "$TLS_NEW_CA" && PG_TLS_CHANGED=yes
    return 0
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
    if ((${#failures[@]})); then
        die "verification failed:" "${failures[@]}"
    fi
    echo "postgres  $(pgq "SHOW server_version" | cut -d' ' -f1) ($PG_VERSION/$PG_CLUSTER) $PG_HOST:$PG_PORT db=$PG_DB wal_level=logical slots=20 senders=20 replication=ok tls=$PG_TLS_DIR/ca.crt restarted=$PG_RESTARTED changes=$CHANGES"
}

preflight postgresql pg_lsclusters pg_ctlcluster pg_isready psql runuser timeout openssl
postgres_section
verify
