"""The real ``megarl-plan`` process (its pure plan is tests/unit/test_plan.py)."""

from __future__ import annotations

from megarl.models.known import KNOWN_ARCHITECTURES


def test_megarl_plan_on_a_zero_width_config_exits_2_naming_the_field(tmp_path):
    """The real ``megarl-plan`` process on a config.json with hidden_size 0 (it died
    with ZeroDivisionError) exits 2 with one line naming the key, the file and the field."""
    import json
    import subprocess
    import sys

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**KNOWN_ARCHITECTURES["Qwen2.5-7B"], "hidden_size": 0}))
    run = subprocess.run([sys.executable, "-m", "megarl.cli.plan", "recipe=qwen2_5_7b_grpo",
                          f"actor_rollout_ref.model.path={model}"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"actor_rollout_ref.model.path: {model / 'config.json'}" in run.stderr
    assert "hidden_size=0; it must be an integer from 1 to" in run.stderr
    assert "Traceback" not in run.stderr
