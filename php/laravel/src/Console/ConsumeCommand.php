<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Console;

use Illuminate\Console\Command;
use Illuminate\Database\DatabaseManager;
use Outboxd\Laravel\Consumer\Worker;
use Outboxd\Laravel\Consumer\WorkerOptions;
use Outboxd\Laravel\Encryption\TopicEncryption;
use Psr\Log\LoggerInterface;

class ConsumeCommand extends Command
{
    protected $signature = 'outbox:consume
                            {consumer : The consumer in config/outbox.php; its name keys its claims in processed_messages}
                            {--queue= : The queue to consume (default: the consumer\'s "queue", else its name)}
                            {--exchange= : The exchange outboxd publishes to (default: outbox.rabbitmq.exchange)}
                            {--max-jobs=0 : The number of messages to process before stopping}
                            {--max-time=0 : The maximum number of seconds the worker should run}
                            {--memory=128 : The memory limit in megabytes}
                            {--sleep=3 : Seconds to wait for a missing exchange, an unreachable broker}
                            {--tries=3 : Attempts at a failing message before it goes to <queue>.dead}
                            {--backoff=1 : Seconds to wait before retrying a failed message}
                            {--prefetch=10 : Unacknowledged messages the broker may send ahead}
                            {--stop-when-empty : Stop when the queue is empty}';

    protected $description = 'Apply outboxd\'s messages once each: claim and handler in one transaction, acknowledged after the commit';

    public function handle(DatabaseManager $db, TopicEncryption $encryption, LoggerInterface $log): int
    {
        $name = (string) $this->argument('consumer');
        $config = $this->laravel['config']->get("outbox.consumers.$name");
        if (! is_array($config)) {
            $this->error("No consumer \"$name\" in config/outbox.php (outbox.consumers)");
            $this->line("  fix: add 'consumers' => ['$name' => ['queue' => '$name', 'bindings' => ['topic.*'], 'handlers' => ['topic.event' => App\\Listeners\\Handler::class]]]");

            return Worker::EXIT_ERROR;
        }

        $worker = new Worker(
            $this->laravel,
            $db->connection($this->laravel['config']->get('outbox.connection')),
            $encryption,
            $log,
            $this->laravel['config']->get('outbox.rabbitmq'),
            $name,
            $this->option('exchange') ?: $this->laravel['config']->get('outbox.rabbitmq.exchange', 'outbox'),
            $this->option('queue') ?: ($config['queue'] ?? $name),
            array_values($config['bindings'] ?? ['#']),
            $config['handlers'] ?? [],
            function (string $level, string $message): void {
                $line = '['.date('Y-m-d H:i:s').'] '.$message;
                match ($level) {
                    'error' => $this->error($line),
                    'warning' => $this->warn($line),
                    default => $this->line($line),
                };
            },
        );

        return $worker->run(new WorkerOptions(
            maxJobs: (int) $this->option('max-jobs'),
            maxTime: (int) $this->option('max-time'),
            memory: (int) $this->option('memory'),
            sleep: max(1, (int) $this->option('sleep')),
            tries: max(1, (int) $this->option('tries')),
            backoff: max(0, (int) $this->option('backoff')),
            prefetch: max(1, (int) $this->option('prefetch')),
            stopWhenEmpty: (bool) $this->option('stop-when-empty'),
        ));
    }
}
