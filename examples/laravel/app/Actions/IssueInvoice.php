<?php

namespace App\Actions;

use App\Models\Invoice;
use Illuminate\Support\Facades\DB;
use Outboxd\Laravel\Facades\Outbox;

class IssueInvoice
{
    /**
     * Saves the invoice and writes its invoice.issued event in one transaction: both commit or
     * neither does, and outboxd relays the event once it has committed.
     *
     * @param  array{number:string,customer_name:string,tax_id:string,total_cents:int}  $data
     * @return array{0: Invoice, 1: string} the invoice and its event id
     */
    public function __invoke(array $data): array
    {
        return DB::transaction(function () use ($data) {
            $invoice = Invoice::create($data + ['issued_at' => now('UTC')]);

            $eventId = Outbox::write('invoice.issued', $invoice->id, [
                'invoice_id' => $invoice->id,
                'number' => $invoice->number,
                'customer_name' => $data['customer_name'],
                'tax_id' => $data['tax_id'],
                'total_cents' => $invoice->total_cents,
            ], version: 1);

            return [$invoice, $eventId];
        });
    }
}
