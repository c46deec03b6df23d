"""docs/design.md's step table is ``Trainer.train_step``: its ``call`` column names, in order, the phase calls the
method makes (every call of a private phase method of the trainer, and the named phase functions)."""

import ast
import inspect
import re
import textwrap
from pathlib import Path

from megarl.controller.trainer import Trainer

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
PHASE_FUNCTIONS = {"take", "release", "resume", "score_step"}
"""Calls of ``train_step`` that are phases without being the trainer's own ``_`` methods (on ``self.rollout``,
``self.engine_memory``, ``self.reward``, or functions of ``controller``)."""
NOT_PHASES = {"_offload"}
"""The trainer's own calls that are part of a phase (the actor's state leaving around the sync)."""


def phase_calls() -> list[str]:
    """The phase calls of ``train_step``, in source order, each once."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(Trainer.train_step)))
    calls = sorted((node for node in ast.walk(tree) if isinstance(node, ast.Call)),
                   key=lambda node: (node.lineno, node.col_offset))
    out: list[str] = []
    for call in calls:
        func = call.func
        if isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            name = func.attr if owner == "self" else f"{owner.removeprefix('self.')}.{func.attr}"
            short = func.attr
        elif isinstance(func, ast.Name):
            name = short = func.id
        else:
            continue
        private = isinstance(func, ast.Attribute) and ast.unparse(func.value) == "self" and short.startswith("_")
        if (private or short in PHASE_FUNCTIONS) and short not in NOT_PHASES and name not in out:
            out.append(name)
    return out


def table_calls() -> list[str]:
    """The ``call`` column of design.md's step table, in order."""
    text = DESIGN.read_text()
    table = text[text.index("| phase | call | timing |"):]
    lines = table.splitlines()[2:]
    rows = lines[:next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]
    return [re.fullmatch(r"`([\w.]+)`", row.split("|")[2].strip()).group(1) for row in rows]


def test_the_step_table_names_train_steps_phases_in_order():
    assert table_calls() == phase_calls()


def test_the_checker_sees_every_phase():
    calls = phase_calls()
    assert calls[0] == "rollout.take" and calls[-1] == "_step_metrics"
    assert {"_old_log_probs", "reward.score_step", "_sync_weights", "engine_memory.resume"} <= set(calls)
