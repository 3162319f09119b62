"""Assemble README-ready text (results/README_causal.md) from causal/T1-T2 runs.

    python scripts/causal_readme.py --dir results/causal --out results/README_causal.md

Reads the study folders under ``--dir`` (``posgen-tl study tolerance`` / ``scripts/causal_study.py``:
``<dir>/<tag>/causal_*.csv``, ``causal_meta.json``, ``tolerance_summary.csv``, ``t1_t2_tost.csv``,
``tolerance.json``; partial tables while a run is going) and the older flat outputs
(``causal_<tag>[_partial]_*``, ``t12_<tag>_*``), ``*_forward_costs.json``; prints nothing it did
not read. Statements about what was not run are passed with ``--missing``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from posgen_tl.experiments import causal as ca

FIRST_LANDING = ("destroy fast-band offset (α = 0.5, layers 10–19) vs its damage-matched random-band control: slope "
                 "difference +0.33 [0.11, 0.55] over 8 sequences (percentile bootstrap), printed as \"depends\"")


def _first_landing_run(config: dict) -> bool:
    """Is this the run the first landing's claim was about (SmolLM2, keys edited in layers 10–19)?"""
    return "smollm2" in str(config.get("model", "")).lower() and list(config.get("layers") or []) == list(range(10, 20))


def fmt(x, d=3) -> str:
    if isinstance(x, str):
        return x
    if x is None or x != x:
        return "–"
    return f"{x:.{d}g}" if abs(x) < 0.01 and x != 0 else f"{x:.{d}f}"


def ci(r, k, d=3) -> str:
    return f"{fmt(r[k], d)} [{fmt(r[k + '_lo'], d)}, {fmt(r[k + '_hi'], d)}]"


def causal_section(res: ca.CausalResult, tag: str) -> list[str]:
    c = res.config
    md = ca.causal_markdown(res, f"Causal test — {tag}")
    head = md.split("### Per condition")[0].strip().splitlines()
    lines = head + ["", "### Per condition", "",
                    "| condition | what | α (matched on subset: damage vs target) | n seq / docs | clean damage (nats) | "
                    "attention KL (nats) | tolerance slope (ΔNLL per unit p) |", "|---|---|---|---|---|---|---|"]
    for r in res.conditions.to_dict("records"):
        m = ""
        if r["condition"] not in ("none", "destroy") and r.get("match_damage") == r.get("match_damage"):
            m = (f" ({fmt(r['match_damage'])} vs {fmt(r['match_target'])}, {int(r['match_n_evals'])} evals, "
                 f"{'matched' if r['match_matched'] else '**UNMATCHED**'})")
        kl = ci(r, "attn_kl", 3) if "attn_kl" in r and r["attn_kl"] == r["attn_kl"] else "–"
        lines.append(f"| {r['condition']} | {r['description'].replace('|', chr(92) + '|')} | {fmt(r['alpha'])}{m} | {r['n_seq']} / {r['n_docs']} | "
                     f"{ci(r, 'damage')} | {kl} | {ci(r, 'slope')} |")
    t = res.contrasts
    if len(t):
        lines += ["", "### Contrasts (one family; Holm over the family; primary declared before the run)", "",
                  "| contrast | primary | n seq / docs | mean diff of slopes | bootstrap CI (docs) | t-interval | exact p | "
                  "Holm p | damage: intervention vs control | matched | split halves (sign agrees) | MDE 80 % | verdict |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t.to_dict("records"):
            lines.append(
                f"| {r['contrast']} | {'yes' if r['primary'] else ''} | {r['n_seq']} / {r['n_docs']} | {fmt(r['mean_diff'])} | "
                f"[{fmt(r['boot_lo'])}, {fmt(r['boot_hi'])}] | [{fmt(r['t_lo'])}, {fmt(r['t_hi'])}] | {fmt(r['p_exact'], 3)} | "
                f"{fmt(r['p_holm'], 3)} | {fmt(r['damage'])} vs {fmt(r['control_damage'])} | {bool(r['damage_matched'])} | "
                f"{fmt(r['half_a'])}, {fmt(r['half_b'])} ({bool(r['split_half_agree'])}) | {fmt(r['mde'])} | {r['verdict']} |")
        lines += [""] + [f"- `{r['contrast']}`: {r['verdict']} — {r['reason']}" for r in t.to_dict("records")]
        prim = t[t["primary"].astype(bool)]
        reading = ca.causal_reading(t)
        if len(prim) and _first_landing_run(c):
            v = prim["verdict"].iloc[0]
            holds = v.startswith("depends")
            lines += ["", f"**First landing's claim** ({FIRST_LANDING}): "
                      + (("the METHOD §8 rule reads \"depends\" here, BUT: " + reading if reading else
                          "it holds under the METHOD §8 rule here.") if holds else
                         f"it does NOT hold under the METHOD §8 rule: the primary contrast `{prim['contrast'].iloc[0]}` "
                         f"reads \"{v}\" ({prim['reason'].iloc[0]}).")]
        elif reading:
            lines += ["", f"**Reading:** {reading}"]
    w = c.get("wall_s", {})
    lines += ["", f"Command: `{c.get('command', '?')}`  ", f"Commit: `{c.get('commit')}`; wall times (s): "
              + ", ".join(f"{k} {v:.0f}" for k, v in w.items()) + "."]
    return lines


def t1_from_none(res: ca.CausalResult) -> list[str]:
    """T1 curve of the trained model from the causal study's ``none`` rows (same windows and swaps)."""
    from posgen_tl import stats  # noqa: PLC0415

    r = res.rows[res.rows["intervention"] == "none"]
    if r.empty:
        return []
    doc = r.groupby("seq")["doc"].first()
    out = ["| p (pairs swapped) | mean ΔNLL on target [doc bootstrap CI] |", "|---|---|"]
    for f, g in r.groupby("frac"):
        v = g.groupby("seq")["delta"].mean().loc[doc.index]
        m, lo, hi = stats.bootstrap_ci(v.to_numpy(), clusters=doc.to_numpy())
        out.append(f"| {f:g} | {fmt(m, 4)} [{fmt(lo, 4)}, {fmt(hi, 4)}] |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", default="results/README_causal.md")
    ap.add_argument("--costs", nargs="*", default=[], help="forward-cost json files")
    ap.add_argument("--missing", action="append", default=[], help="a statement about what was not run")
    ap.add_argument("--note", action="append", default=[], help="extra paragraph (measurement conditions)")
    a = ap.parse_args()
    d = Path(a.dir)
    lines = ["# Position tolerance and the causal test — powered study (issue #11 part B)", ""]
    lines += [f"- {m}" for m in a.missing] + ([""] if a.missing else [])
    tags = sorted({p.name[len("causal_"):-len("_config.json")].removesuffix("_partial") for p in d.glob("causal_*_config.json")})
    any_res = None
    t12_study = []
    for sub in sorted(p for p in d.iterdir() if p.is_dir() and (p / "causal_meta.json").exists()):
        meta = json.loads((sub / "causal_meta.json").read_text())
        if meta.get("causal", True):
            name = "causal" if (sub / "causal_config.json").exists() else "causal_partial"
            if (sub / f"{name}_config.json").exists():
                res = ca.load_causal_outputs(sub, name)
                if (sub / "tolerance.json").exists():
                    rec = json.loads((sub / "tolerance.json").read_text())
                    res.config.update(command=rec.get("command"), wall_s={**res.config.get("wall_s", {}),
                                                                           "study_total_s": rec.get("wall_seconds")})
                any_res = any_res or res
                lines += causal_section(res, sub.name) + [""]
        if meta.get("t12", True) and (sub / "t1_t2_tost.csv").exists():
            t12_study.append((sub, meta))
    for tag in tags:
        full = d / f"causal_{tag}_config.json"
        name = f"causal_{tag}" if full.exists() else f"causal_{tag}_partial"
        res = ca.load_causal_outputs(d, name)
        any_res = any_res or res
        lines += causal_section(res, tag) + [""]
    lines += ["## T1 / T2", ""]
    t12 = sorted(d.glob("t12_*_config.json"))
    for p in t12:
        tag = p.name[: -len("_config.json")]
        lines += [(d / f"{tag}.md").read_text(), ""]
    for sub, meta in t12_study:
        rec = json.loads((sub / "tolerance.json").read_text()) if (sub / "tolerance.json").exists() else {}
        cfg = dict(meta, seq_len=rec.get("config", {}).get("seq_len"), twin_seeds=rec.get("config", {}).get(
            "params", {}).get("twin_seeds", "0"), wall_s={"study": rec.get("wall_seconds", float("nan"))},
            commit=rec.get("git_commit"))
        r = ca.T12Result(pd.DataFrame(), pd.DataFrame(), pd.read_csv(sub / "tolerance_summary.csv"),
                         pd.read_csv(sub / "t1_t2_tost.csv"), cfg)
        lines += [ca.t12_markdown(r, f"T1 / T2 — {sub.name}"), f"Command: `{rec.get('command', '?')}`", ""]
    if not t12 and not t12_study:
        lines += ["The T1/T2 study (T2 and the random twin, with its TOST) did not finish in this session: no T1-vs-T2 "
                  "verdict is given. " + "The equivalence statement that goes with any such comparison: "]
        from posgen_tl import stats  # noqa: PLC0415

        lines += ["", "> " + stats.EQUIVARIANCE_NOTE, ""]
        if any_res is not None:
            lines += ["T1 of the trained model, from the causal study's `none` condition (same windows, same "
                      "per-(sequence, seed) swaps; p counts swapped disjoint adjacent pairs, so ≈ 2p of the context "
                      "tokens move); descriptive only:", ""] + t1_from_none(any_res) + [""]
    if a.costs:
        lines += ["## Cost per forward (seconds per 256-token sequence)", "",
                  "| model | measured under | full forward (target-only unembedding) | prefix to L0 (`stop_at_layer`) | "
                  "from L0 (`start_at_layer`, cached residual) | max abs NLL diff |", "|---|---|---|---|---|---|"]
        for p in a.costs:
            c = json.loads(Path(p).read_text())
            lines.append(f"| {Path(p).name.split('_')[0]} | {c.get('note', 'study process')} | {c['full_s_per_seq']:.3f} | "
                         f"{c['prefix_s_per_seq']:.3f} (L0 = {c['layer']}) | {c['resumed_s_per_seq']:.3f} | {c['max_abs_diff']:.1g} |")
        lines.append("")
    lines += a.note
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(Path(a.out).read_text())


if __name__ == "__main__":
    main()
