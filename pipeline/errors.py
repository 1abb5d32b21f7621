"""Domain errors. The CLI turns these into one-line messages and exit codes;
nothing below the CLI prints or exits."""

from __future__ import annotations


class BertpipeError(Exception):
    """Base class: a user-facing problem with a one-line explanation."""

    exit_code = 1


class JobError(BertpipeError):
    """The job file is malformed or inconsistent; the message names the key."""

    exit_code = 2


class OptionError(BertpipeError):
    """A command option or API argument is out of range; the message names it."""

    exit_code = 2


class InputError(BertpipeError):
    """The input table is unusable; the message names the file, column or row."""

    exit_code = 3


class UnreadableInputError(InputError):
    """Rows of the input cannot be read (a damaged data page): the file is at fault, so a
    run reports it as the input's error, not as a partition to retry."""


class ModelError(BertpipeError):
    """The model cannot be loaded or cannot provide what a view asks for."""

    exit_code = 4


class StoreError(BertpipeError):
    """The output store is missing, incomplete, or belongs to a different job."""

    exit_code = 5


class PartitionError(BertpipeError):
    """One or more partitions failed; the others were written and kept."""

    exit_code = 6


class SchedulerError(BertpipeError):
    """The Dask scheduler cannot be reached, or the connection to it was lost."""

    exit_code = 7


class EndpointError(BertpipeError):
    """The object store holding the input or the output cannot be reached (connection
    refused, name not resolved, timeout); nothing was written."""

    exit_code = 8


def first_line(exc: BaseException) -> str:
    """An exception's first line (its class name when it says nothing): library errors
    often run to several lines, a message here is one."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
