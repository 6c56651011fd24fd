<?php

namespace App\Console\Commands;

use App\Actions\IssueInvoice;
use Illuminate\Console\Command;

class IssueInvoices extends Command
{
    protected $signature = 'invoices:issue
                            {--count=1 : How many invoices to issue}
                            {--rate=20 : Invoices a second}
                            {--first=1 : The first invoice number}';

    protected $description = 'Issue demo invoices at a steady rate, printing "<number> <event id>" for each';

    public function handle(IssueInvoice $issue): int
    {
        $count = (int) $this->option('count');
        $rate = max(1, (int) $this->option('rate'));
        $first = (int) $this->option('first');
        $start = microtime(true);

        for ($n = 0; $n < $count; $n++) {
            $k = $first + $n;
            [$invoice, $eventId] = $issue([
                'number' => sprintf('INV-%08d', $k),
                'customer_name' => "Customer Ğüneş $k",
                'tax_id' => sprintf('DE%09d', $k * 7919 % 1000000000),
                'total_cents' => 1000 + $n,
            ]);
            $this->line("{$invoice->number} $eventId");

            // Pace to the rate: the next invoice is due at start + (n + 1) / rate.
            $wait = $start + ($n + 1) / $rate - microtime(true);
            if ($wait > 0) {
                usleep((int) ($wait * 1e6));
            }
        }

        return self::SUCCESS;
    }
}
