"""A graph closed on this thread while another thread calls it in a loop (a replay, an
update): the race that a lock per graph settles, made as likely as the interpreter allows."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import aiostream as ais


def closed_while_called(graph: ais.Graph, call: Callable[[], object]) -> list[BaseException]:
    """Call ``call()`` in a loop on a thread of its own, close ``graph`` here once the first
    call has ended, and return what ended the loop (where close and the call exclude each
    other: one error, the documented "closed" one). Threads switch between any two steps of
    either meanwhile."""
    raised: list[BaseException] = []
    started = threading.Event()

    def loop() -> None:
        try:
            while True:
                call()
                started.set()
        except BaseException as exc:  # noqa: BLE001 - what it was is the check
            raised.append(exc)
            started.set()

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        thread = threading.Thread(target=loop)
        thread.start()
        started.wait()
        graph.close()
        thread.join()
    finally:
        sys.setswitchinterval(switch)
    return raised
