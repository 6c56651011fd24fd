<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Console;

use Illuminate\Console\Command;
use Outboxd\Laravel\Encryption\CryptoException;
use Outboxd\Laravel\Encryption\TopicEncryption;

class DecryptCommand extends Command
{
    use WritesErrors;

    protected $signature = 'outbox:decrypt
                            {--event-id= : The event id (the message_id) the values were sealed for}';

    protected $description = 'Open every enc:v1 field of the JSON payload on stdin, e.g. a message from <queue>.dead';

    public function handle(TopicEncryption $encryption): int
    {
        try {
            $payload = json_decode($this->stdin(), true, 512, JSON_THROW_ON_ERROR);
            $this->line(json_encode($encryption->open((string) $this->option('event-id'), $payload), JSON_UNESCAPED_SLASHES | JSON_UNESCAPED_UNICODE | JSON_PRESERVE_ZERO_FRACTION));

            return self::SUCCESS;
        } catch (CryptoException $e) {
            $this->stderr("{$e->kind}: {$e->getMessage()}");
        } catch (\JsonException $e) {
            $this->stderr("stdin is not JSON: {$e->getMessage()}");
        }

        return self::FAILURE;
    }
}
