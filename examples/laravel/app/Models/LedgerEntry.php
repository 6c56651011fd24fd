<?php

namespace App\Models;

use Illuminate\Database\Eloquent\Model;
use Outboxd\Laravel\Casts\Sealed;

/** The billing consumer's effect: one line per issued invoice. */
class LedgerEntry extends Model
{
    protected $table = 'ledger';

    public $timestamps = false;

    protected $fillable = ['invoice_id', 'event_id', 'customer_name', 'total_cents', 'booked_at'];

    protected $casts = [
        'customer_name' => Sealed::class,
        'total_cents' => 'integer',
        'booked_at' => 'datetime',
    ];
}
