"""`posgen-tl report`: the quick run on the default model, interruption safety, resumption, rendering."""

from __future__ import annotations

import base64
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from posgen_tl.experiments import registry
from posgen_tl.report.run import ReportSettings, run_report

pytestmark = [pytest.mark.real]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory, smollm2):
    out = tmp_path_factory.mktemp("report") / "r"
    assert run_report(ReportSettings(out=str(out), preset="quick", sizes=dict(seq_len=64, n_seq=3))) == 0
    return out


def test_quick_report_writes_html_json_and_csvs(quick_report):
    out = quick_report
    html = (out / "report.html").read_text()
    res = json.loads((out / "results.json").read_text())
    assert set(res) >= {"exactness", "decomposition", "pattern", "tolerance", "causal", "taxonomy", "length",
                        "sufficiency", "configs", "stage_seconds"}
    assert res["exactness"]["passed"] is True
    assert res["decomposition"]["bound_holds_min"] == 1.0
    for est in ("D1", "D2", "D3"):
        assert {"r_trained", "r_random"} <= set(res["decomposition"][est])
    for name in ("exactness.csv", "decomposition.csv", "pattern_heads.csv", "tolerance_curves.csv", "causal_verdicts.csv", "heads.csv"):
        assert (out / name).stat().st_size > 100, name
    # self-contained: no external resources, every figure is an embedded PNG that decodes
    assert "http://" not in html and "https://" not in html and "<script" not in html
    imgs = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", html)
    assert len(imgs) >= 9  # 2 decomposition + 3 pattern + 1 tolerance + 3 heads
    for b64 in imgs:
        png = base64.b64decode(b64)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    # every section shows its random twin or control
    assert html.count("random") >= 10 and "control" in html


def test_report_leads_with_findings(quick_report):
    html = (quick_report / "report.html").read_text()
    res = json.loads((quick_report / "results.json").read_text())
    box = html.index("<div class='summary'")
    assert box < html.index("<h2 id='s0'>") and box < html.index("<ul>")  # before the contents and every section
    summary = html[box: html.index("</div>", box)]
    for q in ("decomposition", "sufficiency", "pattern", "tolerance", "causal", "taxonomy", "length"):
        assert f"<b>{q}</b>" in summary, q
    assert "not run" not in summary  # every question has a stage and a headline (length, sufficiency included)
    assert "exploratory" in summary  # 2 sequences < 32
    for name in ("decomposition", "causal", "taxonomy"):  # each section says how to run it at full size
        assert f"posgen-tl study {name} --model smollm2-135m --full --out results/{name}" in html, name
    qs = {f["question"] for f in res["findings"]}
    assert {"decomposition", "pattern", "tolerance", "causal", "taxonomy", "length", "sufficiency"} <= qs
    for q in ("length", "sufficiency"):
        f = next(f for f in res["findings"] if f["question"] == q)
        assert f["verdict"] != "not testable" and f["effect"] is not None and f["n"] == 3, f
    dec = next(f for f in res["findings"] if f["question"] == "decomposition")
    assert dec["n"] == 3 and dec["exploratory"] and dec["p"] is not None and len(dec["ci"]) == 2
    # exactness: a one-line PASS, its per-layer table folded
    ex = html[html.index("<h2 id='s0'>"): html.index("<h2 id='s1'>")]
    assert "PASS on all 30 layers" in ex and "<details><summary><b>Per layer</b>" in ex
    # numbers to 3 significant digits in every table cell (integers, e.g. layer and n, are exact)
    cells = re.findall(r"<td>(-?[0-9.]+(?:e[-+]?\d+)?)</td>", html)
    floats = [c for c in cells if "." in c or "e" in c]
    assert floats, "no numeric cells found"
    for c in floats:
        digits = c.lstrip("-").split("e")[0].replace(".", "").lstrip("0")
        assert len(digits) <= 3, c


def test_interrupted_report_leaves_no_complete_looking_files_and_resumes(tmp_path, monkeypatch, smollm2):
    out = tmp_path / "r"
    mods = {n: registry.experiment(n) for n in registry.REPORT}
    real = {n: m.run for n, m in mods.items()}  # what the report calls, through registry.run_or_skip
    calls = []

    def interrupt(model, cfg, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(mods["pattern"], "run", interrupt)
    settings = ReportSettings(out=str(out), preset="quick", sizes=dict(seq_len=64, n_seq=3))
    with pytest.raises(KeyboardInterrupt):
        run_report(settings)
    assert not (out / "report.html").exists() and not (out / "results.json").exists()
    done = sorted(p.name for p in (out / ".work").glob("*.done"))
    assert done == ["decomposition.done", "exactness.done"]
    # rerun: finished experiments are not recomputed
    def spy(n):
        @functools.wraps(real[n])  # the report reads run's signature (which inputs it takes): keep it visible
        def run(model, cfg, **kw):
            calls.append(n)
            return real[n](model, cfg, **kw)
        return run

    for n, m in mods.items():
        monkeypatch.setattr(m, "run", spy(n))
    assert run_report(settings) == 0
    assert calls == [n for n in registry.REPORT if n not in ("exactness", "decomposition")]  # every later one, once
    assert (out / "report.html").exists() and (out / "results.json").exists()
    # different arguments start afresh (the work folder is keyed by the configuration)
    calls.clear()
    assert run_report(ReportSettings(out=str(out), preset="quick", sizes=dict(seq_len=64, n_seq=3, seed=1))) == 0
    assert calls == list(registry.REPORT)  # a new configuration recomputes every experiment


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium not installed")
def test_report_renders_in_headless_chromium(quick_report, tmp_path):
    shot = tmp_path / "shot.png"
    r = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'prof'}", "--window-size=1200,4000", f"--screenshot={shot}",
         (quick_report / "report.html").resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr[-500:]
    import os

    from PIL import Image

    if os.environ.get("POSGEN_SHOT_DIR"):  # keep the screenshot to look at
        shutil.copyfile(shot, Path(os.environ["POSGEN_SHOT_DIR"]) / "report_screenshot.png")
    rgb = Image.open(shot).convert("RGB")
    # what a reader sees first: the findings box (its background #eef4fb) fills the top of the page
    top = rgb.crop((0, 0, 1200, 900))
    box_px = sum(1 for px in top.getdata() if px == (0xEE, 0xF4, 0xFB))
    assert box_px > 0.15 * 1200 * 900, box_px
    im = rgb.convert("L")
    assert im.size == (1200, 4000)
    # figures rendered: a good part of the page is neither white background nor text-grey
    hist = im.histogram()
    non_white = sum(hist[:250]) / sum(hist)
    assert non_white > 0.05
    from browser import layout, layout_problems

    m = layout(quick_report / "report.html", tmp_path, width=1280)  # no table cut off or wider than the page
    assert m["tables"] and not layout_problems(m), layout_problems(m)


def test_render_only_rewrites_the_page_from_the_saved_results(quick_report, tmp_path):
    """`posgen-tl report --render-only` rebuilds report.html from OUT's saved results without a model: the same
    findings box as the report the run wrote."""
    import re

    from posgen_tl.cli import main

    out = tmp_path / "r"
    shutil.copytree(quick_report, out)
    first = (out / "report.html").read_text()
    (out / "report.html").unlink()
    assert main(["report", "--out", str(out), "--render-only"]) == 0
    again = (out / "report.html").read_text()
    box = re.compile(r"<div class='summary' id='summary'>.*?</div>", flags=re.S)
    assert box.search(first).group(0) == box.search(again).group(0)
    assert main(["report", "--out", str(tmp_path / "none"), "--render-only"]) == 2


def test_cli_quick_report(tmp_path, smollm2):
    from posgen_tl.cli import main
    from posgen_tl.io.corpus import default_texts

    corpus = tmp_path / "corpus.txt"  # a user's own text file (here: reversed pydoc documents)
    corpus.write_text("\n\n".join(reversed(default_texts()[:20])), encoding="utf-8")
    out = tmp_path / "cli"
    assert main(["report", "--quick", "--seq-len", "64", "--n-seq", "3", "--corpus", str(corpus), "--out", str(out)]) == 0
    assert (out / "report.html").exists()
    res = json.loads((out / "results.json").read_text())
    assert all(c["corpus"] == str(corpus) for c in res["configs"].values()) and res["exactness"]["passed"] is True
    assert str(corpus) in (out / "report.html").read_text()
