<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Console;

use Illuminate\Console\Command;
use Outboxd\Laravel\Encryption\CryptoException;
use Outboxd\Laravel\Encryption\TopicEncryption;

class EncryptCommand extends Command
{
    use WritesErrors;

    protected $signature = 'outbox:encrypt
                            {topic : The topic whose schema marks the fields to seal}
                            {--event-id= : The event id the values are bound to}';

    protected $description = 'Seal the sensitive fields of the JSON payload on stdin as Outbox::write would (enc:v1)';

    public function handle(TopicEncryption $encryption): int
    {
        try {
            $payload = json_decode($this->stdin(), true, 512, JSON_THROW_ON_ERROR);
            $sealer = $encryption->forTopic($this->argument('topic'))
                ?? throw new CryptoException('MissingSchema', "topic {$this->argument('topic')} is written in clear: nothing to seal");
            $this->line(json_encode($sealer->sealPayload((string) $this->option('event-id'), $payload), JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE | JSON_PRESERVE_ZERO_FRACTION));

            return self::SUCCESS;
        } catch (CryptoException $e) {
            $this->stderr("{$e->kind}: {$e->getMessage()}");
        } catch (\JsonException $e) {
            $this->stderr("stdin is not JSON: {$e->getMessage()}");
        }

        return self::FAILURE;
    }
}
