"""Ctrl-C (SIGINT) held over a start-up that cannot be interrupted safely.

``ray.init`` starts the GCS, the raylet and their agents and connects the driver's core worker;
a ``KeyboardInterrupt`` raised inside it leaves a half-connected driver (it segfaulted at exit)
and agent processes that outlive the run for about a minute, and the trainer does not yet know
it started Ray, so it cannot stop it. :func:`interrupts_deferred` lets such a block finish, then
raises the interrupt, so the caller's clean-up sees a whole state and stops what was started.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupts_deferred(what: str) -> Iterator[None]:
    """Hold SIGINT until the block ends, then raise ``KeyboardInterrupt`` (when one arrived).

    ``what`` names the block in the message printed when an interrupt is held. A second Ctrl-C
    interrupts at once. Outside the main thread, or when SIGINT is ignored, nothing changes.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is signal.SIG_IGN:
        yield
        return
    received: list[int] = []

    def hold(signum, frame) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        print(f"interrupt: stopping once {what} is done (Ctrl-C again to stop at once, which may leave "
              f"processes behind)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt
