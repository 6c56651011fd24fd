<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Exceptions;

use RuntimeException;

/**
 * A message no retry can apply (not JSON, no handler, a value tampered with, a handler that
 * says so). outbox:consume moves it to `<queue>.dead` with the reason and goes on. A handler
 * throws it for input it rejects for good; any other exception is retried (--tries).
 */
class PoisonMessage extends RuntimeException
{
}
