"""The performance page's targets table (benchmarks/targets.py): current with the committed result files, and its
verdicts computed from the numbers — a number over its limit reads "not met", a missing file gives no number."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("posgen_benchmark_targets", ROOT / "benchmarks" / "targets.py")
targets = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = targets  # its dataclasses look their module up there
_spec.loader.exec_module(targets)


def test_the_page_holds_the_table_the_committed_files_give():
    page = targets.PAGE.read_text()
    assert page.count(targets.BEGIN) == 1 and page.count(targets.END) == 1
    assert targets.rewrite(page, targets.block()) == page, "run python benchmarks/targets.py"
    assert targets.main(["--check"]) == 0
    for row in targets.ROWS:  # every row points at a file that is there
        assert (targets.RESULTS / row.file).exists(), row.file


def _steps(tmp_path: Path, name: str, ratio: float) -> str:
    fwd = {"seconds": [10.0, 11.0, 12.0], "ratio_median": 1.0, "ratio_min": 1.0}
    step = {"seconds": [x * ratio for x in fwd["seconds"]], "ratio_median": ratio, "ratio_min": ratio - 0.05}
    d = {"repeats": 3, "commit": "abc1234", "steps": {"forward": fwd, "pattern": step}}
    (tmp_path / name).write_text(json.dumps(d))
    return name


def test_verdicts_follow_the_numbers_and_a_missing_file_gives_no_number(tmp_path):
    rows = [targets.Row("feature statistics", "8 × 512", "CPU", 1.0, "×", _steps(tmp_path, "a.json", 0.97),
                        targets.steps_ratio("pattern", "old")),
            targets.Row("feature statistics", "4 × 2048", "CPU", 1.0, "×", _steps(tmp_path, "b.json", 1.04),
                        targets.steps_ratio("pattern", "old")),
            targets.Row("decomposition", "8 × 512", "GPU", 2.0, "×", "absent.json",
                        targets.suite_ratio("m", "8x512", "decomposition"))]
    lines = targets.table(rows, tmp_path).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][3:6] == ["**0.97×** (0.92×)", "≤ 1.00×", "met"]
    assert cells[1][3:6] == ["**1.04×** (0.99×)", "≤ 1.00×", "not met"]  # the fastest repeat does not rescue it
    assert cells[0][6] == ("abc1234, `a.json`; 3 rounds, forward 10.00–12.00 s (median 11.00); median of the rounds' "
                           "own ratios 0.97×")  # the file's own commit wins
    assert cells[2][3] == "—" and cells[2][5] == "not measured" and "`absent.json` missing" in cells[2][6]


_bs_spec = importlib.util.spec_from_file_location("posgen_benchmark_bench_steps", ROOT / "benchmarks" / "bench_steps.py")
bench_steps = importlib.util.module_from_spec(_bs_spec)
_bs_spec.loader.exec_module(bench_steps)

_CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512vl

processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512vl
"""


def test_a_steps_file_records_its_host_and_the_table_names_it(tmp_path):
    h = bench_steps.host(_CPUINFO)
    assert h["cpu"] == "AMD EPYC 9R14" and h["isa"] == ["avx2", "avx512f", "avx512_bf16"]  # amx_tile absent
    assert bench_steps.host("")["isa"] == [] and h["platform"] and h["cpus"] >= 1
    d = json.loads((tmp_path / _steps(tmp_path, "h.json", 1.1)).read_text())
    d["host"] = h
    (tmp_path / "h.json").write_text(json.dumps(d))
    rows = [targets.Row("feature statistics", "8 × 512", "CPU", 1.0, "×", name,
                        targets.steps_ratio("pattern", "old", "a host named by the row"))
            for name in ("h.json", _steps(tmp_path, "old.json", 0.9))]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in targets.table(rows, tmp_path).splitlines()[2:]]
    assert cells[0][2] == "CPU: AMD EPYC 9R14" and cells[1][2] == "CPU: a host named by the row"
    assert cells[0][6].startswith("abc1234, `h.json`; host AMD EPYC 9R14 (avx2, avx512f, avx512_bf16); 3 rounds")
    assert cells[1][6].startswith("abc1234, `old.json`; host a host named by the row; 3 rounds")  # the file has none
    row = targets.Row("feature statistics", "8 × 512", "CPU", 1.0, "×", "old.json", targets.steps_ratio("pattern", "x"))
    assert targets.table([row], tmp_path).splitlines()[2].split("|")[3].strip() == "CPU"  # no host known: none named


def test_a_report_wall_time_says_how_fast_its_host_was(tmp_path):
    d = {"commit": "def5678abcdef", "wall_s": 516.0, "forward_8x512_s": 12.71}
    (tmp_path / "r.json").write_text(json.dumps(d))
    row = targets.Row("the default report", "12 × 128", "CPU", 300.0, "s", "r.json", targets.report_wall)
    cells = [c.strip() for c in targets.table([row], tmp_path).splitlines()[2].strip("|").split("|")]
    assert cells[3:6] == ["**8 min 36 s**", "≤ 5 min 00 s", "not met"]  # measured here: the scaled estimate is a note
    assert cells[6] == ("def5678, `r.json`; this host ran the forward of 8 × 512 tokens in 12.71 s (median), 1.81× the "
                        "7.01 s of the machine the target was set on: scaled by that, ≈ 4.7 min (an estimate, not a "
                        "measurement)")


def test_times_round_to_the_second_across_a_minute():
    assert targets._num(299.6, "s") == "5 min 00 s" and targets._num(59.4, "s") == "0 min 59 s"
    assert targets._num(59.6, "s") == "1 min 00 s"


def test_a_commit_is_shortened_but_an_uncommitted_run_stays_marked():
    assert targets.short("54c3e842176223490e021cf8f03e4d0a4b4b5248") == "54c3e84"
    assert targets.short("54c3e842176223490e021cf8 (uncommitted changes)") == "54c3e84 (uncommitted changes)"
    assert targets.short("5a0bb2b (package code)") == "5a0bb2b"


def test_rewrite_needs_both_markers_once():
    with pytest.raises(ValueError, match="markers must each appear once"):
        targets.rewrite("no markers here", targets.block())
    page = f"head\n{targets.BEGIN}\nold\n{targets.END}\ntail\n"
    assert targets.rewrite(page, "NEW") == "head\nNEW\ntail\n"


def test_a_gpu_row_brackets_the_fastest_repeat_over_the_fastest_forward(tmp_path):
    secs = {"forward": [0.10, 0.12, 0.20], "decomposition": [0.21, 0.30, 0.25]}
    timing = {"seconds": secs, "ratios": {"decomposition": {"median": 1.75, "min": 1.25}}, "gpu": "Some GPU"}
    d = {"commit": "0123456 (package code)", "config": {"repeats": 3, "device": "cuda"},
         "models": {"m": {"sizes": {"8x512": {"timing": timing}}}}}
    (tmp_path / "g.json").write_text(json.dumps(d))
    row = targets.Row("decomposition", "8 × 512", "GPU", 2.0, "×", "g.json", targets.suite_ratio("m", "8x512",
                                                                                                   "decomposition"))
    cells = [c.strip() for c in targets.table([row], tmp_path).splitlines()[2].strip("|").split("|")]
    # the suite's median of per-repeat ratios; in brackets 0.21 / 0.10, not the smallest per-repeat ratio (1.25)
    assert cells[3:6] == ["**1.75×** (2.10×)", "≤ 2.00×", "met"]
    assert cells[6] == "0123456, `g.json`; 3 repeats, forward 0.120 s, Some GPU"


def test_a_report_of_several_runs_reads_their_median_and_shows_the_fastest_and_the_range(tmp_path):
    runs = [{"wall_s": w, "forward_8x512_s": 8.5} for w in (294.4, 310.2, 298.1)]
    d = {"commit": "0123456789ab", "wall_s": 298.1, "forward_8x512_s": 8.5, "runs": runs}
    (tmp_path / "r.json").write_text(json.dumps(d))
    row = targets.Row("the default report", "its defaults", "CPU", 300.0, "s", "r.json", targets.report_wall)
    cells = [c.strip() for c in targets.table([row], tmp_path).splitlines()[2].strip("|").split("|")]
    assert cells[3:6] == ["**4 min 58 s** (4 min 54 s)", "≤ 5 min 00 s", "met"]  # the median, not the fastest
    assert cells[6].startswith("0123456, `r.json`; 3 runs, each in a fresh process: 4 min 54 s – 5 min 10 s; this host "
                               "ran the forward of 8 × 512 tokens in 8.50 s (median), 1.21× the 7.01 s")
    d["wall_s"] = 310.2  # a median over the limit is not met, whatever the fastest run did
    (tmp_path / "r.json").write_text(json.dumps(d))
    cells = [c.strip() for c in targets.table([row], tmp_path).splitlines()[2].strip("|").split("|")]
    assert cells[3:6] == ["**5 min 10 s** (4 min 54 s)", "≤ 5 min 00 s", "not met"]


def test_bracketed_ratios_divide_each_step_by_the_mean_of_its_two_forwards():
    # a host that slows down within the round: the step's neighbours slow with it
    assert bench_steps.bracket_ratios([12.0, 15.0], [10.0, 10.0], [10.0, 20.0]) == [1.2, 1.0]
    with pytest.raises(ValueError, match="one each per round"):
        bench_steps.bracket_ratios([12.0], [10.0, 11.0], [10.0])
    with pytest.raises(ValueError, match="zero seconds"):
        bench_steps.bracket_ratios([12.0], [0.0], [10.0])


def test_a_bracketed_file_is_judged_by_its_bracketed_ratios(tmp_path):
    fwd = [10.0, 12.0, 10.0, 20.0]  # round 0: forward, step, forward; round 1: forward, step, forward
    step = {"seconds": [13.2, 16.5], "ratio_median": 14.85 / 11.0, "ratio_min": 1.32,
            "bracket": {"before": [10.0, 10.0], "after": [12.0, 20.0], "ratios": [1.2, 1.1], "ratio_median": 1.15}}
    d = {"repeats": 2, "commit": "abc1234", "bracketed": True,
         "steps": {"forward": {"seconds": fwd, "ratio_median": 1.0, "ratio_min": 1.0}, "decomposition": step}}
    (tmp_path / "b.json").write_text(json.dumps(d))
    row = targets.Row("decomposition", "8 × 512", "CPU", 1.3, "×", "b.json", targets.steps_ratio("decomposition", "x"))
    cells = [c.strip() for c in targets.table([row], tmp_path).splitlines()[2].strip("|").split("|")]
    # the step's median over the forwards' median (1.35×) would say "not met"; its two neighbours say 1.15×
    assert cells[3:6] == ["**1.15×** (1.32×)", "≤ 1.30×", "met"]
    assert cells[6] == ("abc1234, `b.json`; 2 rounds, each step between two forwards, forward 10.00–20.00 s (median "
                        "11.00); median of each step over the mean of its two forwards 1.15× (the median step over the "
                        "median forward 1.35×)")


def test_a_report_row_can_name_the_host_its_file_does_not_record(tmp_path):
    d = {"commit": "def5678abcdef", "wall_s": 388.0, "forward_8x512_s": 8.06}
    (tmp_path / "r.json").write_text(json.dumps(d))
    row = targets.Row("the default report", "its defaults", "CPU", 300.0, "s", "r.json",
                      targets.report_wall_on("Some Xeon", "AVX-512, no AMX"))
    cells = [c.strip() for c in targets.table([row], tmp_path).splitlines()[2].strip("|").split("|")]
    assert cells[2] == "CPU: Some Xeon" and cells[3:6] == ["**6 min 28 s**", "≤ 5 min 00 s", "not met"]
    assert cells[6].startswith("def5678, `r.json`; host Some Xeon (AVX-512, no AMX; named by the session); this host "
                               "ran the forward of 8 × 512 tokens in 8.06 s (median), 1.15× the 7.01 s")


def test_a_report_file_that_records_its_cpu_names_it(tmp_path):
    d = {"commit": "def5678abcdef", "wall_s": 257.0, "forward_8x512_s": 7.60,
         "machine": {"cpus": 2, "cpu": "AMD EPYC 9R14", "isa": ["avx2", "avx512f"]}}
    (tmp_path / "r.json").write_text(json.dumps(d))
    row = targets.Row("the default report", "its defaults", "CPU", 300.0, "s", "r.json", targets.report_wall)
    cells = [c.strip() for c in targets.table([row], tmp_path).splitlines()[2].strip("|").split("|")]
    assert cells[2] == "CPU: AMD EPYC 9R14" and cells[5] == "met"
    assert cells[6].startswith("def5678, `r.json`; host AMD EPYC 9R14 (avx2, avx512f); this host ran the forward")


_br_spec = importlib.util.spec_from_file_location("posgen_benchmark_bench_report", ROOT / "benchmarks" / "bench_report.py")
bench_report = importlib.util.module_from_spec(_br_spec)
_br_spec.loader.exec_module(bench_report)


def test_the_report_benchmark_finds_the_command_on_path_or_beside_its_python(tmp_path):
    assert bench_report.cli_path(which="/on/path/posgen-tl", python=str(tmp_path / "python")) == "/on/path/posgen-tl"
    assert bench_report.cli_path(which="", python=str(tmp_path / "python")) is None  # nowhere: None
    cli = tmp_path / "posgen-tl"
    cli.write_text("#!/bin/sh\n")
    assert bench_report.cli_path(which="", python=str(tmp_path / "python")) is None  # there, but not executable
    cli.chmod(0o755)
    assert bench_report.cli_path(which="", python=str(tmp_path / "python")) == str(cli)  # a virtualenv's bin/
