#!/usr/bin/env bash
# Composer's autoloaders for the Laravel package and its example application, offline, from
# Debian's composer (scripts/services/php.sh installs it with PHP, Laravel and phpunit):
#   php/laravel:      `composer dump-autoload --dev` (the package and its tests; Laravel and
#                     php-amqplib load from /usr/share/php)
#   examples/laravel: `composer install`: outboxd/laravel from its path repository, Laravel and
#                     php-amqplib mapped to Debian's packages, no Packagist.
# Idempotent and quick (well under a second each). Run by scripts/test.sh before the tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v composer >/dev/null 2>&1; then
    echo "php-install.sh: ERROR: composer is not installed: run scripts/services/php.sh" >&2
    exit 1
fi
export COMPOSER_ALLOW_SUPERUSER=1 COMPOSER_NO_INTERACTION=1 COMPOSER_DISABLE_NETWORK=1
(cd php/laravel && composer dump-autoload --dev --quiet)
(cd examples/laravel && composer install --quiet)
echo "php-install: php/laravel autoloader, examples/laravel vendor/ ($(cd examples/laravel && php artisan --version))"
