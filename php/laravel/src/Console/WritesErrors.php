<?php

declare(strict_types=1);

namespace Outboxd\Laravel\Console;

use Symfony\Component\Console\Output\ConsoleOutputInterface;

/** Errors to stderr, so a command that filters stdin to stdout keeps its stdout clean. */
trait WritesErrors
{
    protected function stderr(string $message): void
    {
        $output = $this->output->getOutput();
        $target = $output instanceof ConsoleOutputInterface ? $output->getErrorOutput() : $output;
        $target->writeln('<error>'.$message.'</error>');
    }

    protected function stdin(): string
    {
        return (string) stream_get_contents(STDIN);
    }
}
