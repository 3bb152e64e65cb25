"""Batching of streamed items: full batches from files, prompt hand-over from trickling pipes."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


def batches(items: Iterator[T], size: int, wait: float = 0.05) -> Iterator[list[T]]:
    """Group items into batches of up to `size`, but hand over what has arrived when input pauses.

    A reader thread pulls items; the consumer blocks for the first item of a batch and then takes
    more only while they keep arriving within `wait` seconds. A file fills whole batches; a
    trickling pipe gets its records out before its input ends.
    """
    q: queue.Queue = queue.Queue(maxsize=4 * size)

    def reader() -> None:
        try:
            for item in items:
                q.put(item)
            q.put(_END)
        except BaseException as exc:  # handed to the consumer, raised there
            q.put(exc)

    threading.Thread(target=reader, daemon=True).start()
    done = False
    while not done:
        item = q.get()
        batch: list[T] = []
        while True:
            if item is _END:
                done = True
                break
            if isinstance(item, BaseException):
                if batch:
                    yield batch
                raise item
            batch.append(item)
            if len(batch) >= size:
                break
            try:
                item = q.get(timeout=wait)
            except queue.Empty:
                break
        if batch:
            yield batch


def token_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Split indices (pre-sorted by length) into batches with count x longest <= budget."""
    out: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and max(longest, n) * (len(current) + 1) > budget:
            out.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out
