<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Exceptions;

use LogicException;

/**
 * Outbox::write was called with no transaction open: the event would commit on its own, apart
 * from the business rows, which is the dual write the outbox exists to avoid.
 */
class OutsideTransactionException extends LogicException
{
    public static function forConnection(string $connection): self
    {
        return new self("Outbox::write outside a transaction on the \"$connection\" connection: the event would commit apart from the business rows\n  fix: wrap both in DB::transaction(function () { ... }) on that connection");
    }
}
