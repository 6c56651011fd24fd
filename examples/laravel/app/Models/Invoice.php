<?php

namespace App\Models;

use Illuminate\Database\Eloquent\Builder;
use Illuminate\Database\Eloquent\Model;
use Outboxd\Laravel\Casts\Sealed;
use Outboxd\Laravel\Facades\Outbox;

/**
 * An issued invoice. The customer's name and tax id are personal data: sealed at rest with the
 * outbox's key ring (no clear copy in this table either), the tax id searchable through its
 * blind index.
 */
class Invoice extends Model
{
    public $timestamps = false;

    protected $fillable = ['number', 'customer_name', 'tax_id', 'total_cents', 'issued_at'];

    protected $hidden = ['customer_name', 'tax_id', 'tax_id_index', 'tax_id_index_key'];

    protected $casts = [
        'customer_name' => Sealed::class,
        'tax_id' => Sealed::class,
        'total_cents' => 'integer',
        'issued_at' => 'datetime:Y-m-d H:i:s.u',
    ];

    protected static function booted()
    {
        static::saving(function (Invoice $invoice) {
            if ($invoice->isDirty('tax_id')) {
                [$invoice->tax_id_index_key, $invoice->tax_id_index] = Outbox::blindIndex('invoice.issued', 'tax_id', $invoice->tax_id);
            }
        });
    }

    public function scopeWhereTaxId(Builder $query, string $taxId): Builder
    {
        [$key, $index] = Outbox::blindIndex('invoice.issued', 'tax_id', $taxId);

        return $query->where('tax_id_index_key', $key)->where('tax_id_index', $index);
    }
}
