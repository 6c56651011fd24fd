<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Encryption;

use RuntimeException;

/**
 * An `enc:v1` failure. `$kind` is the Rust kit's CryptoError name (WrongEvent, MovedField,
 * Tampered, UnknownKeyId, …), so a PHP service and a Rust one report the same case alike.
 */
class CryptoException extends RuntimeException
{
    public function __construct(public readonly string $kind, string $message)
    {
        parent::__construct($message);
    }

    /**
     * Whether no retry and no other message can fix this: the key ring lacks the key (a
     * consumer must stop and have its key ring updated, not drop the message).
     */
    public function isMissingKey(): bool
    {
        return in_array($this->kind, ['UnknownKeyId', 'KeyMissing', 'NeedKeystore', 'NoKeyring'], true);
    }
}
