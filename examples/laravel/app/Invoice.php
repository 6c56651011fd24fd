<?php
// The business row: an Eloquent model on the `invoices` table.

declare(strict_types=1);

namespace App;

use Illuminate\Database\Eloquent\Model;

final class Invoice extends Model
{
    protected $table = 'invoices';
    public $timestamps = false;
    protected $guarded = [];
}
