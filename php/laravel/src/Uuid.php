<?php

declare(strict_types=1);

namespace Outboxd\Laravel;

use InvalidArgumentException;

/**
 * Event ids: RFC 9562 UUID v7 (48 bits of Unix milliseconds, then random bits). Ids rise with
 * time, so the outbox's primary key grows at its end like an auto-increment does, and poll
 * mode's tie-break on `id` follows the insert order within a process (a counter in the random
 * bits keeps that true within one millisecond).
 */
final class Uuid
{
    private static int $lastMs = 0;

    private static int $counter = 0;

    public static function v7(): string
    {
        $ms = (int) floor(microtime(true) * 1000);
        if ($ms <= self::$lastMs) {
            $ms = self::$lastMs;
            self::$counter++;
        } else {
            self::$lastMs = $ms;
            self::$counter = random_int(0, 0x3ff);
        }
        $bytes = substr(pack('J', $ms), 2, 6)                     // 48-bit timestamp
            . pack('n', 0x7000 | (self::$counter & 0x0fff))        // version 7, 12-bit counter
            . chr(0x80 | random_int(0, 0x3f)) . random_bytes(7);   // variant 10, random

        return self::format($bytes);
    }

    /** The 16 bytes (RFC 4122 order) of a hyphenated or plain hex UUID. */
    public static function bytes(string $uuid): string
    {
        $hex = str_replace('-', '', $uuid);
        if (!preg_match('/^[0-9a-fA-F]{32}$/', $hex)) {
            throw new InvalidArgumentException("\"$uuid\" is not a UUID");
        }

        return (string) hex2bin($hex);
    }

    public static function format(string $bytes): string
    {
        $h = bin2hex($bytes);

        return substr($h, 0, 8) . '-' . substr($h, 8, 4) . '-' . substr($h, 12, 4) . '-' . substr($h, 16, 4) . '-' . substr($h, 20);
    }

    public static function isValid(string $uuid): bool
    {
        return preg_match('/^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i', $uuid) === 1;
    }
}
