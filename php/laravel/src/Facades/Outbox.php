<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Facades;

use Illuminate\Support\Facades\Facade;

/**
 * @method static string write(string $topic, string|int $aggregateId, array|\Illuminate\Contracts\Support\Arrayable|\JsonSerializable $payload, ?string $aggregateType = null, ?int $version = null)
 * @method static array blindIndex(string $topic, string $field, string $value)
 * @method static \Outboxd\Laravel\Encryption\TopicEncryption encryption()
 * @method static \Illuminate\Database\ConnectionInterface connection()
 * @method static string table()
 *
 * @see \Outboxd\Laravel\Outbox
 */
class Outbox extends Facade
{
    protected static function getFacadeAccessor(): string
    {
        return \Outboxd\Laravel\Outbox::class;
    }
}
