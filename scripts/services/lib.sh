# Shared by the scripts in scripts/services/ (sourced, never run): output, waiting, the root
# check, and the test CA that Postgres and MariaDB certificates are signed with.
#
# Every service script is idempotent: it checks everything (one line per check) and changes or
# restarts its service only when something differs from what the tests need, then verifies
# the service from the outside and prints one summary line. A second run changes nothing.
#
# Environment (all optional):
#   OUTBOXD_SERVICES_TIMEOUT  seconds to wait for a service to come up (default 120)
#   OUTBOXD_PG_TLS_DIR        where the test CA and the server certificates live (default
#                             /etc/outboxd/tls; the tests read the same variable)

TIMEOUT=${OUTBOXD_SERVICES_TIMEOUT:-120}
SERVICE_SCRIPT=scripts/services/$(basename "$0")
CHANGES=0

say() { printf '%-9s %s\n' "$1:" "$2"; }
changed() { CHANGES=$((CHANGES + 1)); say "$1" "CHANGED: $2"; }
die() {
    printf '%s: ERROR: %s\n' "$SERVICE_SCRIPT" "$1" >&2
    shift
    local l
    for l in "$@"; do printf '%s:   %s\n' "$SERVICE_SCRIPT" "$l" >&2; done
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

# preflight PACKAGES COMMAND...: root, and every COMMAND on the PATH (else: install PACKAGES).
preflight() {
    local packages=$1 missing=() c
    shift
    if [[ $EUID -ne 0 ]]; then
        die "$SERVICE_SCRIPT configures system services and must run as root." \
            "Run it once as root: sudo scripts/services.sh (every service) or sudo $SERVICE_SCRIPT" \
            "If your services are managed elsewhere (e.g. docker-compose up), run the tests with OUTBOXD_SKIP_SERVICES=1 scripts/test.sh"
    fi
    for c in "$@"; do
        [[ $c == /* ]] && { [[ -x $c ]] || missing+=("$c"); continue; }
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    if ((${#missing[@]})); then
        die "missing commands: ${missing[*]}" "install them: apt-get install -y $packages"
    fi
}

# apt_install PACKAGE LOG: installs a Debian package, output to LOG; a fresh machine may have
# no package lists yet, so on failure it updates them once and tries again.
apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y "$1" >"$2" 2>&1 ||
        { apt-get update >>"$2" 2>&1 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y "$1" >>"$2" 2>&1; }
}

# ---- The test CA: Postgres and MariaDB serve certificates it signs --------------------------
#
#   ca.key        root 0600      the test CA's key (only these scripts sign with it)
#   ca.crt        0644           the test CA: sslrootcert for the tests
#   server.crt    0644           Postgres: CN localhost, SAN DNS:localhost + IP:127.0.0.1
#   server.key    postgres 0600  (PostgreSQL refuses a key readable by others)
#   ca-other.crt  0644           a CA that signed nothing here: verification must fail with it
#   mariadb.crt   0644           MariaDB's server certificate (same names, same CA)
#   mariadb.key   mysql 0600

# Not under /etc/postgresql: tools (and older copies of these scripts) take every directory
# there for a PostgreSQL version.
PG_TLS_DIR=${OUTBOXD_PG_TLS_DIR:-/etc/outboxd/tls}
PG_TLS_DAYS=3650
PG_TLS_MIN_LEFT=$((30 * 86400)) # renew certificates that expire within 30 days
PG_TLS_SAN="DNS:localhost, IP Address:127.0.0.1"
TLS_NEW_CA=no

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

# tls_test_ca SECTION: the directory, the test CA and the unrelated CA. Sets TLS_NEW_CA=yes
# when it made a new test CA (every server certificate must then be made again).
tls_test_ca() {
    local section=$1 d=$PG_TLS_DIR tmp was
    was=$(stat -c '%U %a' "$d" 2>/dev/null) || true
    if [[ $was == "root 755" ]]; then
        say "$section" "TLS directory $d exists, root, mode 0755 (ok)"
    elif [[ -d $d ]]; then
        chown root:root "$d"
        chmod 0755 "$d"
        changed "$section" "set TLS directory $d to root, mode 0755 (was $was)"
    else
        install -d -o root -g root -m 0755 "$d"
        changed "$section" "created TLS directory $d (root, mode 0755)"
    fi
    tmp=$(mktemp -d)
    # shellcheck disable=SC2064 # expand now: the trap must remove this very directory
    trap "rm -rf '$tmp'" EXIT

    if tls_ok_for "$d/ca.crt" && [[ -s $d/ca.key ]] && tls_key_matches "$d/ca.crt" "$d/ca.key"; then
        say "$section" "test CA $d/ca.crt is valid until $(openssl x509 -in "$d/ca.crt" -noout -enddate | cut -d= -f2) (ok)"
    else
        tls_new_ca "$tmp/ca.key" "$tmp/ca.crt" "outboxd test CA"
        install -o root -g root -m 0600 "$tmp/ca.key" "$d/ca.key"
        install -o root -g root -m 0644 "$tmp/ca.crt" "$d/ca.crt"
        TLS_NEW_CA=yes
        changed "$section" "created the test CA $d/ca.crt (key $d/ca.key)"
    fi

    if tls_ok_for "$d/ca-other.crt" && ! openssl verify -CAfile "$d/ca-other.crt" "$d/ca.crt" >/dev/null 2>&1; then
        say "$section" "unrelated CA $d/ca-other.crt (does not verify the test CA) (ok)"
    else
        tls_new_ca "$tmp/other.key" "$tmp/ca-other.crt" "outboxd unrelated test CA"
        install -o root -g root -m 0644 "$tmp/ca-other.crt" "$d/ca-other.crt"
        changed "$section" "created the unrelated CA $d/ca-other.crt (its key is thrown away)"
    fi
    rm -rf "$tmp"
}
