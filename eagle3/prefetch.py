"""Run a generator ahead of its consumer on a thread: the merge's pass 2 loads and sorts the next bucket while this
one is written, training batches the next micro-batches while the GPU computes (pyarrow and torch's copies release
the GIL)."""

from __future__ import annotations

import queue
import threading
from typing import Iterator


def prefetched(items: Iterator, depth: int = 1, name: str = "prefetch") -> Iterator:
    """`items`, produced up to `depth` items ahead on a daemon thread. Exceptions reach the caller; closing the
    returned generator (or leaving its loop) stops the thread."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def work():
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put(item)
            q.put(done)
        except BaseException as e:  # handed to the consumer
            q.put(e)

    t = threading.Thread(target=work, daemon=True, name=name)
    t.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
        t.join()
