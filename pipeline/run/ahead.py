"""Preparing the next items on a thread of their own while the caller works on this one.

An executor uses it to read, tokenize, chunk and batch the next partition (CPU work) while
the encoder runs the current one (on a GPU, mostly waiting for the device): the device is
fed without waiting for the CPU. The fast tokenizer releases the GIL while it tokenizes,
so the two threads overlap in Python too.

Bounded: at most `depth` items are prepared (or being prepared) ahead of the one the caller
holds, so memory grows by `depth` prepared partitions, not by the input. Items come back in
their given order. A failure to prepare an item is handed back as that item's outcome,
where the caller reports it exactly as it would have reported it preparing the item itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True)
class Prepared(Generic[Item, Result]):
    """One item and what preparing it gave: its result, or the exception it raised."""

    item: Item
    result: Result | None = None
    error: Exception | None = None

    def get(self) -> Result:
        """The result, or the item's exception raised here, in the caller's thread."""
        if self.error is not None:
            raise self.error
        return self.result  # type: ignore[return-value]  # None only with an error


def prepared_ahead(items: Sequence[Item], prepare: Callable[[Item], Result], depth: int
                   ) -> Generator[Prepared[Item, Result], None, None]:
    """`prepare(item)` for every item, in order; with `depth` > 0 on one thread that runs
    up to `depth` items ahead of the caller, else in the caller's thread as it asks.

    Closing the iterator early (the caller stopped on an error) stops the thread after the
    item it is preparing; nothing more is prepared."""
    if depth <= 0:
        for item in items:
            yield _attempt(prepare, item)
        return
    ready: queue.SimpleQueue[Prepared[Item, Result] | _Crash] = queue.SimpleQueue()
    room = threading.Semaphore(depth)  # a slot per item prepared ahead of the caller's
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                room.acquire()
                if stop.is_set():
                    return
                ready.put(_attempt(prepare, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            ready.put(_Crash(exc))

    thread = threading.Thread(target=produce, name="bertpipe-prepare", daemon=True)
    thread.start()
    try:
        for _ in items:
            got = ready.get()
            if isinstance(got, _Crash):
                raise got.exc
            room.release()  # the caller holds this one now: the thread may start the next
            yield got
    finally:
        stop.set()
        room.release()  # wakes the thread if it waits for room; it sees `stop` and returns
        thread.join()


@dataclass(frozen=True)
class _Crash:
    """What stopped the preparing thread itself (not one item's failure)."""

    exc: BaseException


def _attempt(prepare: Callable[[Item], Result], item: Item) -> Prepared[Item, Result]:
    try:
        return Prepared(item, prepare(item))
    except Exception as exc:  # noqa: BLE001 - the caller reports it for this item
        return Prepared(item, error=exc)
