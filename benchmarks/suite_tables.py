"""The suite's targets and tables: verdicts against the targets (met / not met / not measured), log-log
exponents, merging result files, the printed and markdown tables — what benchmarks/suite.py reports."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

TARGETS = {"decomposition": 1.3, "pattern": 1.0, "tolerance_curve": 1.1, "causal_condition": 1.1,
           "sufficiency": 1.1}
MEM_SLACK_MIB = 1024.0


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    import numpy as np

    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y == y and y > 0]
    if len(pts) < 2:
        return None
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(lx, ly, 1)[0])


def merge_results(parts: list[dict]) -> dict:
    """One results object from several ``--parts`` runs (per model: sizes, scaling, report united)."""
    parts = [json.loads(json.dumps(p)) for p in parts]  # the inputs stay untouched
    for p in parts:  # each size and scaling axis keeps the commit that measured it
        for m in p.get("models", {}).values():
            for entry in m.get("sizes", {}).values():
                entry.setdefault("commit", p.get("commit"))
            m["scaling_commit"] = {axis: m.get("scaling_commit", {}).get(axis, p.get("commit"))
                                   for axis in m.get("scaling", {})}
    out = parts[0]
    out["parts"] = [{"started": p.get("started"), "finished": p.get("finished"), "machine": p.get("machine"),
                     "commit": p.get("commit"), "config": p.get("config"),
                     "measured": {m: {"sizes": sorted(v.get("sizes", {})), "scaling": sorted(v.get("scaling", {}))}
                                  for m, v in p.get("models", {}).items()}}
                    for p in parts]
    for p in parts[1:]:
        for model, m in p["models"].items():
            dst = out["models"].setdefault(model, {"sizes": {}, "scaling": {}})
            dst.setdefault("sizes", {}).update(m.get("sizes", {}))
            dst.setdefault("scaling", {}).update(m.get("scaling", {}))
            dst.setdefault("scaling_commit", {}).update(m.get("scaling_commit", {}))
            if "report_quick" in m:
                dst["report_quick"] = m["report_quick"]
    out["targets"] = evaluate(out)
    return out


def save_results(res: dict, out: str, model: str, mres: dict) -> None:
    snap = dict(res)
    snap["models"] = dict(res["models"], **{model: mres})
    Path(out).write_text(json.dumps(snap, indent=1))


def ratio_of_minima(t: dict, step: str) -> float:
    """``min(step seconds) / (forwards · min(forward seconds))``: robust to a contention spike that
    hits one repeat's forward but not its step (which makes a per-repeat ratio absurdly small)."""
    return min(t["seconds"][step]) / (t["ratios"][step]["forwards"] * min(t["seconds"]["forward"]))


def over_capture(t: dict, step: str) -> float | None:
    """Median over repeats of ``step / (forwards · capture)``: the cost over the pass the analysis
    streams from (the forward up to the last layer, no unembedding). Beside the ratio to the full
    forward because a large vocabulary (Gemma3: 262 144 tokens) makes the forward's unembedding —
    which no analysis needs — most of the forward. ``None`` without a capture step."""
    if "capture" not in t["seconds"] or step not in t["seconds"]:
        return None
    n = t["ratios"][step]["forwards"]
    return statistics.median(x / (n * c) for x, c in zip(t["seconds"][step], t["seconds"]["capture"]))


def evaluate(res: dict) -> list[dict]:
    """Every target of issue #16, per model and size: value, limit, met (None = not measured)."""
    out = []
    for model, mres in res["models"].items():
        sizes = list(mres["sizes"])
        long_key = sizes[-1] if sizes else None
        for key, entry in mres["sizes"].items():
            rat = entry["timing"].get("ratios", {})
            for step, limit in TARGETS.items():
                if step not in rat:
                    out.append(dict(model=model, size=key, target=f"{step} ≤ {limit}× forward", value=None,
                                    met=None, note="not measured" if step != "sufficiency" else
                                    "posgen_tl.experiments.sufficiency does not exist on this branch"))
                    continue
                v = rat[step]["median"]
                unit = "× the forwards it needs" if rat[step]["forwards"] > 1 else "× forward"
                out.append(dict(model=model, size=key, target=f"{step} ≤ {limit}{unit} (median ratio)", value=v,
                                met=v <= limit, ratio_of_minima=ratio_of_minima(entry["timing"], step)))
            if "kbar_pass" in rat and "decomposition" in rat:
                v = rat["decomposition"]["median"] + rat["kbar_pass"]["median"]
                out.append(dict(model=model, size=key, target="decomposition + its k̄ reference pass ≤ 1.3× forward",
                                value=v, met=v <= 1.3,
                                note=f"k̄ from n_ref = {entry['timing']['n_ref']} other sequences"))
            if key == long_key:
                mem = entry["memory"]
                fwd = mem.get("forward", {}).get("peak_delta_mib")
                for step in ("capture", "decomposition", "pattern", "tolerance_curve", "causal_condition", "sufficiency"):
                    v = mem.get(step, {}).get("peak_delta_mib")
                    ok = None if v is None or fwd is None else v <= fwd + MEM_SLACK_MIB
                    out.append(dict(model=model, size=key, target=f"peak memory of {step} ≤ forward + 1 GiB",
                                    value=v, limit=None if fwd is None else fwd + MEM_SLACK_MIB, met=ok))
        cnt = mres.get("scaling", {}).get("count", {})
        for step in ("pattern", "decomposition"):
            e = cnt.get(step, {}).get("memory_exponent")
            out.append(dict(model=model, size="vs n_seq", target=f"{step} memory independent of n_seq (|exp| < 0.1)",
                            value=e, met=None if e is None else abs(e) < 0.1))
    return out


def print_table(res: dict) -> None:
    for model, mres in res["models"].items():
        for key, entry in mres["sizes"].items():
            t, mem = entry["timing"], entry["memory"]
            print(f"\n== {model}  {key} tokens  (ratios to the plain forward; min / median of "
                  f"{res['config']['repeats']} runs; peak = RSS high-water mark of the step, own process)")
            if "error" in t:
                print(f"   timing failed: {t['error'][-300:]}")
                continue
            f = min(t["seconds"]["forward"])
            print(f"   forward: {f:.2f} s (min); k̄ geometry one-time: {t['geometry_s']:.2f} s")
            print(f"   {'step':<26}{'ratio min':>10}{'median':>9}{'min/min':>9}{'seconds min':>13}{'peak MiB':>10}")
            for step, r in t["ratios"].items():
                pk = mem.get(step, {}).get("peak_delta_mib")
                pks = "" if pk is None else f"{pk:10.0f}"
                div = f" (/{r['forwards']} fwd)" if r["forwards"] > 1 else ""
                print(f"   {step + div:<26}{r['min']:>10.3f}{r['median']:>9.3f}{ratio_of_minima(t, step):>9.3f}"
                      f"{min(t['seconds'][step]):>13.2f}{pks}")
        for axis, series in mres.get("scaling", {}).items():
            print(f"\n== {model} scaling vs {axis}: log-log exponents (time, peak memory)")
            for step, s in series.items():
                pts = ", ".join(f"{p['n_seq']}x{p['seq_len']}: {p.get('min_s', float('nan')):.2f}s/"
                                f"{p.get('peak_delta_mib', float('nan')):.0f}MiB" for p in s["points"])
                te, me = s["time_exponent"], s["memory_exponent"]
                print(f"   {step:<14} time^{te if te is None else round(te, 2)}  memory^{me if me is None else round(me, 2)}"
                      f"   [{pts}]")
        if "report_quick" in mres:
            r = mres["report_quick"]
            if "error" in r:
                print(f"\n== {model} report --quick failed: {r['error'][-300:]}")
            else:
                print(f"\n== {model} whole report --quick ({r['tokens'][0]}×{r['tokens'][1]} tokens): "
                      f"{min(r['seconds']['report_quick']):.1f} s = {r['ratio']['min']:.0f}× (min) / "
                      f"{r['ratio']['median']:.0f}× (median) a forward of its tokens")
    print("\n== targets")
    for t in res.get("targets", []):
        v = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        met = {True: "MET", False: "NOT MET", None: "—"}[t["met"]]
        print(f"   {t['model']:<14}{t['size']:<10}{t['target']:<58}{v:>10}  {met}  {t.get('note', '')}")


def markdown(res: dict) -> str:
    """README-ready markdown: per model and size the ratio table, the targets and the exponents."""
    lines = []
    for model, mres in res["models"].items():
        for key, entry in mres["sizes"].items():
            t, mem = entry["timing"], entry["memory"]
            if "error" in t:
                lines.append(f"**{model} {key}**: timing failed ({t['error'][-200:]})\n")
                continue
            f = min(t["seconds"]["forward"])
            commit = entry.get("commit") or res.get("commit")
            at = f"commit {commit}; " if commit else ""
            lines += [f"**{model}, {key.replace('x', ' × ')} tokens** ({at}forward {f:.2f} s min; ratios min / median of "
                      f"{len(t['seconds']['forward'])} runs; peak = RSS high-water mark above the step's start, own process)",
                      "", "| step | ratio min | ratio median | ratio of minima | median ÷ capture | seconds (each run) "
                      "| peak MiB |", "|---|---:|---:|---:|---:|---|---:|"]
            for step, r in t["ratios"].items():
                pk = mem.get(step, {}).get("peak_delta_mib")
                div = f" (per forward, {r['forwards']} needed)" if r["forwards"] > 1 else ""
                secs = ", ".join(f"{x:.2f}" for x in t["seconds"][step])
                vc = over_capture(t, step)
                lines.append(f"| {step}{div} | {r['min']:.3f} | {r['median']:.3f} | {ratio_of_minima(t, step):.3f} | "
                             f"{'' if vc is None else f'{vc:.3f}'} | {secs} | {'' if pk is None else f'{pk:.0f}'} |")
            lines.append("")
        for axis, series in mres.get("scaling", {}).items():
            commit = mres.get("scaling_commit", {}).get(axis) or res.get("commit")
            at = f" (commit {commit})" if commit else ""
            lines += [f"**{model}: scaling vs {'sequence length (1 sequence)' if axis == 'length' else 'number of sequences'}**{at}",
                      "", "| step | time exponent | memory exponent | points (size: min s / peak MiB) |", "|---|---:|---:|---|"]
            for step, sr in series.items():
                pts = "; ".join(f"{p['n_seq']}×{p['seq_len']}: {p.get('min_s', float('nan')):.2f} / "
                                f"{p.get('peak_delta_mib', float('nan')):.0f}" for p in sr["points"])
                te, me = sr["time_exponent"], sr["memory_exponent"]
                lines.append(f"| {step} | {'n/a' if te is None else f'{te:.2f}'} | {'n/a' if me is None else f'{me:.2f}'} | {pts} |")
            lines.append("")
        r = mres.get("report_quick")
        if r and "error" not in r:
            lines += [f"**{model}: whole report `--quick`** ({r['tokens'][0]} × {r['tokens'][1]} tokens): "
                      f"{min(r['seconds']['report_quick']):.1f} s min = {r['ratio']['min']:.0f}× (min) / "
                      f"{r['ratio']['median']:.0f}× (median) the forward of its tokens "
                      f"({len(r['seconds']['report_quick'])} runs)", ""]
    lines += ["**Targets**", "", "| model | size | target | value | ratio of minima | met |", "|---|---|---|---:|---:|---|"]
    for tg in res.get("targets", []):
        v = "n/a" if tg["value"] is None else f"{tg['value']:.3g}"
        rm = f"{tg['ratio_of_minima']:.3g}" if tg.get("ratio_of_minima") is not None else ""
        met = {True: "met", False: "**not met**", None: "not measured"}[tg["met"]]
        note = f" ({tg['note']})" if tg.get("note") else ""
        lines.append(f"| {tg['model']} | {tg['size']} | {tg['target']}{note} | {v} | {rm} | {met} |")
    return "\n".join(lines) + "\n"


