"""The benchmark runner (``benchmarks/``): a tiny real run on cpu_numpy, and its parts.

Speed is never asserted here (design §8): these tests keep the runner from rotting — every
case still builds and runs, needle's results still agree with the peers, the JSON holds what
the README promises, and a wrong or failing implementation is reported, not hidden.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from benchmarks import __main__ as bench_main
from benchmarks import report, runner
from benchmarks.frameworks import frameworks_for
from benchmarks.runner import Bench, Case, Context, Impl, Settings, Skip, run_case

import needle.backend_ndarray as nd
from needle.errors import DTypeError

ARRAY_GROUPS = {"matmul", "linear", "add", "exp", "sum", "softmax", "rmsnorm", "small_op"}
FAST = Settings(repeat=3, min_sample_s=1e-4, budget_s=1.0)


@pytest.fixture(scope="module")
def ctx() -> Context:
    frameworks, _ = frameworks_for(nd.cpu_numpy())
    return Context(nd.cpu_numpy(), frameworks, quick=True)


def test_quick_run_on_cpu_numpy_covers_the_runners_cases(tmp_path, capsys):
    out = tmp_path / "bench.json"
    # the runner's own cases; plug-in modules (cases_llm.py) are smoke-tested by their owners
    rc = bench_main.main(["--device", "cpu_numpy", "--quick", "--repeat", "2",
                          "--cases", ",".join(sorted(ARRAY_GROUPS | {"train"})),
                          "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu_numpy"
    assert data["machine"]["frameworks"]["needle"]["device"] == "cpu_numpy"
    assert data["broken_case_modules"] == {}
    names = {c["name"] for c in data["cases"]}
    for expected in ("matmul_f32_64", "linear_f32_qkv_16", "linear_f32_down_16", "add_64k",
                     "exp_64k", "sum_rows_256x256", "sum_cols_256x256", "softmax_256x256",
                     "rmsnorm_256x256", "small_add_1", "mlp_step_784-64-64-10_b32"):
        assert expected in names
    for case in data["cases"]:
        if case["skipped"]:  # only training may skip (needle.nn not importable)
            assert case["group"] == "train", case
            continue
        assert case["check"]["ok"], case
        assert case["impls"]["needle"]["median_s"] > 0
        if case["group"] in ARRAY_GROUPS:
            assert "numpy" in case["impls"], case["name"]
        for fw, impl in case["impls"].items():
            assert impl["error"] is None, (case["name"], fw, impl["error"])
            assert len(impl["samples_s"]) == 2 and all(t > 0 for t in impl["samples_s"])
    assert data["ceilings"]["copy"]["rate"] > 0
    assert data["ceilings"]["matmul_float32"]["rate"] > 0
    table = capsys.readouterr().out
    assert "ceiling: copy bandwidth" in table and "matmul_f32_128" in table


def test_bad_device_and_unmatched_cases_exit_2(capsys):
    assert bench_main.main(["--device", "tpu"]) == 2
    assert bench_main.main(["--device", "cpu_numpy", "--cases", "no_such_case"]) == 2
    assert "--list" in capsys.readouterr().err


def test_disabled_device_says_why(capsys):
    disabled = [d for d in nd.all_devices() if not d.enabled()]
    if not disabled:
        pytest.skip("every device is enabled here")
    assert bench_main.main(["--device", disabled[0].name]) == 2
    assert disabled[0].reason in capsys.readouterr().err


def test_discover_finds_the_case_modules(ctx):
    cases, broken = runner.discover(ctx)
    assert broken == {}
    groups = {c.group for c in cases}
    assert {"matmul", "add", "exp", "sum", "softmax", "rmsnorm", "small_op", "train"} <= groups
    assert len({c.name for c in cases}) == len(cases), "case names must be unique"


def test_select_by_group_name_and_glob(ctx):
    cases, _ = runner.discover(ctx)
    assert {c.group for c in runner.select(cases, ["sum"])} == {"sum"}
    assert [c.name for c in runner.select(cases, ["sum_rows_*"])] == ["sum_rows_256x256"]
    assert runner.select(cases, ["add"]) == [c for c in cases if c.group == "add"]
    assert runner.select(cases, [""]) == cases


def _case(needle_op, numpy_op=lambda a: a * 2.0) -> Case:
    def build(c: Context) -> Bench:
        sets = c.input_sets(lambda rng: (rng.standard_normal(64, dtype=np.float32),))
        return Bench(c.bind({"needle": needle_op, "numpy": numpy_op}, sets), bytes=512)

    return Case("synthetic", "test", build)


def test_a_wrong_needle_result_is_flagged(ctx):
    good = run_case(_case(lambda a: a * 2.0), ctx, FAST)
    assert not good.wrong and good.check_peer == "numpy" and good.check_error == 0.0
    bad = run_case(_case(lambda a: a * 2.01), ctx, FAST)
    assert bad.wrong and bad.check_error > 1e-3
    assert bad.median("needle") > 0  # still timed: the table shows both


def test_every_peer_is_compared_and_notes_reach_the_table_and_json(ctx):
    def build(c: Context) -> Bench:
        sets = c.input_sets(lambda rng: (rng.standard_normal(64, dtype=np.float32),))
        impls = c.bind({"needle": lambda a: a * 2.0, "numpy": lambda a: a * 2.0}, sets)
        impls["numpy:off"] = Impl(lambda a: a * 2.5, sets)  # a second peer, another answer
        return Bench(impls, bytes=512, notes=["set up in 0 s", "set up in 0 s"])

    res = run_case(Case("peers", "test", build), ctx, FAST)
    assert res.check_peer == "numpy" and not res.wrong  # the first peer decides
    assert res.peer_errors["numpy"] == 0.0 and res.peer_errors["numpy:off"] > 0.1
    info = {"cpu": "x", "cpus_usable": 1, "cpu_count": 1, "frameworks": {}}
    text = report.table([res], {}, "cpu_numpy", FAST, info)
    assert "ok (0e+00 vs numpy)" in text and "DIFFERS (2e-01 vs needle)" in text
    assert text.count("set up in 0 s") == 1 and "note (peers): set up in 0 s" in text
    data = report.to_json([res], {}, "cpu_numpy", FAST, info, True, {})
    assert data["cases"][0]["notes"] == ["set up in 0 s"] * 2
    assert data["cases"][0]["check"]["peers"]["numpy:off"] == res.peer_errors["numpy:off"]


def test_a_failing_implementation_is_reported_and_the_others_timed(ctx):
    def boom(a):
        raise DTypeError("no such kernel")

    res = run_case(_case(boom), ctx, FAST)
    assert "DTypeError: no such kernel" in res.impls["needle"].error
    assert res.impls["needle"].timing is None
    assert res.median("numpy") > 0 and res.ratio("numpy") is None


def test_skip_and_build_errors_become_reasons(ctx):
    def skip(c):
        raise Skip("needs a GPU")

    def broken(c):
        raise ValueError("bad size")

    assert run_case(Case("s", "t", skip), ctx, FAST).skipped == "needs a GPU"
    assert "ValueError: bad size" in run_case(Case("b", "t", broken), ctx, FAST).skipped


def test_short_calls_are_batched_and_input_sets_rotate():
    seen = []
    impl = Impl(lambda i: seen.append(i), [(0,), (1,), (2,)])
    timings, errors = runner.time_impls({"x": impl}, {"x": lambda: None},
                                 Settings(repeat=4, min_sample_s=1e-3))
    assert errors == {}
    assert len(timings["x"].samples) == 4 and timings["x"].inner > 1
    assert set(seen) == {0, 1, 2}


def test_frameworks_take_turns_at_sampling_first():
    """Every framework samples first in as many rounds as the others (a round's first
    sample follows the host's pause and may run at a higher clock), and one that raises
    drops out without upsetting the others' turns."""
    calls = []

    def impl(name):
        def call(i):
            calls.append(name)
            if name == "c" and calls.count("c") > 2:  # after its two warm-up calls
                raise RuntimeError("c fails when sampled")
        return Impl(call, [(0,)])

    timings, errors = runner.time_impls({n: impl(n) for n in "abc"},
                                        {n: lambda: None for n in "abc"},
                                        Settings(repeat=7, min_sample_s=0.0))
    assert set(timings) == {"a", "b"} and "c fails" in errors["c"]
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]  # warm-ups: one sample a call after
    rounds = [calls[6:9]] + [calls[9 + 2 * r:11 + 2 * r] for r in range(6)]
    assert rounds[0] == ["a", "b", "c"]
    assert rounds[1:] == [["b", "a"], ["a", "b"]] * 3
    assert len(timings["a"].samples) == len(timings["b"].samples) == 7


def test_input_sets_rotate_only_when_small(ctx):
    small = ctx.input_sets(lambda rng: (rng.standard_normal(16, dtype=np.float32),))
    assert len(small) == runner.MAX_INPUT_SETS
    assert not np.array_equal(small[0][0], small[1][0]), "each set must hold new random data"
    big = ctx.input_sets(lambda rng: (np.empty(runner.ROTATE_BELOW_BYTES // 4, np.float32),))
    assert len(big) == 1


def test_normwise_error():
    e = np.array([1.0, -4.0, np.inf])
    assert runner.normwise_error(e, e) == 0.0
    assert runner.normwise_error(np.array([1.0, -4.2, np.inf]), e) == pytest.approx(0.05)
    assert runner.normwise_error(np.array([1.0, -4.0, np.nan]), e) == math.inf
    assert runner.normwise_error(np.array([np.nan, -4.0, np.inf]), e) == math.inf
    assert runner.normwise_error(np.array([np.nan, 2.0]), np.array([np.nan, 2.0])) == 0.0
    assert runner.normwise_error(e[:2], e) == math.inf


def test_serving_benchmark_runs_quick_on_cpu(tmp_path, capsys):
    """``python -m benchmarks.serving --quick``: every stream decodes through the timed
    steps (none finishes early), the table and the JSON hold every case."""
    from benchmarks import serving

    out = tmp_path / "serving.json"
    assert serving.main(["--device", "cpu", "--quick", "--warmup", "1", "--tokens", "3",
                         "--streams", "1,3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [d["streams"] for d in result["decode"]] == [1, 3]
    assert all(d["tokens_per_s"] > 0 and d["itl_p50_ms"] > 0 for d in result["decode"])
    assert result["ttft_under_load"]["background_streams"] == 32
    assert result["ttft_under_load"]["ttft_ms"] > 0
    on, off = result["follow_up"]
    assert on["cache"] and not off["cache"] and on["prompt_tokens"] == 2000 + 64 + 32
    assert on["cached_tokens"] >= 2048 and off["cached_tokens"] == 0
    assert on["ttft_ms"] > 0 and off["ttft_ms"] > 0
    assert "x single" in capsys.readouterr().out
    assert serving.main(["--device", "cpu", "--size", "tiny", "--no-ttft", "--warmup", "1",
                         "--tokens", "2", "--streams", "2", "--json", str(out),
                         "--temperature", "0.8", "--top-p", "0.9"]) == 0
    result = json.loads(out.read_text())
    assert "ttft_alone" not in result
    assert result["sampling"] == "temperature 0.8, top-p 0.9"
    assert result["decode"][0]["tokens_per_s"] > 0


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_gemma_benchmark_runs_quick_on_cpu(capsys, family):
    """``python -m benchmarks.gemma3 --quick [--family gemma2]``: a tiny Gemma 3 (or soft-capped
    Gemma 2) written by transformers, needle against it on the same weights (logits agree),
    the limit and the serving rates printed."""
    from benchmarks import gemma3  # transformers: the dev install's (README)

    gemma3.main(["--device", "cpu", "--quick", "--prompts", "12,40", "--tokens", "8",
                 "--family", family])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("12", "40")]
    assert [r[0] for r in rows] == ["12", "40"]
    assert all(float(r[4]) < 1e-4 for r in rows)  # float32: needle's logits are transformers'
    assert "limit" in out and out.count("streams:") == 3
    assert "serving: 64 of 64 greedy tokens as generate's" in out  # float32: all of them


def test_host_choice_benchmark_runs_quick_on_cpu(capsys):
    """``python -m benchmarks.host_choice --quick``: the three ways of choosing, at each
    stream count, timed."""
    from benchmarks import host_choice

    host_choice.main(["--device", "cpu", "--quick"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.replace("(", " ").replace(")", " ").split() for line in lines
            if line.strip()[:2] in ("1 ", "8 ", "32")]
    assert [r[0] for r in rows] == ["1", "8", "32"]
    assert all(len(r) == 7 for r in rows)  # ms a step and steps timed, three cases a row
    assert all(float(ms) > 0 and 0 < int(steps) <= 64
               for r in rows for ms, steps in zip(r[1::2], r[2::2]))
