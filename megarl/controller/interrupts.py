"""Ctrl-C (SIGINT) and SIGTERM: a run stops the same way for both, and a start-up that cannot be interrupted
safely holds them.

``kill``, ``scancel`` and ``docker stop`` send SIGTERM. :func:`terminate_as_interrupt` makes it raise
:class:`Terminated`, a ``KeyboardInterrupt``, so the run stops its workers, engines and Ray as after a Ctrl-C and
says so. ``ray.init`` installs its own SIGTERM handler in the driver (``sys.exit``, whose ``SystemExit`` lands
anywhere: the driver ended with SIGABRT and Ray's C++ stack, no line of megarl's): the trainer installs megarl's
again once Ray is up.

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

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM
"""``megarl-train``'s exit code after a SIGTERM (as a shell reports a process it ended: 143)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the run stops as for a Ctrl-C."""


def _terminated(signum, frame) -> None:
    raise Terminated


def terminate_as_interrupt() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (elsewhere: nothing changes)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


@contextlib.contextmanager
def interrupts_deferred(what: str) -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then raise ``KeyboardInterrupt`` (or :class:`Terminated`)
    when one arrived, the handlers as they were before the block (``ray.init`` replaces SIGTERM's).

    ``what`` names the block in the message printed when an interrupt is held. A second one interrupts at once.
    Outside the main thread nothing changes; a signal that was ignored stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    received: list[int] = []

    def hold(signum, frame) -> None:
        if received:
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        received.append(signum)
        name = "SIGTERM" if signum == signal.SIGTERM else "interrupt"
        print(f"{name}: stopping once {what} is done (Ctrl-C again to stop at once, which may leave "
              f"processes behind)", file=sys.stderr, flush=True)

    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise Terminated if received[0] == signal.SIGTERM else KeyboardInterrupt
