<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Console;

use Illuminate\Console\Command;
use Outboxd\Laravel\Encryption\CryptoException;
use Outboxd\Laravel\Encryption\TopicEncryption;
use Symfony\Component\Process\Process;

class KeysCommand extends Command
{
    use WritesErrors;

    protected $signature = 'outbox:keys
                            {action : generate, rotate, list, check or blind-index}
                            {value? : blind-index: the value (default: stdin)}
                            {--field= : blind-index: the field (a name or a JSON Pointer)}
                            {--topic= : blind-index: the topic whose schema normalises the field}
                            {--normalize= : blind-index: the normalisation steps, comma separated (trim, lowercase, digits, alnum, collapse-space)}';

    protected $description = 'The field-encryption key ring: generate, rotate and list it (outboxd keys), check it against every topic schema, or print a blind index';

    public function handle(TopicEncryption $encryption): int
    {
        try {
            return match ($this->argument('action')) {
                'generate', 'rotate', 'list' => $this->outboxd($encryption),
                'check' => $this->check($encryption),
                'blind-index' => $this->blindIndex($encryption),
                default => $this->unknown(),
            };
        } catch (CryptoException $e) {
            $this->stderr("{$e->kind}: {$e->getMessage()}");

            return self::FAILURE;
        }
    }

    /** `outboxd keys <action> --keys <the configured key ring>`. */
    private function outboxd(TopicEncryption $encryption): int
    {
        $action = $this->argument('action');
        $path = $encryption->keyringPath();
        if ($path === null && $action !== 'generate') {
            throw new CryptoException('NoKeyring', "no key ring is configured\n  fix: php artisan outbox:keys generate, then set OUTBOX_KEYRING to the file it wrote");
        }
        $path ??= $this->laravel->storagePath().'/app/outbox/keys.json';
        if ($action === 'generate' && ! is_dir(dirname($path))) {
            mkdir(dirname($path), 0700, true);
        }
        $process = new Process([$this->laravel['config']->get('outbox.relay.binary', 'outboxd'), 'keys', $action, '--keys', $path]);
        $status = $process->run(function (string $type, string $output): void {
            $this->output->write($output);
        });
        if ($status === 127) {
            $this->stderr('Cannot run outboxd: install it, or set OUTBOXD_BINARY (config outbox.relay.binary) to its path');
        }
        if ($status === 0 && $action === 'generate') {
            $this->info("Key ring written to $path: back it up, keep it out of git (storage/app is ignored)");
            if ($encryption->keyringPath() === null) {
                $relative = str_starts_with($path, $this->laravel->basePath().'/') ? substr($path, strlen($this->laravel->basePath()) + 1) : $path;
                $this->line("Now set OUTBOX_KEYRING=$relative in .env");
            }
        }

        return $status;
    }

    /** Loads the key ring (every canary checked) and every topic schema, as a deploy check. */
    private function check(TopicEncryption $encryption): int
    {
        $ring = $encryption->keyring();
        $this->line('Key ring '.$encryption->keyringPath().': ok');
        $dir = dirname($encryption->schemaPath('x'));
        $files = glob("$dir/*.json") ?: [];
        if ($files === []) {
            $this->warn("No topic schemas in $dir: every topic written with encryption on is refused until it has one (or is in outbox.encryption.plaintext_topics)");
        }
        foreach ($files as $file) {
            $topic = basename($file, '.json');
            $encryption->forTopic($topic);
            $this->line("Topic $topic: $file ok");
        }
        unset($ring);

        return self::SUCCESS;
    }

    private function blindIndex(TopicEncryption $encryption): int
    {
        $field = $this->option('field') ?: throw new CryptoException('Schema', 'blind-index needs --field');
        $value = $this->argument('value') ?? preg_replace('/\r?\n$/', '', $this->stdin());
        $sealer = $this->option('topic') ? $encryption->forTopic($this->option('topic')) : null;
        $steps = $this->option('normalize') ? explode(',', $this->option('normalize')) : null;
        [$keyId, $hex] = ($sealer ?? $encryption->keyring())->blindIndex($field, $value, $steps);
        $this->line("$keyId $hex");

        return self::SUCCESS;
    }

    private function unknown(): int
    {
        $this->stderr("Unknown action \"{$this->argument('action')}\": generate, rotate, list, check or blind-index");

        return self::FAILURE;
    }
}
