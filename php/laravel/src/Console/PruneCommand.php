<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Console;

use Illuminate\Console\Command;
use Symfony\Component\Process\Process;

class PruneCommand extends Command
{
    protected $signature = 'outbox:prune
                            {--table=* : outbox or processed_messages (default: both)}
                            {--older-than= : Delete rows older than this, e.g. 7d or 36h (default: outbox.prune.*)}
                            {--mode= : The relay\'s mode, cdc or poll (default: outbox.relay.mode); in poll mode only published outbox rows go}
                            {--dry-run : Count what would be deleted; delete nothing}
                            {--force : Prune a window shorter than the relay\'s 1 day replay horizon anyway}';

    protected $description = 'Delete old outbox rows and consumer claims with outboxd prune (small batches, the relay\'s mode respected)';

    public function handle(): int
    {
        $config = $this->laravel['config'];
        $mode = $this->option('mode') ?: $config->get('outbox.relay.mode', 'cdc');
        if (! in_array($mode, ['cdc', 'poll'], true)) {
            $this->error("--mode $mode: cdc or poll (the mode outboxd run relays with)");

            return self::FAILURE;
        }
        $outbox = $config->get('outbox.table', 'outbox');
        $tables = $this->option('table') ?: [$outbox, 'processed_messages'];
        $env = ['OUTBOXD_SOURCE' => $this->dsn($config->get('outbox.connection') ?? $config->get('database.default'))];
        foreach ($tables as $table) {
            $window = $this->option('older-than')
                ?: $config->get($table === 'processed_messages' ? 'outbox.prune.processed_messages' : 'outbox.prune.outbox', '7d');
            $command = [$config->get('outbox.relay.binary', 'outboxd'), 'prune', '--table', $table, '--older-than', $window];
            if ($table !== 'processed_messages') {
                // In poll mode a pending row is an event not yet relayed: only published rows go.
                array_push($command, '--mode', $mode);
            }
            if ($this->option('dry-run')) {
                $command[] = '--dry-run';
            }
            if ($this->option('force')) {
                $command[] = '--force';
            }
            $this->line('<comment>Running</comment> '.implode(' ', $command));
            // The DSN (with its password) goes in the environment, never on a command line.
            $process = new Process($command, $this->laravel->basePath(), $env, null, null);
            $status = $process->run(function (string $type, string $output): void {
                $this->output->write($output);
            });
            if ($status === 127) {
                $this->error("Cannot run {$command[0]}");
                $this->line('  fix: install outboxd, or set OUTBOXD_BINARY (config outbox.relay.binary) to its path');

                return self::FAILURE;
            }
            if ($status !== 0) {
                $this->error("outboxd prune --table $table exited with $status");

                return $status;
            }
        }

        return self::SUCCESS;
    }

    /** The outbox connection as outboxd's DSN. */
    private function dsn(string $connection): string
    {
        $c = $this->laravel['config']->get("database.connections.$connection");
        $scheme = match ($c['driver'] ?? '') {
            'mysql', 'mariadb' => 'mysql',
            'pgsql' => 'postgres',
            default => throw new \RuntimeException("outboxd relays from MySQL, MariaDB or PostgreSQL; the \"$connection\" connection is ".($c['driver'] ?? 'unknown')),
        };
        $auth = rawurlencode((string) ($c['username'] ?? ''));
        if (($c['password'] ?? '') !== '') {
            $auth .= ':'.rawurlencode((string) $c['password']);
        }
        $host = is_array($c['host'] ?? null) ? $c['host'][0] : ($c['host'] ?? '127.0.0.1');
        $port = $c['port'] ?? ($scheme === 'mysql' ? 3306 : 5432);

        return "$scheme://$auth@$host:$port/".rawurlencode((string) $c['database']);
    }
}
