"""What a person watching a run sees: phases with durations, and the end-of-run summary."""

from __future__ import annotations

import pytest

from megarl.controller.progress import Phases, run_summary


def test_phases_print_their_start_and_end_and_keep_durations():
    lines = []
    phases = Phases(lines.append)
    with phases("starting Ray"):
        pass
    with pytest.raises(RuntimeError), phases("building the model"):
        raise RuntimeError("boom")
    assert lines[0] == "starting Ray ..." and lines[1].startswith("starting Ray: ") and lines[1].endswith(" s")
    assert lines[2] == "building the model ..." and lines[3].startswith("building the model: failed after ")
    assert list(phases.seconds) == ["starting Ray"] and phases.seconds["starting Ray"] >= 0


def test_the_summary_gives_steps_reward_validation_paths_and_the_export_command():
    history = [(step, {"timing_s/step": 2.0 * step, "critic/score/mean": 0.1 * step}) for step in range(1, 11)]
    validations = [(0, {"val-core/gsm8k/reward/mean@4": 0.125, "val-core/gsm8k/reward/best@4/mean": 0.5}),
                   (5, {"val-core/gsm8k/reward/mean@4": 0.25}), (10, {"val-core/gsm8k/reward/mean@4": 0.5})]
    lines = run_summary(history, validations, setup_s=12.0, log_dir="/logs", checkpoint="/ckpt/global_step_10",
                        export_command="megarl-convert mcore-to-hf --mcore /ckpt/global_step_10 --out /hf")
    assert lines == [
        "steps 1-10 (10 run), 11.00 s per step, start-up 12.0 s",
        "sampled reward (critic/score/mean): 0.300 over the first 5 step(s) -> 0.800 over the last 5",
        "val-core/gsm8k/reward/mean@4: 0.125 at step 0 -> 0.500 at step 10",
        "logs: /logs  (tensorboard --logdir /logs)",
        "last checkpoint: /ckpt/global_step_10",
        "export it for serving (HF safetensors): megarl-convert mcore-to-hf --mcore /ckpt/global_step_10 --out /hf",
    ]
    assert run_summary([], [], setup_s=1.0, log_dir="/logs", checkpoint=None, export_command=None) == [
        "logs: /logs  (tensorboard --logdir /logs)"]
