<?php

namespace Outboxd\Laravel\Tests;

use Illuminate\Config\Repository;
use Illuminate\Database\DatabaseServiceProvider;
use Illuminate\Database\QueryException;
use Illuminate\Filesystem\FilesystemServiceProvider;
use Illuminate\Foundation\Application;
use Illuminate\Support\Facades\DB;
use Illuminate\Support\Facades\Facade;
use Outboxd\Laravel\OutboxServiceProvider;
use PHPUnit\Framework\TestCase as BaseTestCase;

/**
 * A Laravel application around the package, as an application boots it: its own base path
 * (resources/outbox schemas, storage), config, the database provider and OutboxServiceProvider.
 * Each test class gets its own MariaDB database with the package's migrations run.
 */
abstract class TestCase extends BaseTestCase
{
    protected Application $app;

    protected string $basePath;

    protected static ?string $database = null;

    public static function setUpBeforeClass(): void
    {
        static::$database = 'outbox_phpunit_'.getmypid().'_'.bin2hex(random_bytes(3));
        try {
            static::pdo()->exec('CREATE DATABASE `'.static::$database.'`');
        } catch (\PDOException $e) {
            self::fail("MariaDB at 127.0.0.1:3306 is not reachable ({$e->getMessage()}): start it with scripts/services.sh");
        }
    }

    public static function tearDownAfterClass(): void
    {
        static::pdo()->exec('DROP DATABASE IF EXISTS `'.static::$database.'`');
    }

    protected static function pdo(): \PDO
    {
        return new \PDO('mysql:host='.getenv('OUTBOX_TEST_DB_HOST').';port='.getenv('OUTBOX_TEST_DB_PORT'), getenv('OUTBOX_TEST_DB_USERNAME'), getenv('OUTBOX_TEST_DB_PASSWORD'), [\PDO::ATTR_ERRMODE => \PDO::ERRMODE_EXCEPTION]);
    }

    protected function setUp(): void
    {
        parent::setUp();
        $this->basePath = sys_get_temp_dir().'/outbox-phpunit-'.bin2hex(random_bytes(4));
        mkdir($this->basePath.'/resources/outbox', 0700, true);
        mkdir($this->basePath.'/storage/logs', 0700, true);
        $this->app = $this->createApplication($this->outboxConfig());
        $this->migrate();
    }

    protected function tearDown(): void
    {
        $this->app['db']->disconnect();
        $this->app->flush();
        Facade::clearResolvedInstances();
        exec('rm -rf '.escapeshellarg($this->basePath));
        parent::tearDown();
    }

    /** Overrides of config('outbox') for the test. */
    protected function outboxConfig(): array
    {
        return [];
    }

    protected function createApplication(array $outbox): Application
    {
        $app = new Application($this->basePath);
        $app->instance('config', new Repository([
            'app' => ['env' => 'testing', 'debug' => true],
            'database' => [
                'default' => 'mysql',
                'connections' => ['mysql' => [
                    'driver' => 'mysql',
                    'host' => getenv('OUTBOX_TEST_DB_HOST'),
                    'port' => getenv('OUTBOX_TEST_DB_PORT'),
                    'database' => static::$database,
                    'username' => getenv('OUTBOX_TEST_DB_USERNAME'),
                    'password' => getenv('OUTBOX_TEST_DB_PASSWORD'),
                    'charset' => 'utf8mb4',
                    'collation' => 'utf8mb4_unicode_ci',
                    'prefix' => '',
                    'timezone' => '+00:00',
                ]],
            ],
            'logging' => [
                'default' => 'single',
                'channels' => ['single' => ['driver' => 'single', 'path' => $this->basePath.'/storage/logs/laravel.log']],
            ],
        ]));
        Facade::clearResolvedInstances();
        Facade::setFacadeApplication($app);
        $app->register(FilesystemServiceProvider::class);
        $app->register(DatabaseServiceProvider::class);
        $app->register(OutboxServiceProvider::class);
        foreach ($outbox as $key => $value) {
            $app['config']->set("outbox.$key", $value);
        }
        $app->boot();

        return $app;
    }

    /** The package's migrations, as php artisan migrate runs them. */
    protected function migrate(): void
    {
        foreach (glob(__DIR__.'/../database/migrations/*.php') as $file) {
            $migration = require $file;
            try {
                $migration->up();
            } catch (QueryException $e) {
                if (! str_contains($e->getMessage(), 'already exists')) {
                    throw $e;
                }
            }
        }
        DB::table('outbox')->delete();
        DB::table('processed_messages')->delete();
        DB::table('consumer_aggregate_versions')->delete();
    }

    protected function logged(): string
    {
        $file = $this->basePath.'/storage/logs/laravel.log';

        return is_file($file) ? (string) file_get_contents($file) : '';
    }

    /** A key ring file of the shared test vectors (mode 0600, as outboxd keys generate writes it). */
    protected function vectorKeyring(): string
    {
        $path = $this->basePath.'/storage/keys.json';
        copy(static::vectorsDir().'/keyring.json', $path);
        chmod($path, 0600);

        return $path;
    }

    protected static function vectorsDir(): string
    {
        return dirname(__DIR__, 3).'/tests/fixtures/enc-v1';
    }

    protected function schema(string $topic, array $schema): void
    {
        file_put_contents($this->basePath."/resources/outbox/$topic.json", json_encode($schema));
    }
}
