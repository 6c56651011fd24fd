<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Casts;

use Illuminate\Contracts\Database\Eloquent\CastsAttributes;
use Outboxd\Laravel\Encryption\CryptoException;
use Outboxd\Laravel\Encryption\TopicEncryption;
use Outboxd\Laravel\Uuid;

/**
 * Keeps a personal field of your own table sealed at rest in the enc:v1 format, with the key
 * ring that seals the outbox's fields: `protected $casts = ['tax_id' => Sealed::class];`.
 * Each value is bound to its row (the model's `uuid` column, or the column named after the
 * colon: `Sealed::class.':public_id'`) and to its table and column, so a value copied to another
 * row or column does not open. Pair it with a blind index column for equality searches.
 *
 * With no key ring configured it refuses to store the value rather than store it in clear.
 */
class Sealed implements CastsAttributes
{
    public function __construct(private readonly string $rowId = 'uuid')
    {
    }

    public function get($model, string $key, $value, array $attributes)
    {
        if ($value === null) {
            return null;
        }

        return $this->encryption()->keyring()->openValue($value, $this->row($attributes, $model), $this->pointer($model, $key));
    }

    public function set($model, string $key, $value, array $attributes)
    {
        if ($value === null) {
            return [$key => null];
        }
        $ring = $this->encryption()->keyring();
        $row = [];
        if (($attributes[$this->rowId] ?? null) === null) {
            // The row's id is what the value is bound to: give the row one now.
            $attributes[$this->rowId] = $row[$this->rowId] = Uuid::v7();
        }

        return $row + [$key => $ring->sealValue($value, $ring->currentKeyId(), $this->row($attributes, $model), $this->pointer($model, $key))];
    }

    private function row(array $attributes, $model): string
    {
        $id = $attributes[$this->rowId] ?? null;
        if (! is_string($id) || ! Uuid::isValid($id)) {
            throw new CryptoException('Malformed', get_class($model)."::\${$this->rowId} must hold the row's UUID to bind sealed values to it");
        }

        return Uuid::bytes($id);
    }

    private function pointer($model, string $key): string
    {
        return '/'.$model->getTable().'/'.$key;
    }

    private function encryption(): TopicEncryption
    {
        return app(TopicEncryption::class);
    }
}
