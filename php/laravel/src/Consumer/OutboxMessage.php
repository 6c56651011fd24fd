<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Consumer;

/**
 * One event as a handler receives it: outboxd's message properties and headers, the payload
 * decoded and its sealed fields opened.
 */
final class OutboxMessage
{
    /**
     * @param  array<string, mixed>  $payload
     * @param  array<string, mixed>  $headers  the AMQP headers (x-aggregate-id, x-aggregate-version, …)
     */
    public function __construct(
        public readonly string $id,
        public readonly string $topic,
        public readonly array $payload,
        public readonly array $headers = [],
    ) {
    }

    public function aggregateType(): ?string
    {
        return isset($this->headers['x-aggregate-type']) ? (string) $this->headers['x-aggregate-type'] : null;
    }

    /** The outbox table the event came from, when the relay reads several (x-outbox-table). */
    public function table(): ?string
    {
        return isset($this->headers['x-outbox-table']) ? (string) $this->headers['x-outbox-table'] : null;
    }

    public function aggregateId(): ?string
    {
        return isset($this->headers['x-aggregate-id']) ? (string) $this->headers['x-aggregate-id'] : null;
    }

    public function version(): ?int
    {
        return isset($this->headers['x-aggregate-version']) ? (int) $this->headers['x-aggregate-version'] : null;
    }

    /** A payload value by "dot" key, as Laravel's data_get reads it. */
    public function get(string $key, mixed $default = null): mixed
    {
        return data_get($this->payload, $key, $default);
    }
}
