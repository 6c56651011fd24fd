<?php

namespace App\Http\Controllers;

use App\Actions\IssueInvoice;
use App\Models\Invoice;
use Illuminate\Http\JsonResponse;
use Illuminate\Http\Request;

class InvoiceController extends Controller
{
    public function store(Request $request, IssueInvoice $issue): JsonResponse
    {
        $data = $this->validate($request, [
            'number' => ['required', 'string', 'max:32'],
            'customer_name' => ['required', 'string', 'max:255'],
            'tax_id' => ['required', 'string', 'max:32'],
            'total_cents' => ['required', 'integer', 'min:0'],
        ]);

        [$invoice, $eventId] = $issue($data);

        return new JsonResponse(['id' => $invoice->id, 'number' => $invoice->number, 'event_id' => $eventId], 201);
    }

    /** Finds invoices by tax id through its blind index: the column itself is sealed. */
    public function byTaxId(string $taxId): JsonResponse
    {
        return new JsonResponse(Invoice::whereTaxId($taxId)->get(['id', 'number', 'total_cents']));
    }
}
