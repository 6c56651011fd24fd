#!/usr/bin/env bash
# PHP for the Laravel package (php/laravel/), its example application (examples/laravel/) and
# their tests (PHPUnit in scripts/test.sh, tests/kit/crypto_php.rs, tests/mariadb/laravel.rs):
# Debian's php8.2-cli (sodium built in), php8.2-mysql (PDO for MariaDB), php-amqplib, Laravel
# 8.83 (php-laravel-framework), phpunit 9.6 and composer 2.5, all from apt: Laravel and
# php-amqplib load from /usr/share/php, no Packagist. Composer generates the autoloaders
# (scripts/php-autoload.sh, run by the test harness).
#
# Idempotent and cheap when everything is there (one `php` run). Called by scripts/services.sh;
# OUTBOXD_SKIP_PHP=1 skips it (the Laravel tests then fail and print this script's name).
set -euo pipefail

PHP_PACKAGES=(php8.2-cli php8.2-mysql php8.2-xml php8.2-mbstring php-amqplib php-laravel-framework phpunit composer)
LOG=/tmp/outboxd-php-apt.log

say() { printf '%-9s %s\n' "$1:" "$2"; }

if [[ ${OUTBOXD_SKIP_PHP:-0} == 1 ]]; then
    say php "skipped (OUTBOXD_SKIP_PHP=1)"
    exit 0
fi

php_ok() {
    command -v php >/dev/null 2>&1 &&
        php -r 'exit((function_exists("sodium_crypto_aead_xchacha20poly1305_ietf_encrypt")
            && extension_loaded("pdo_mysql")
            && is_file("/usr/share/php/PhpAmqpLib/autoload.php")
            && is_file("/usr/share/php/Illuminate/autoload.php")
            && is_file("/usr/share/php/PHPUnit/Autoload.php")
            && is_file("/usr/share/php/Composer/autoload.php")) ? 0 : 1);' 2>/dev/null &&
        command -v phpunit >/dev/null 2>&1 && command -v composer >/dev/null 2>&1
}

if php_ok; then
    say php "ok: $(php -r 'echo PHP_VERSION;') with sodium, pdo_mysql, php-amqplib, Laravel $(php -r 'require "Illuminate/autoload.php"; echo Illuminate\Foundation\Application::VERSION;'), $(phpunit --version | grep -o "PHPUnit [0-9.]*"), composer $(composer --version 2>/dev/null | grep -o "[0-9]\+\.[0-9.]\+" | head -1)"
    exit 0
fi

t0=$SECONDS
# A fresh machine may have no package lists yet: update once and try again.
if DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PHP_PACKAGES[@]}" >"$LOG" 2>&1 ||
    { apt-get update >>"$LOG" 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${PHP_PACKAGES[@]}" >>"$LOG" 2>&1; }; then
    php_ok || {
        echo "php.sh: ERROR: installed ${PHP_PACKAGES[*]} but php still lacks sodium, pdo_mysql, php-amqplib, Laravel, phpunit or composer (see $LOG)" >&2
        exit 1
    }
    say php "CHANGED: installed ${PHP_PACKAGES[*]} in $((SECONDS - t0))s"
else
    echo "php.sh: ERROR: apt-get install -y ${PHP_PACKAGES[*]} failed (see $LOG)" >&2
    exit 1
fi
