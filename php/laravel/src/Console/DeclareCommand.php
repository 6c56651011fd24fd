<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Console;

use Illuminate\Console\Command;
use Illuminate\Database\DatabaseManager;
use Outboxd\Laravel\Consumer\Worker;
use Outboxd\Laravel\Consumer\WorkerOptions;
use Outboxd\Laravel\Encryption\TopicEncryption;
use Psr\Log\LoggerInterface;

class DeclareCommand extends Command
{
    protected $signature = 'outbox:declare
                            {consumer : The consumer in config/outbox.php}
                            {--queue= : The queue (default: the consumer\'s "queue", else its name)}
                            {--exchange= : The exchange outboxd publishes to (default: outbox.rabbitmq.exchange)}
                            {--timeout=60 : Seconds to wait for outboxd to declare the exchange}';

    protected $description = 'Declare a consumer\'s queue, its bindings and <queue>.dead once outboxd has declared the exchange (deploy step: events published before it would reach no queue)';

    public function handle(DatabaseManager $db, TopicEncryption $encryption, LoggerInterface $log): int
    {
        $name = (string) $this->argument('consumer');
        $config = $this->laravel['config']->get("outbox.consumers.$name");
        if (! is_array($config)) {
            $this->error("No consumer \"$name\" in config/outbox.php (outbox.consumers)");

            return Worker::EXIT_ERROR;
        }
        $exchange = $this->option('exchange') ?: $this->laravel['config']->get('outbox.rabbitmq.exchange', 'outbox');
        $queue = $this->option('queue') ?: ($config['queue'] ?? $name);
        $worker = new Worker(
            $this->laravel, $db->connection($this->laravel['config']->get('outbox.connection')), $encryption, $log,
            $this->laravel['config']->get('outbox.rabbitmq'), $name, $exchange, $queue,
            array_values($config['bindings'] ?? ['#']), $config['handlers'] ?? [],
            fn (string $level, string $message) => $level === 'info' ? $this->line($message) : $this->warn($message),
        );
        $timeout = (int) $this->option('timeout');
        if (! $worker->declare(new WorkerOptions(sleep: 1), $timeout)) {
            $this->error("The exchange $exchange did not appear within {$timeout}s");
            $this->line("  fix: start outboxd run (it declares the exchange), with --exchange $exchange if you use another name");

            return Worker::EXIT_ERROR;
        }
        $this->info("Declared $queue, bound to $exchange by ".implode(', ', $config['bindings'] ?? ['#']).", and $queue.dead");

        return Worker::EXIT_SUCCESS;
    }
}
