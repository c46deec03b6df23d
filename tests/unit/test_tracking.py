"""Metric sinks: logged validation samples (``trainer.log_val_generations``) reach jsonl, TensorBoard and the console."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.controller.tracking import Tracking


def test_log_generations_writes_every_sink(tmp_path):
    lines = []
    tracker = Tracking(["console", "tensorboard", "jsonl"], tmp_path, console=lines.append)
    samples = [{"input": "What is 2 + 3?", "output": "5", "score": 1.0},
               {"input": "a | b\nc", "output": "x", "score": 0.0}]
    tracker.log_generations(samples, step=7)
    tracker.log_generations([], step=8)  # nothing to log: nothing written
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert rows == [{"step": 7, "tag": "val/generations", **s} for s in samples]
    assert lines == ["step 7 val/generations: 'What is 2 + 3?' -> '5' (score 1)",
                     "step 7 val/generations: 'a | b\\nc' -> 'x' (score 0)"]
    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("val/generations/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 7 and "| What is 2 + 3? | 5 | 1 |" in table and "a \\| b<br>c" in table
