"""Smoke test of the benchmark scripts in tools/: they run end to end and end with a usable RESULT line.

Each script's ``main`` runs at a tiny size on 2 gloo ranks (the benchmark itself uses
TP=2×PP=2 on 4; a 4-rank spawn alone costs ~12 s on 2 cores). The layouts are chosen so
that between them both collectives run: the export's TP gather (bench_convert at TP=2) and
the pipeline delivery (bench_weight_sync at PP=2, both transports into CPU engine servers);
bench_packing runs on one rank. No timing is asserted: benchmarks report numbers, tests check that the numbers exist.
"""

import importlib
import math
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
TINY = ["--hidden", "64", "--layers", "2", "--vocab", "250", "--repeats", "1", "--bucket-mb", "0.25", "--timeout", "120"]
# Memory above the baseline can be 0 at this size (RSS moves in pages); everything else must be > 0.
MAY_BE_ZERO = {"peak_extra_mb", "peak_over_bucket", "peak_regular_over_bucket", "shards_peak_extra_mb",
               "max_logp_diff"}


@pytest.fixture
def tools(monkeypatch):
    """The tools/ scripts as modules (rank functions must be importable by the spawned ranks)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    return lambda name: importlib.import_module(name)


def _run(module, argv, capsys) -> dict[str, float]:
    returned = module.main(argv)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines and lines[-1].startswith("RESULT "), lines[-5:]
    values = importlib.import_module("bench_convert").parse_result(lines[-1])
    assert values.keys() == returned.keys()
    for name, value in values.items():
        assert math.isfinite(value), (name, value)
        assert value >= 0 if name in MAY_BE_ZERO else value > 0, (name, value)
    return values


def test_parse_result_reads_every_number(tools):
    bench_convert = tools("bench_convert")
    line = bench_convert.result_line({"a_s": 1.23456, "ratio": 2.0, "bit_exact": 1})
    assert line == "RESULT a_s=1.235 ratio=2 bit_exact=1"
    assert bench_convert.parse_result(line) == {"a_s": 1.235, "ratio": 2.0, "bit_exact": 1.0}


def test_bench_convert_smoke(tools, tmp_path, capsys):
    values = _run(tools("bench_convert"), TINY + ["--tp", "2", "--pp", "1", "--workdir", str(tmp_path)], capsys)
    assert values["bit_exact"] == 1
    assert {"hf_to_mcore_ratio", "mcore_to_hf_ratio", "io_only_s"} <= values.keys()


def test_bench_weight_sync_smoke(tools, tmp_path, capsys):
    """One RESULT line per transport, through real CPU engine servers (PP=2: both stages deliver)."""
    returned = tools("bench_weight_sync").main(TINY + ["--tp", "1", "--pp", "2", "--workdir", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    results = [line for line in lines if line.startswith("RESULT ")]
    assert [line.split()[1] for line in results] == ["transport=tensor", "transport=distributed"], lines[-8:]
    assert lines[-2:] == results
    parse = importlib.import_module("bench_convert").parse_result
    for line, name in zip(results, ("tensor", "distributed")):
        values = parse("RESULT " + " ".join(line.split()[2:]))
        assert values.keys() == returned[name].keys()
        assert {"ratio_vs_limit", "speedup_vs_per_tensor", "peak_over_bucket", "gbps"} <= values.keys()
        assert values["bit_exact"] == 1
        for key, value in values.items():
            assert math.isfinite(value), (name, key, value)
            assert value >= 0 if key in MAY_BE_ZERO else value > 0, (name, key, value)


def test_bench_lora_sync_smoke(tools, tmp_path, capsys):
    """Both LoRA sync modes into a real CPU engine server serving LoRA (TP=2: the adapters gathered over TP)."""
    values = _run(tools("bench_lora_sync"), ["--hidden", "64", "--layers", "2", "--vocab", "250", "--repeats", "1",
                                             "--rank", "4", "--tp", "2", "--timeout", "120", "--workdir",
                                             str(tmp_path)], capsys)
    assert values.keys() == {"adapters_bytes_frac", "speedup", "merged_s", "adapters_s", "adapters_mib",
                             "merged_mib"}
    assert values["adapters_bytes_frac"] < 1


def test_bench_packing_smoke(tools, capsys):
    """Padded against packed on one rank: the same log-probs, both timed."""
    values = _run(tools("bench_packing"), ["--hidden", "64", "--layers", "2", "--vocab", "250", "--repeats", "1",
                                           "--rows", "4", "--min-len", "4", "--max-len", "24", "--timeout", "120"],
                  capsys)
    assert values.keys() == {"packed_speedup", "padded_s", "packed_s", "max_logp_diff"}
    assert values["max_logp_diff"] <= 1e-5


def test_bench_async_summaries(tools, capsys):
    """bench_async's arithmetic on hand-made step metrics (its runs are a few minutes: not a test)."""
    bench = tools("bench_async")
    sync = [{"timing_s/step": 2.0, "timing_s/gen": 0.5, "critic/score/mean": 0.1 * i} for i in range(10)]
    lagged = [{**m, "timing_s/step": 1.5, "async/trainer_idle_frac": 0.0, "async/engine_idle_frac": 0.5,
               "async/staleness/max": 1.0} for m in sync]
    summaries = bench.report("t", {"sync": sync, "fully_async": lagged})
    assert summaries["sync"]["steps_per_min"] == pytest.approx(30.0)  # 9 steps after the first in 18 s
    assert summaries["fully_async"]["steps_per_min"] == pytest.approx(40.0)
    assert summaries["sync"]["reward_rise"] == pytest.approx(0.5)  # mean of 0.5..0.9 minus mean of 0..0.4
    assert bench.overlap_bound(summaries["sync"]) == pytest.approx(2.0 / 1.5)
    assert summaries["fully_async"]["engine_idle_frac"] == 0.5 and summaries["fully_async"]["staleness_max"] == 1
    assert "fully_async  0.12 min: 0.400  0.25 min: 0.900" in capsys.readouterr().out


def test_bench_async_result_keys(tools):
    """bench_async's RESULT numbers from hand-made summaries: speedups, overlap bounds and generation shares."""
    bench = tools("bench_async")

    def modes(sync_step, gen, async_step, one_step):
        base = {"reward_rise": 0.1, "gen_s": gen}
        return {"sync": {**base, "step_s": sync_step, "steps_per_min": 60 / sync_step},
                "one_step_off": {**base, "step_s": one_step, "steps_per_min": 60 / one_step},
                "fully_async": {**base, "step_s": async_step, "steps_per_min": 60 / async_step}}

    tiny_only = bench.results(modes(2.0, 0.2, 1.85, 1.9), None)
    assert "gen_share" not in tiny_only and tiny_only["tiny_gen_share"] == pytest.approx(0.1)
    values = bench.results(modes(2.0, 0.2, 1.85, 1.9), modes(2.0, 0.95, 1.1, 1.2))
    assert values.keys() == {"async_speedup", "one_step_speedup", "async_reward_rise", "one_step_reward_rise",
                             "sync_reward_rise", "overlap_bound", "tiny_gen_share", "async_of_bound",
                             "gen_bound_async_speedup", "gen_bound_one_step_speedup", "gen_bound_overlap_bound",
                             "gen_share", "gen_bound_async_of_bound"}
    assert values["gen_share"] == pytest.approx(0.475)
    assert values["gen_bound_overlap_bound"] == pytest.approx(2.0 / 1.05)
    assert values["gen_bound_async_speedup"] == pytest.approx(2.0 / 1.1)
    assert values["gen_bound_async_of_bound"] == pytest.approx(1.05 / 1.1)
    assert "the ceiling is 1.67x" in bench.describe_bound({"gen_s": 1.2, "step_s": 2.0}, 2.5)


def test_bench_fp8_sync_smoke(tools, capsys):
    values = _run(tools("bench_fp8_sync"), ["--arch", "Qwen2.5-0.5B"], capsys)
    assert 0.5 < values["fp8_sync_bytes_frac"] == values["Qwen2.5-0.5B"] < 0.8  # its large tied embedding stays BF16
