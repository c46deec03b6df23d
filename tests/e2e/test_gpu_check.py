"""``tools/gpu_check.py --shape tiny`` end to end on CPU, set up as on a bare GPU machine: every stage passes with
real numbers, with Ray, Hydra, sglang-router, datasets and pyarrow blocked in the check's process and in its engine
server's (that machine has none of them), and sglang served by ``sglang_min`` (``tools/make_sglang_min.py``, built
here from the installed sglang and put ahead of it on ``PYTHONPATH``, as docs/gpu.md does).

The block is a ``sitecustomize`` on ``PYTHONPATH``, so every Python process of the run installs it at start-up:
a ``sys.meta_path`` finder that raises ``ImportError`` for the blocked packages and logs every sglang module
imported, where it comes from and who imported it. Nothing here depends on the machine's speed: throughput is
only required to be a positive number.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["parity", "engine", "ppo", "sync", "lora", "fp8", "vl", "mfu"]
BLOCKED = ("ray", "hydra", "sglang_router", "pyarrow")
"""Not on a bare GPU machine (pyarrow reads parquet prompt data, which the check has none of)."""
SGLANG_PIECES = {"sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.common", "sglang.srt.utils.patch_torch",
                 "sglang.srt.utils.weight_versions", "sglang.srt.utils.msgspec_utils", "sglang.srt.weight_sync",
                 "sglang.srt.weight_sync.tensor_bucket"}
"""The sglang 0.5.23 modules a GPU machine without sglang carries (serializer, torch-reduction patch, flattened
buckets, weight versions)."""

SITECUSTOMIZE = """
import importlib.machinery, os, sys

BLOCKED = {blocked!r}
LOG = {log!r}


def _log(line):
    with open(LOG, "a") as f:
        f.write(f"{{os.getpid()}} {{line}}\\n")


def _importer():
    # The first frame outside the import machinery: who asked for the module.
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


class BlockImports:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in BLOCKED:
            raise ImportError(f"{{name}} is blocked: the GPU check must run without it")
        if top == "sglang":
            spec = importlib.machinery.PathFinder.find_spec(name, path)  # what the import itself will find
            _log(f"sglang {{name}} {{spec.origin if spec else None}} {{_importer()}}")
        return None


sys.meta_path.insert(0, BlockImports())
_log("start " + " ".join(sys.orig_argv[1:4]))
"""


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """One run of the check: its JSON lines by stage, its RESULT lines, the import log, the JSONL file and where
    sglang_min lies."""
    installed = importlib.util.find_spec("sglang")
    if installed is None:
        pytest.skip("sglang 0.5.23 is not installed (pip install --no-deps sglang==0.5.23): nothing to build sglang_min from")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_sglang_min
    finally:
        sys.path.remove(str(ROOT / "tools"))
    tmp = tmp_path_factory.mktemp("gpu_check")
    sglang_min = tmp / "sglang_min"
    make_sglang_min.build(Path(installed.submodule_search_locations[0]).parent, sglang_min)
    site = tmp / "site"
    site.mkdir()
    log = tmp / "imports.log"
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=BLOCKED, log=str(log)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(sglang_min), str(ROOT)]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--shape", "tiny", "--profile",
                           "--stage-timeout", "250", "--work", str(tmp / "work"), "--out", str(tmp / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    imports = log.read_text().splitlines()  # this run's (the next one appends its own)
    # A stage past --stage-timeout is stopped as failed, every thread's stack printed, and the next stage runs.
    stopped = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--shape", "tiny",
                              "--stages", "parity,ppo", "--stage-timeout", "0.001", "--work", str(tmp / "work"),
                              "--out", str(tmp / "stopped")], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    records = {r["stage"]: r for r in map(json.loads, lines)}
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            results.update({k: float(v) for k, v in (item.split("=", 1) for item in line.split()[1:])})
    return {"records": records, "lines": lines, "results": results, "imports": imports,
            "jsonl": (tmp / "out" / "gpu_check.jsonl").read_text().splitlines(), "sglang_min": sglang_min,
            "out": tmp / "out", "stopped": stopped}


def finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@pytest.mark.slow
def test_every_stage_passes_and_is_written_as_it_finishes(check):
    records = check["records"]
    assert list(records) == ["env", *STAGES, "summary"]
    assert all(r["ok"] for r in records.values()), {k: r for k, r in records.items() if not r["ok"]}
    assert records["summary"]["failed"] == [] and records["summary"]["passed"] == len(STAGES)
    assert check["jsonl"] == check["lines"]
    assert records["env"]["device"] == "cpu" and records["env"]["dtype"] == "bfloat16"


def test_parity_is_within_three_times_bf16s_own_error(check):
    parity = check["records"]["parity"]
    floor = parity["hf_bf16_vs_hf_fp32"]["mean"]
    assert floor > 0 and parity["bound"] == pytest.approx(3 * floor)  # bf16 is real: HF bf16 differs from fp32
    for mode in ("packed", "padded"):
        error = parity[f"{mode}_vs_hf_fp32"]
        assert finite(error["mean"], error["max"]) and 0 < error["mean"] <= 3 * floor, (mode, error, floor)
    assert parity["packed_vs_padded"]["max"] <= 0.05
    assert parity["tokens"] > 1000


def test_ppo_step_is_applied_and_moves_log_probs_with_the_advantages(check):
    ppo = check["records"]["ppo"]
    assert ppo["applied"] is True and ppo["lr"] > 0
    assert finite(ppo["loss"], ppo["grad_norm"]) and ppo["grad_norm"] > 0
    assert ppo["logp_moved_toward_advantage"] > 0


def test_engine_gap_is_finite_and_within_bf16_bound(check):
    engine = check["records"]["engine"]
    assert engine["tokens"] == 8 * 64  # every row generated all its tokens (ignore_eos)
    assert finite(engine["mean"], engine["max"], engine["engine_mean_logp"])
    assert engine["bound"] > 0 and engine["mean"] <= engine["bound"]
    assert engine["engine_mean_logp"] < 0


def test_sync_delivers_every_tensor_exactly(check):
    sync = check["records"]["sync"]
    assert sync["tensors"] == 26 and sync["tensors_differing_before"] > 0  # the engine held other weights
    assert [s["bucket_mb"] for s in sync["syncs"]] == [512, 4]
    for run in sync["syncs"]:
        assert run["differing"] == [] and run["values_read_back"] > 0 and run["gbps"] > 0
        assert run["verified_by_transport"] == 0  # a Qwen2: the engine answers no read-back, as SGLang's
    assert sync["syncs"][1]["values_read_back"] > sync["syncs"][0]["values_read_back"]  # whole tensors too
    assert sync["engine_weight_version"] == "2"
    assert finite(sync["gap_after_sync"]["mean"]) and sync["gap_after_sync"]["mean"] <= sync["gap_bound"]
    assert sync["copy_gbps"] > 0 and check["results"]["sync_vs_copy"] == pytest.approx(sync["sync_vs_copy"], rel=1e-3)


def test_lora_stage_checks_the_adapters_and_their_sync(check):
    """LoRA on the device: adapters off give the plain model's log-probs bit for bit, an update moves no base weight,
    and the adapters alone reach a server serving LoRA, every tensor verified, its log-probs the actor's."""
    lora = check["records"]["lora"]
    assert lora["adapters_off_vs_plain"]["max"] == 0 and lora["adapters_on_vs_off"]["max"] > 0
    assert lora["applied"] and lora["base_weights_moved"] == []
    assert lora["verified"] == lora["adapter_tensors"] == 2 * 7 * 2  # A, B of 7 modules in each of 2 layers
    assert lora["gap"]["tokens"] > 0 and finite(lora["gap"]["mean"])


def test_fp8_stage_checks_the_quantized_sync(check):
    """FP8 rollout on the device: an engine started from the block-FP8 checkpoint gets the actor's weights as FP8 byte
    buckets, every quantized weight and scale read from the engine (first rows, all of the small ones) equal to the
    actor's quantized here, its log-probs finite."""
    fp8 = check["records"]["fp8"]
    assert fp8["quantized_weights"] == 2 * 7 and fp8["differing"] == [] and fp8["values_read_back"] > 0
    # the transport's sample refused (SGLang's Qwen2 reads nothing back): the engine reported unverified
    assert fp8["verified_by_transport"] == 0 and fp8["unverifiable_engines"] == 1
    assert fp8["whole_read_back"] == 2 * fp8["quantized_weights"]  # the tiny shape's are all small: read whole
    assert fp8["gap"]["tokens"] > 0 and finite(fp8["gap"]["mean"])


def test_vl_stage_serves_images_and_syncs_the_vision_tower(check):
    """A vision-language policy on the device: an engine generates from image prompts, the actor recomputes the
    log-probs within the engine stage's bound and takes an update, and every weight, the tower's too, reaches the
    server: the first rows of every tensor read from the engine equal."""
    vl = check["records"]["vl"]
    assert vl["gap"]["tokens"] > 0 and finite(vl["gap"]["mean"]) and vl["image_tokens"] > 0
    assert vl["bound"] is None or vl["gap"]["mean"] <= vl["bound"]
    assert vl["applied"] and vl["tower_tensors"] > 0 and vl["differing"] == [] and vl["values_read_back"] > 0
    assert vl["verified_by_transport"] == 0 and vl["unverifiable_engines"] == 1  # SGLang's Qwen2.5-VL reads nothing


def test_mfu_line_has_both_sides_and_a_ratio(check):
    mfu = check["records"]["mfu"]
    for side in ("megarl", "hf_sdpa"):
        assert mfu[side]["tokens_per_s"] > 0 and mfu[side]["mfu"] is None  # no peak known for a CPU
    assert mfu["megarl"]["applied"] == [True, True]
    assert mfu["params"] > 0 and mfu["flops_per_token"] > 6 * mfu["params"]
    assert finite(mfu["mfu_vs_hf"]) and mfu["mfu_vs_hf"] > 0
    assert check["results"]["mfu_vs_hf"] == pytest.approx(mfu["mfu_vs_hf"], rel=1e-3)


def test_profile_names_each_sides_operators(check):
    """``--profile``: one more step of each side under torch's profiler, its operators by their own time."""
    megarl, hf = ((check["out"] / f"profile_{side}.txt").read_text() for side in ("megarl", "hf"))
    for table in (megarl, hf):
        assert "Self CPU" in table and "aten::mm" in table
    assert "scaled_dot_product" in megarl  # the local spec's attention by SDPA
    assert "Optimizer.step" in hf


def test_a_stage_past_its_time_limit_is_stopped_and_the_next_one_runs(check):
    stopped = check["stopped"]
    assert stopped.returncode == 1, stopped.stdout[-2000:] + stopped.stderr[-3000:]
    records = {r["stage"]: r for r in map(json.loads, (x for x in stopped.stdout.splitlines() if x.startswith("{")))}
    assert list(records) == ["env", "parity", "ppo", "summary"]
    assert not records["parity"]["ok"] and records["parity"]["error"].startswith("StageTimeout: stage parity")
    assert records["summary"]["failed"] == ["parity", "ppo"]
    assert "past --stage-timeout" in stopped.stderr and "most recent call first" in stopped.stderr


def test_blocked_packages_stay_out_and_sglang_is_the_carried_pieces(check):
    starts = [line for line in check["imports"] if " start " in line]
    # The tool, its server, the lora stage's server serving LoRA, the fp8 stage's serving FP8, the vl stage's.
    assert len(starts) == 5 and sum("megarl.engines.cpu_engine" in line for line in starts) == 4, starts
    imported = [line.split(maxsplit=4)[2:] for line in check["imports"] if " sglang " in line]
    assert all(origin.startswith(str(check["sglang_min"])) for _, origin, _ in imported), imported
    names = {name for name, _, _ in imported}
    assert names <= SGLANG_PIECES, names - SGLANG_PIECES
    # The sender's bucket and serializer, the server's weight versions: both sides of the sync.
    assert {"sglang.srt.weight_sync.tensor_bucket", "sglang.srt.utils.common", "sglang.srt.utils.weight_versions"} <= names
    direct = {name for name, _, importer in imported if importer.startswith(str(ROOT / "megarl"))}
    assert direct and direct <= names
