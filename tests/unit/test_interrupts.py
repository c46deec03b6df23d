"""SIGTERM stops a run as Ctrl-C does, and a start-up block (``ray.init``) holds both until it is done, with the
handlers as they were after it (``ray.init`` replaces SIGTERM's with ``sys.exit``)."""

from __future__ import annotations

import os
import signal

import pytest

from megarl.controller.interrupts import Terminated, interrupts_deferred, terminate_as_interrupt


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_sigterm_raises_terminated_a_keyboard_interrupt(handlers):
    terminate_as_interrupt()
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
    assert issubclass(Terminated, KeyboardInterrupt)


@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_deferred_block_finishes_then_raises_and_restores_the_handlers(handlers, capsys, signum, raised):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job starts with SIGINT ignored)
    terminate_as_interrupt()
    finished = []
    with pytest.raises(raised) as caught:
        with interrupts_deferred("the block"):
            os.kill(os.getpid(), signum)
            signal.signal(signal.SIGTERM, lambda *_: None)  # as ray.init replaces it
            finished.append(True)
    assert finished == [True] and type(caught.value) is raised
    assert "stopping once the block is done" in capsys.readouterr().err
    with pytest.raises(Terminated):  # megarl's handler again, not the one installed inside
        os.kill(os.getpid(), signal.SIGTERM)
