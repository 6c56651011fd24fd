<?php
// Boots the example the way a Laravel application boots its database layer, from Debian's
// packages alone (php-illuminate-database, php-illuminate-events and php-amqplib under
// /usr/share/php; no Packagist):
// illuminate/database's Capsule as the global `DB`, Eloquent, and the event dispatcher.
// Configuration from the environment, with Laravel's variable names.

declare(strict_types=1);

set_include_path(get_include_path() . PATH_SEPARATOR . '/usr/share/php');
foreach (['Illuminate/Database/autoload.php', 'Illuminate/Events/autoload.php', 'PhpAmqpLib/autoload.php'] as $lib) {
    if (!stream_resolve_include_path($lib)) {
        fwrite(STDERR, "missing $lib: install Debian's packages with scripts/services/php.sh (apt-get install -y php8.2-cli php8.2-mysql php-amqplib php-illuminate-database php-illuminate-events)\n");
        exit(2);
    }
    require_once $lib;
}
spl_autoload_register(function (string $class): void {
    if (str_starts_with($class, 'App\\')) {
        $file = __DIR__ . '/app/' . substr($class, 4) . '.php';
        if (is_file($file)) {
            require_once $file;
        }
    }
});
require_once __DIR__ . '/app/FieldCrypto.php'; // also defines App\CryptoError

use Illuminate\Container\Container;
use Illuminate\Database\Capsule\Manager as Capsule;
use Illuminate\Events\Dispatcher;

function env_or(string $name, string $default): string
{
    $v = getenv($name);
    return $v === false || $v === '' ? $default : $v;
}

$capsule = new Capsule();
$capsule->addConnection([
    'driver' => 'mysql',
    'host' => env_or('DB_HOST', '127.0.0.1'),
    'port' => env_or('DB_PORT', '3306'),
    'database' => env_or('DB_DATABASE', 'laravel'),
    'username' => env_or('DB_USERNAME', 'root'),
    'password' => env_or('DB_PASSWORD', ''),
    'charset' => 'utf8mb4',
    'collation' => 'utf8mb4_unicode_ci',
    // DATETIME(6) columns hold UTC, which is what outboxd reads them as (--source-time-zone).
    'timezone' => '+00:00',
]);
$capsule->setEventDispatcher(new Dispatcher(new Container()));
$capsule->setAsGlobal();
$capsule->bootEloquent();
// `DB::transaction(...)`, `DB::table(...)` as in a Laravel application.
class_alias(Capsule::class, 'DB');

// Field encryption is on when a key ring is configured (OUTBOX_KEYS, the file `outboxd keys
// generate` writes, and OUTBOX_SCHEMA, the schema marking the sensitive fields).
$keys = getenv('OUTBOX_KEYS');
if ($keys !== false && $keys !== '') {
    App\Outbox::encryptWith(App\FieldCrypto::load($keys, getenv('OUTBOX_SCHEMA') ?: null));
}
