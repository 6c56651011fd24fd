#!/usr/bin/env bash
# MariaDB for outboxd's CDC tests: binary log in ROW format with FULL row image and FULL row
# metadata, TLS with the test CA (its own server certificate, mariadb.crt).
#
# For a Debian 12 machine with the distribution packages, run as root, no systemd; called by
# scripts/services.sh (every service), or alone. Idempotent (scripts/services/lib.sh).
set -euo pipefail
# shellcheck source=scripts/services/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

MY_HOST=127.0.0.1
MY_PORT=3306
MY_DB="test"
MY_CONF_DIR=/etc/mysql/mariadb.conf.d
MY_CONF_FILE=$MY_CONF_DIR/60-outboxd.cnf
MY_MAIN_CNF=/etc/mysql/my.cnf
MARIADBD=/usr/sbin/mariadbd
MY_RESTARTED=no

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
    # 0. TLS files (the option file points at them), signed by the test CA Postgres shares
    local my_tls_changed=no
    tls_test_ca mariadb
    tls_server_cert mariadb mariadb mysql "$TLS_NEW_CA" && my_tls_changed=yes

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

verify() {
    local failures=()
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
    if ((${#failures[@]})); then
        die "verification failed:" "${failures[@]}"
    fi
    echo "mariadb   $(myq "SELECT VERSION()") $MY_HOST:$MY_PORT db=$MY_DB log_bin=1 ROW/FULL/FULL server_id=1 tls=$PG_TLS_DIR/ca.crt restarted=$MY_RESTARTED changes=$CHANGES"
}

preflight "mariadb-server mariadb-client" mysql mysqladmin start-stop-daemon timeout openssl "$MARIADBD"
mariadb_section
verify
