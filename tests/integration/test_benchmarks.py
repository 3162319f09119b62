"""The benchmark suite's verdict logic (benchmarks/suite.py, benchmarks/suite_tables.py): exponents, met / not met / not measured,
merging of separately run parts — pure functions on results dicts —, and its steps on a tiny model (what each one
computes, never how long it takes)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "suite.py"
_spec = importlib.util.spec_from_file_location("posgen_benchmark_suite", _PATH)
suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite)
import suite_tables as tables  # noqa: E402  (on sys.path once the suite is loaded: its targets and tables)
import tiny_models as tm  # noqa: E402  (tests/ is on sys.path: tests/conftest.py)


def _bench(name: str):
    """A fresh copy of the module ``benchmarks/<name>.py``."""
    spec = importlib.util.spec_from_file_location(f"posgen_bench_{name}", _PATH.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _timing(medians: dict[str, float], forwards: dict[str, int] | None = None) -> dict:
    forwards = forwards or {}
    steps = {"forward": 1.0, **medians}
    return {
        "n_ref": 4,
        "seconds": {s: [10.0 * m * forwards.get(s, 1)] * 3 for s, m in steps.items()},
        "ratios": {s: {"median": m, "min": m, "forwards": forwards.get(s, 1)} for s, m in steps.items()},
    }


def _series(mem: list[float], xs=(4, 8, 16, 32)) -> dict:
    pts = [{"n_seq": x, "seq_len": 512, "min_s": float(x), "peak_delta_mib": m} for x, m in zip(xs, mem)]
    return {"points": pts, "time_exponent": tables.fit_exponent(list(xs), [float(x) for x in xs]),
            "memory_exponent": tables.fit_exponent(list(xs), mem)}


def _result(commit: str, sizes: dict, scaling: dict) -> dict:
    return {"commit": commit, "started": "t0", "finished": "t1", "machine": {}, "config": {},
            "models": {"m": {"sizes": sizes, "scaling": scaling}}}


def test_fit_exponent_recovers_a_power_law_and_refuses_too_few_points():
    xs = [256, 512, 1024, 2048]
    assert tables.fit_exponent(xs, [3.0 * x**1.7 for x in xs]) == pytest.approx(1.7, abs=1e-9)
    assert tables.fit_exponent(xs, [5.0] * 4) == pytest.approx(0.0, abs=1e-12)
    assert tables.fit_exponent(xs, [1.0, None, float("nan"), 0.0]) is None  # one usable point
    assert tables.fit_exponent(xs, [1.0, None, 4.0, None]) == pytest.approx(math.log(4) / math.log(4))


def test_evaluate_says_met_not_met_and_not_measured():
    timing = _timing({"decomposition": 1.25, "pattern": 1.05, "kbar_pass": 0.2, "causal_condition": 1.0,
                      "sufficiency": 1.2}, forwards={"causal_condition": 3})
    memory = {"forward": {"peak_delta_mib": 600.0}, "capture": {"peak_delta_mib": 100.0},
              "decomposition": {"peak_delta_mib": 1700.0}}
    res = _result("abc", {"8x512": {"timing": timing, "memory": memory}},
                  {"count": {"pattern": _series([500, 505, 498, 502]), "decomposition": _series([600, 700, 900, 1300])}})
    rows = {(r["size"], r["target"].split(" (")[0]): r for r in tables.evaluate(res)}
    assert rows[("8x512", "decomposition ≤ 1.3× forward")]["met"] is True
    assert rows[("8x512", "pattern ≤ 1.0× forward")]["met"] is False
    assert rows[("8x512", "causal_condition ≤ 1.1× the forwards it needs")]["met"] is True
    assert rows[("8x512", "sufficiency ≤ 1.1× forward")]["met"] is False
    tol = rows[("8x512", "tolerance_curve ≤ 1.1× forward")]
    assert tol["met"] is None and tol["value"] is None and tol["note"] == "not measured"
    both = rows[("8x512", "decomposition + its k̄ reference pass ≤ 1.3× forward")]
    assert both["value"] == pytest.approx(1.45) and both["met"] is False
    assert rows[("8x512", "peak memory of capture ≤ forward + 1 GiB")]["met"] is True
    dec_mem = rows[("8x512", "peak memory of decomposition ≤ forward + 1 GiB")]
    assert dec_mem["met"] is False and dec_mem["limit"] == 600.0 + 1024.0
    assert rows[("8x512", "peak memory of pattern ≤ forward + 1 GiB")]["met"] is None  # not measured
    assert rows[("vs n_seq", "pattern memory independent of n_seq")]["met"] is True
    dec = rows[("vs n_seq", "decomposition memory independent of n_seq")]
    assert dec["met"] is False and dec["value"] > 0.3


def test_cost_over_the_capture_pass_divides_by_the_forwards_a_step_needs():
    t = _timing({"capture": 0.5, "decomposition": 1.25, "causal_condition": 1.0}, forwards={"causal_condition": 3})
    assert tables.over_capture(t, "decomposition") == pytest.approx(2.5)  # 12.5 s over 5 s
    assert tables.over_capture(t, "causal_condition") == pytest.approx(2.0)  # 30 s over 3 × 5 s
    assert tables.over_capture(_timing({"decomposition": 1.25}), "decomposition") is None  # no capture measured
    md = tables.markdown(_result("c", {"8x512": {"timing": t, "memory": {}}}, {}))
    assert "| median ÷ capture |" in md and "| decomposition | 1.250 | 1.250 | 1.250 | 2.500 |" in md


def test_merge_replaces_only_what_a_later_part_measured():
    a = _result("aaa", {"8x512": {"timing": _timing({"decomposition": 1.7}), "memory": {}},
                        "4x2048": {"timing": _timing({"decomposition": 2.4}), "memory": {}}},
                {"length": {"forward": _series([1, 2, 4, 8])}, "count": {"forward": _series([9, 9, 9, 9])}})
    b = _result("bbb", {"8x512": {"timing": _timing({"decomposition": 1.6}), "memory": {}}},
                {"count": {"forward": _series([5, 5, 5, 5])}})
    out = tables.merge_results([a, b])
    m = out["models"]["m"]
    assert list(m["sizes"]) == ["8x512", "4x2048"]  # the long size stays last (memory targets read it)
    assert m["sizes"]["8x512"]["timing"]["ratios"]["decomposition"]["median"] == 1.6
    assert m["sizes"]["4x2048"]["timing"]["ratios"]["decomposition"]["median"] == 2.4
    assert m["scaling"]["length"]["forward"]["points"][-1]["peak_delta_mib"] == 8  # kept from a
    assert m["scaling"]["count"]["forward"]["points"][0]["peak_delta_mib"] == 5  # replaced by b
    assert [p["commit"] for p in out["parts"]] == ["aaa", "bbb"]
    assert m["sizes"]["8x512"]["commit"] == "bbb" and m["sizes"]["4x2048"]["commit"] == "aaa"
    assert m["scaling_commit"] == {"length": "aaa", "count": "bbb"}
    md = tables.markdown(out)
    assert "**m, 4 × 2048 tokens** (commit aaa;" in md and "**m, 8 × 512 tokens** (commit bbb;" in md
    assert "scaling vs number of sequences** (commit bbb)" in md
    assert out["parts"][1]["measured"] == {"m": {"sizes": ["8x512"], "scaling": ["count"]}}
    assert a["models"]["m"]["sizes"]["8x512"]["timing"]["ratios"]["decomposition"]["median"] == 1.7  # input intact


@pytest.mark.parametrize("argv, msg", [
    (["--parts", "scaling", "--axes", "time"], "--axes"),
    (["--sizes", "8by512"], "--sizes"),
    (["--counts", "4,0"], "--counts"),
])
def test_bad_arguments_name_the_problem(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        suite.main(argv)
    assert msg in str(e.value)


@pytest.mark.parametrize("argv, msg", [(["--runs", "rot_q_stacked,rot_k"], "unknown --runs ['rot_k']"),
                                       (["--repeats", "0"], "--repeats 0: at least 1")])
def test_the_patching_benchmark_names_a_bad_argument_before_loading_a_model(argv, msg):
    spec = importlib.util.spec_from_file_location("posgen_bench_patching", _PATH.parent / "bench_patching.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as e:
        bench.main([*argv, "--model", "no-such-model"])  # a model name that would fail if it were loaded first
    assert msg in str(e.value)


def test_every_step_of_the_suite_runs_and_the_naive_route_computes_the_same_tables():
    """Each timed step runs on today's code (a step that breaks after a refactor made whole timing runs fail silently
    into "not measured"), and the naive run_with_cache route the streaming analyses are compared with computes the
    SAME decomposition and feature statistics — the comparison is between two ways of one computation."""
    import pandas as pd
    from suite_steps import Bench

    b = Bench(tm.hf_llama()[0], 2, 96, batch_size=1)
    out = {name: fn() for name, (fn, _) in b.steps().items()}
    assert set(out) == {"forward", "capture", "kbar_pass", "decomposition", "pattern", "tolerance_curve",
                        "causal_condition", "target_nll", "naive_decomposition", "naive_pattern", "sufficiency"}
    streamed, naive = out["decomposition"], out["naive_decomposition"]
    assert len(streamed) and set(streamed["seq"]) == {0, 1}
    pd.testing.assert_frame_equal(streamed, naive, check_exact=False, rtol=1e-4, atol=1e-6)
    for name in ("bands", "heads"):
        pd.testing.assert_frame_equal(getattr(out["pattern"], name), getattr(out["naive_pattern"], name),
                                      check_exact=False, rtol=1e-4, atol=1e-6)


def test_stage_forward_counter_counts_tokens_through_the_layers_a_pass_computes():
    """bench_stages' forward accounting: a whole forward counts batch × positions × layers, a forward resumed at block
    L (its lower blocks skipped) the layers from L on, each model apart; its hooks are gone after the block, also when
    the block raises — a count that included skipped blocks or leaked into later stages would misstate the report."""
    import torch

    from posgen_tl.hooks.reentry import forward_from, recorded, resid_hooks, skips_blocks

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stages.py"
    spec = importlib.util.spec_from_file_location("posgen_bench_stages", bench)
    stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages)
    a, b = tm.hf_llama(n_layers=4)[0], tm.hf_llama(n_layers=4, seed=1)[0]
    toks = torch.randint(1, 99, (3, 10), generator=torch.Generator().manual_seed(0))
    assert skips_blocks(a)
    store: dict = {}
    with torch.no_grad(), a.hooks(fwd_hooks=resid_hooks([3], store)):
        a(toks)
    resid = recorded(store)[3]
    with torch.no_grad(), stages.LayerTokens({"trained": a, "twin": b}) as c:
        a(toks)
        assert c.counts == {"trained": 3 * 10 * 4, "twin": 0}
        forward_from(a, resid, 3, tokens=toks)
        assert c.counts == {"trained": 3 * 10 * 4 + 3 * 10 * 1, "twin": 0}
        b(toks[:2, :5])
        assert c.counts == {"trained": 150, "twin": 2 * 5 * 4}
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), stages.LayerTokens({"trained": a}) as c2:
        a(toks)
        raise RuntimeError("boom")
    assert c2.counts == {"trained": 120}
    with torch.no_grad():
        a(toks)  # no counter left attached: nothing counts any more
    assert c.counts["trained"] == 150 and c2.counts["trained"] == 120
    assert all(not blk.mlp._forward_pre_hooks for m in (a, b) for blk in m.blocks)


def test_layer_tokens_by_site_names_where_each_forward_came_from():
    """``bench_stages --forwards --by-site`` splits the count by the package function that asked for each forward (the
    code that only runs a forward passed over) and marks resumed ones: the parts add up to the count, a pass of
    :func:`key_means` is named ``edits.feature_means``, a resumed forward is marked, one from outside the package says so."""
    import torch

    from posgen_tl.hooks.edits import key_means
    from posgen_tl.hooks.reentry import forward_from, recorded, resid_hooks, skips_blocks

    stages = _bench("bench_stages")
    a = tm.hf_llama(n_layers=4)[0]
    toks = torch.randint(1, 99, (3, 10), generator=torch.Generator().manual_seed(0))
    key_means(a, toks[:1])  # the model's exactness gate runs its own probe forwards now, not inside the count below
    assert skips_blocks(a)
    with stages.LayerTokens({"trained": a}) as alone, torch.no_grad():
        key_means(a, toks, batch_size=3)
    means_work = alone.counts["trained"]  # what a pass of key_means computes (it may stop before the last MLP)
    assert means_work > 0
    store: dict = {}
    with torch.no_grad(), a.hooks(fwd_hooks=resid_hooks([3], store)):
        a(toks)
    resid = recorded(store)[3]
    with torch.no_grad(), stages.LayerTokens({"trained": a}, by_site=True) as c:
        a(toks)
        forward_from(a, resid, 3, tokens=toks)
        key_means(a, toks, batch_size=3)
    assert c.sites == {("trained", "(outside posgen_tl)", False): 3 * 10 * 4,
                       ("trained", "(outside posgen_tl)", True): 3 * 10 * 1,
                       ("trained", "edits.feature_means", False): means_work}
    assert sum(c.sites.values()) == c.counts["trained"]
    assert alone.sites == {}  # without by_site nothing is split


def test_gpu_paths_make_the_package_choose_as_on_a_gpu():
    """``profile_syncs --gpu-paths`` counts a GPU's operations on the CPU only if the package then CHOOSES as on a GPU:
    stacks of layers by stack_size's own GPU rule (min(STACK_ENTRIES, free / 128) float32 entries, wherever it is
    imported: one rule, not a copy that could drift), the fits batched by fit_batch's free-memory rule, the moments'
    route and the bound's rows as for a cuda device. In a fresh process: the tool changes the package for the rest of
    it."""
    import json
    import subprocess
    import sys
    import textwrap

    tests, bench = Path(__file__).resolve().parents[1], _PATH.parent
    code = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(bench)!r}, {str(tests)!r}]
        import torch
        import profile_syncs, tiny_models as tm
        import posgen_tl.engine.decompose_scores as D, posgen_tl.experiments.pattern as P
        import posgen_tl.hooks.stacking as S, posgen_tl.hooks.stream as T
        model, cpu, gpu = tm.native(n_layers=2), torch.device("cpu"), torch.device("cuda")
        before = dict(stack=S.stack_size(model, 512 * 512, 30), fits=D.fit_batch(cpu),
                      factored=[D.use_factored(cpu, n) for n in (512, 2048, 8192)])
        real_factored = [D.use_factored(gpu, n) for n in (512, 2048, 8192)]
        profile_syncs.take_gpu_paths({{gib}})
        print(json.dumps(dict(before=before, stacks=[f(model, 512 * 512, 30) for f in (S.stack_size, D.stack_size,
                              P.stack_size, T.stack_size)], fits=D.fit_batch(cpu), FIT_BATCH=D.FIT_BATCH,
                              FIT_BYTES=D.FIT_BYTES, STACK_ENTRIES=S.STACK_ENTRIES, heads=4,
                              factored=[D.use_factored(cpu, n) for n in (512, 2048, 8192)], real=real_factored)))
    """)
    for gib in (1, 139):
        run = subprocess.run([sys.executable, "-c", code.replace("{gib}", str(gib))], capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        free = gib * 2**30
        assert got["before"]["stack"] == 1 and got["before"]["fits"] == got["FIT_BATCH"]  # the CPU's own choices first
        per_layer = got["heads"] * 512 * 512
        want = max(1, min(30, min(got["STACK_ENTRIES"], free // (4 * 32)) // per_layer))
        assert want == (8 if gib == 1 else 30)  # the two budgets bind differently: 1 GiB free stacks 8 layers of 30
        assert got["stacks"] == [want] * 4
        assert got["fits"] == max(got["FIT_BATCH"], free // (32 * got["FIT_BYTES"]))
        assert got["factored"] == got["real"]


def test_report_repeats_counts_a_row_run_again_only_when_nothing_but_its_final_residual_is_read():
    """``report_repeats.repeats`` counts a row of a plain forward as repeated when an earlier plain or recording
    forward of the same model ran the same input at the same ids and start layer — per (first stage, repeating stage),
    its seconds split over the forward's rows —, a repeated recording forward apart, and never a hooked forward, another
    model's, other ids or another start layer."""
    rr = _bench("report_repeats")
    assert rr.kind_of([]) == rr.kind_of(["ln_final.hook_out"]) == "plain"
    assert rr.kind_of(["blocks.3.hook_resid_pre", "ln_final.hook_out"]) == "recording"
    assert rr.kind_of(["blocks.3.hook_resid_pre", "blocks.5.attn.hook_k"]) == "hooked"
    assert rr.kind_of(["blocks.3.attn.hook_in"]) == rr.kind_of(["blocks.3.mlp.hook_in"]) == "hooked"  # not a block's input

    def rec(stage, rows, hooks=(), pos=None, start=0, model="trained", seconds=4.0):
        return {"stage": stage, "model": model, "rows": list(rows), "pos": list(pos or [None] * len(rows)),
                "start": start, "hooks": list(hooks), "seconds": seconds}

    out = rr.repeats([
        rec("tolerance", "abcd", ["ln_final.hook_out"]),           # 1 s a row
        rec("causal", "ab", ["blocks.10.hook_resid_pre"]),         # recording: a and b were run: 2 repeated rows
        rec("sufficiency", "abxy", ["ln_final.hook_out"]),        # a, b repeat tolerance's; x, y are new
        rec("patching", "ab", ["blocks.0.attn.hook_q"]),           # hooked: never a repeat
        rec("patching", "ab", pos=["p", "p"]),                     # other ids: new rows
        rec("patching", "ab", start=10),                           # a resumed forward from another input: new rows
        rec("length", "ab", model="twin"),                          # the other model: new rows
        rec("length", "xy", ["ln_final.hook_out"], seconds=6.0),   # repeats sufficiency's x, y: 3 s a row
    ])
    pairs = {(p["first"], p["then"], p["kind"]): (p["rows"], p["seconds"]) for p in out["pairs"]}
    assert pairs == {("tolerance", "causal", "recording"): (2, 4.0), ("tolerance", "sufficiency", "plain"): (2, 2.0),
                     ("sufficiency", "length", "plain"): (2, 6.0)}
    assert out["forward_seconds"] == 34.0 and out["by_kind"] == {"plain": 26.0, "recording": 4.0, "hooked": 4.0}
    assert out["repeated_plain_seconds"] == 8.0 and out["repeated_recording_seconds"] == 4.0
    assert out["repeated_plain_share"] == 8.0 / 34.0
    assert [p["seconds"] for p in out["pairs"]] == [6.0, 4.0, 2.0]


def test_report_repeats_logs_each_forward_row_by_row_and_puts_the_forward_back():
    """``ForwardLog`` on a tiny bridge: two target-NLL passes of the same windows in two stages (the second with the ids
    ``0 … n−1`` given explicitly) are one plain forward repeated row by row; a pass under an edit hook is hooked; a
    pass at other ids is new; the class's own ``forward`` is back afterwards (also after an exception)."""
    import torch

    from posgen_tl.engine.swaps import nll_on_target

    rr = _bench("report_repeats")
    a = tm.hf_llama(n_layers=2)[0]
    toks = torch.randint(1, 99, (3, 12), generator=torch.Generator().manual_seed(0))
    nll_on_target(a, toks[:1], target_len=4)  # the model's gate runs its own probe forwards, outside the log
    own = type(a).forward
    with rr.ForwardLog({"trained": a}) as log:
        log.stage = "one"
        first = nll_on_target(a, toks, target_len=4, batch_size=2)
        log.stage = "two"
        again = nll_on_target(a, toks, target_len=4, position_ids=torch.arange(12), batch_size=3)
        nll_on_target(a, toks, target_len=4, position_ids=torch.arange(12).flip(0))

        def nudge(x, hook):
            return x * 1.01

        nll_on_target(a, toks, target_len=4, fwd_hooks=[("blocks.1.attn.hook_k", nudge)])
    assert type(a).forward is own
    torch.testing.assert_close(first, again, rtol=1e-6, atol=1e-6)
    assert [(r["stage"], len(r["rows"]), rr.kind_of(r["hooks"])) for r in log.records] == [
        ("one", 2, "plain"), ("one", 1, "plain"), ("two", 3, "plain"), ("two", 3, "plain"), ("two", 3, "hooked")]
    assert all(r["stopped"] for r in log.records[:4])  # the final-residual read ends each pass early
    out = rr.repeats(log.records)
    assert [(p["first"], p["then"], p["kind"], p["rows"]) for p in out["pairs"]] == [("one", "two", "plain", 3)]
    assert out["repeated_plain_seconds"] == pytest.approx(log.records[2]["seconds"])
    with pytest.raises(RuntimeError, match="inside"), rr.ForwardLog({"trained": a}):
        raise RuntimeError("inside")
    assert type(a).forward is own


def test_report_repeats_refuses_a_model_that_resumes_by_writing_the_residual(monkeypatch):
    """A TransformerLens 3.x bridge takes no ``start_at_layer``: it resumes a forward by writing the residual into a whole
    forward of the tokens, which the log would count as that whole forward (and a later pass of the same tokens as its
    repeat). ``ForwardLog`` refuses such a model, naming why, and wraps nothing."""
    import posgen_tl.hooks.reentry as reentry

    rr = _bench("report_repeats")
    a = tm.hf_llama(n_layers=2)[0]
    own = type(a).forward
    monkeypatch.setattr(reentry, "takes_start_at_layer", lambda model: False)
    with pytest.raises(ValueError, match="start_at_layer"), rr.ForwardLog({"trained": a}):
        pass
    assert type(a).forward is own
    b = tm.hf_llama(n_layers=2)[0]  # the same class: refusing the second model must leave the first unwrapped too
    monkeypatch.setattr(reentry, "takes_start_at_layer", lambda model: model is a)
    with pytest.raises(ValueError, match="start_at_layer"), rr.ForwardLog({"trained": a, "twin": b}):
        pass
    assert type(a).forward is own
    with rr.ForwardLog({"trained": a}) as log, pytest.raises(ValueError, match="start_at_layer"):
        log.add("twin", b)
    assert id(b) not in log.labels and type(a).forward is own


def test_bench_causal_compares_every_row_and_fails_on_nan():
    """bench_causal.py's check of its rows: the largest |Δ NLL| of the same rows; NaN — which fails its ``<= 1e-4``
    check — where a row holds a NaN or the tables hold other rows."""
    import numpy as np
    import pandas as pd

    spec = importlib.util.spec_from_file_location("posgen_bench_causal", _PATH.parent / "bench_causal.py")
    bc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bc)
    a = pd.DataFrame(dict(seq=[0, 1], layers=["m", "m"], condition=["destroy"] * 2, alpha=[1.0, 1.0], frac=[0.0, 0.0],
                          seed=[0, 0], nll=[1.0, 2.0]))
    assert bc.nll_difference(a, a) == 0.0
    assert bc.nll_difference(a, a.assign(nll=[1.0, 2.5])) == 0.5
    assert np.isnan(bc.nll_difference(a, a.assign(nll=[1.0, np.nan])))
    assert np.isnan(bc.nll_difference(a, a.iloc[:1]))
    assert np.isnan(bc.nll_difference(a, a.assign(alpha=[1.0, 2.0])))
