<?php

declare(strict_types=1);

namespace Outboxd\Laravel;

use Illuminate\Support\ServiceProvider;
use Outboxd\Laravel\Encryption\TopicEncryption;

class OutboxServiceProvider extends ServiceProvider
{
    public function register(): void
    {
        $this->mergeConfigFrom(__DIR__.'/../config/outbox.php', 'outbox');

        $this->app->singleton(TopicEncryption::class, function ($app) {
            return TopicEncryption::fromConfig($app['config']->get('outbox.encryption', []), $app->basePath());
        });

        $this->app->singleton(Outbox::class, function ($app) {
            return new Outbox(
                $app['db'],
                $app->make(TopicEncryption::class),
                $app['config']->get('outbox.connection'),
                $app['config']->get('outbox.table', 'outbox'),
            );
        });
        $this->app->alias(Outbox::class, 'outbox');
    }

    public function boot(): void
    {
        if (! $this->app->runningInConsole()) {
            return;
        }

        $this->publishes([
            __DIR__.'/../config/outbox.php' => $this->app->configPath('outbox.php'),
        ], 'outbox-config');

        $this->publishes([
            __DIR__.'/../database/migrations' => $this->app->databasePath('migrations'),
        ], 'outbox-migrations');

        if ($this->app['config']->get('outbox.migrations', true)) {
            $this->loadMigrationsFrom(__DIR__.'/../database/migrations');
        }

        $this->commands([
            Console\ConsumeCommand::class,
            Console\DeclareCommand::class,
            Console\PruneCommand::class,
            Console\KeysCommand::class,
            Console\EncryptCommand::class,
            Console\DecryptCommand::class,
        ]);
    }
}
