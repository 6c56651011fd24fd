<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Consumer;

use RuntimeException;

/** A stop signal arrived while a message waited to be retried: it goes back to the queue. */
final class StopRequested extends RuntimeException
{
}
