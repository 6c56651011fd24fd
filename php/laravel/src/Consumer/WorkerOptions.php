<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Consumer;

/** outbox:consume's limits and pacing, as queue:work names them. */
final class WorkerOptions
{
    public function __construct(
        public readonly int $maxJobs = 0,
        public readonly int $maxTime = 0,
        public readonly int $memory = 128,
        public readonly int $sleep = 3,
        public readonly int $tries = 3,
        public readonly int $backoff = 1,
        public readonly int $prefetch = 10,
        public readonly bool $stopWhenEmpty = false,
    ) {
    }
}
