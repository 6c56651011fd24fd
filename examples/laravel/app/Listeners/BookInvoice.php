<?php

namespace App\Listeners;

use App\Models\LedgerEntry;
use Outboxd\Laravel\Consumer\OutboxMessage;
use Outboxd\Laravel\Exceptions\PoisonMessage;

/**
 * Books an issued invoice in the ledger. outbox:consume runs it inside the transaction that
 * claims the message, so it runs once per invoice however often the broker delivers it.
 */
class BookInvoice
{
    public function handle(OutboxMessage $message): void
    {
        foreach (['invoice_id', 'customer_name', 'total_cents'] as $field) {
            if (! isset($message->payload[$field])) {
                throw new PoisonMessage("invoice.issued without $field");
            }
        }

        LedgerEntry::create([
            'invoice_id' => $message->payload['invoice_id'],
            'event_id' => $message->id,
            'customer_name' => $message->payload['customer_name'],
            'total_cents' => $message->payload['total_cents'],
            'booked_at' => now('UTC'),
        ]);
    }
}
