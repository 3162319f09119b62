"""Assemble README-ready tables for longer texts and sufficiency.

    python scripts/length_readme.py --dir results/length

Reads the study folders under ``--dir`` (``posgen-tl study length|sufficiency|gap_attention``, as
run by ``scripts/length_results.py``) and the older flat outputs (``length_*_summary_<tag>.csv``).
Prints markdown tables (numbers only, from the summary CSVs); the prose around them is written by
hand from these numbers.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd


def ci(r) -> str:
    return f"{r['value']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"


def tci(r) -> str:
    if r.get("t_low", np.nan) != r.get("t_low", np.nan):
        return ci(r)
    return f"{r['value']:+.3f} [{r['t_low']:+.3f}, {r['t_high']:+.3f}]"


def nll(r) -> str:
    return f"{r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"


def p(r) -> str:
    v = r.get("p_holm", np.nan)
    return "" if v is None or v != v else f"{v:.2g}"


def table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))  # every column any row has, first-seen order
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(str(r.get(c, "—")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def gap_table(s: pd.DataFrame) -> str:
    rows = []
    for (gap, frac), g in s.groupby(["gap", "gap_frac"]):
        row = {"G (× n_ctx)": f"{frac:g} ({gap})"}
        for cond in ("vanilla", "lm_infinite", "disentangled"):
            c = g[g["condition"] == cond].set_index("estimator")
            if "nll" in c.index:
                row[f"{cond} NLL"] = nll(c.loc["nll"])
            row[f"{cond} Δ vs G=0 (p_holm)"] = (f"{ci(c.loc['d_vs_gap0'])} ({p(c.loc['d_vs_gap0'])})"
                                               if "d_vs_gap0" in c.index else "—")
            if cond != "vanilla":
                row[f"{cond} − vanilla (p_holm)"] = (f"{ci(c.loc['d_vs_vanilla'])} ({p(c.loc['d_vs_vanilla'])})"
                                                    if "d_vs_vanilla" in c.index else "= vanilla (no far entry)")
        rows.append(row)
    return table(rows)


def window_table(s: pd.DataFrame) -> str:
    rows = []
    for b0, g in s.groupby("bucket_start"):
        row = {"tokens": f"{b0}–{b0 + 255}"}
        for cond in ("window", "no_window", "lm_infinite", "disentangled"):
            c = g[g["condition"] == cond].set_index("estimator")
            if "nll" in c.index:
                row[f"{cond} NLL"] = nll(c.loc["nll"])
            if "d_vs_window" in c.index:
                r = c.loc["d_vs_window"]
                row[f"{cond} − window: boot CI / t-interval"] = ("identical (no entry changes)" if r["value"] == 0 and
                                                               r["ci_low"] == r["ci_high"] else f"{ci(r)} / {tci(r)[7:]}")
        rows.append(row)
    return table(rows)


def suff_table(s: pd.DataFrame) -> str:
    rows = []
    for grp, g in s.groupby("group", sort=False):
        row = {"layers": grp}
        clean = g[(g["estimator"] == "clean_nll")]
        if len(clean):
            row["clean NLL"] = f"{clean.iloc[0]['value']:.3f}"
        for src in ("d3", "d3_quantile", "d1", "wrong_kbar"):
            c = g[(g["source"] == src) & (g["estimator"] == "dnll")]
            if len(c):
                row[f"{src} ΔNLL (p_holm)"] = f"{ci(c.iloc[0])} ({p(c.iloc[0])})"
        for src in ("d3",):
            c = g[(g["source"] == src) & (g["estimator"] == "dslope")]
            if len(c):
                row[f"{src} Δslope (p_holm)"] = f"{ci(c.iloc[0])} ({p(c.iloc[0])})"
        rows.append(row)
    return table(rows)


def head_table(s: pd.DataFrame) -> str:
    rows = [{"contrast": r["estimator"], "mean [95 % CI]": ci(r), "t-interval": f"[{r['t_low']:+.3f}, {r['t_high']:+.3f}]",
             "p (sign-flip)": f"{r.get('p', np.nan):.2g}", "p_holm": p(r), "n seq / docs": f"{r['n_seq']} / {r['n_docs']}"}
            for _, r in s.iterrows()]
    return table(rows)


def disentangled_vs_cap(rows: pd.DataFrame) -> str:
    """Paired disentangled − LM-Infinite per position bucket where they differ (document clusters:
    bootstrap CI, sign-flip p, Holm over the buckets) — is the approximation better than the cap?"""
    from posgen_tl import stats  # noqa: PLC0415

    w = rows.pivot_table(index=["seq", "doc", "bucket_start"], columns="condition", values="nll").reset_index()
    out = []
    for b, g in w.groupby("bucket_start"):
        d = (g["disentangled"] - g["lm_infinite"]).to_numpy()
        if np.abs(d).max() == 0:
            continue
        m, lo, hi = stats.bootstrap_ci(d, clusters=g["doc"].to_numpy())
        out.append(dict(b=b, m=m, lo=lo, hi=hi, p=stats.sign_flip_test(d, clusters=g["doc"].to_numpy()), n=len(g),
                        docs=g["doc"].nunique()))
    ph = stats.holm([r["p"] for r in out])
    lines = ["| tokens | disentangled − LM-Infinite [doc bootstrap CI] | sign-flip p | Holm p | n seq / docs |",
             "|---|---|---|---|---|"]
    for r, h in zip(out, ph):
        lines.append(f"| {int(r['b'])}–{int(r['b']) + 255} | {r['m']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}] | "
                     f"{r['p']:.3g} | {h:.3g} | {r['n']} / {r['docs']} |")
    return "\n".join(lines)


def config(md: Path) -> dict:
    m = re.search(r"```\n(\{.*?\})\n```", md.read_text(), re.S)
    return json.loads(m.group(1)) if m else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="results/length")
    a = ap.parse_args()
    d = Path(a.dir)
    study_files = {"gap": ("length_gap_summary.csv", "length_gap_meta.json", None),
                   "window": ("length_window_summary.csv", "length_window_meta.json", "length_window_rows.csv"),
                   "sufficiency": ("sufficiency_summary.csv", "sufficiency_meta.json", None),
                   "attention": ("gap_attention_summary.csv", "gap_attention_meta.json", None)}
    for sub in sorted(p for p in d.iterdir() if p.is_dir()):
        for kind, (summ, meta, rows_name) in study_files.items():
            if not (sub / summ).exists():
                continue
            rec = next((json.loads(j.read_text()) for j in sub.glob("*.json") if j.stem in ("length", "sufficiency",
                                                                                          "gap_attention")), {})
            s = pd.read_csv(sub / summ)
            print(f"\n### {kind} — {sub.name}\n")
            print("config:", (sub / meta).read_text().replace("\n", " ") if (sub / meta).exists() else "{}")
            print(f"command: `{rec.get('command', '?')}` — wall {rec.get('wall_seconds', float('nan')):.0f} s, "
                  f"commit {rec.get('git_commit', '?')}\n")
            print({"gap": gap_table, "window": window_table, "sufficiency": suff_table, "attention": head_table}[kind](s))
            if rows_name and (sub / rows_name).exists():
                print("\n" + disentangled_vs_cap(pd.read_csv(sub / rows_name)))
            if kind == "attention":
                print("\nclasses:", s["classes"].iloc[0], "| positional heads:", s["n_heads_positional"].iloc[0],
                      "| symbolic heads:", s["n_heads_symbolic"].iloc[0])
    for f in sorted(d.glob("length_*_summary_*.csv")):
        kind = f.name.split("_")[1]
        tag = f.name.split("_summary_")[1][:-4]
        s = pd.read_csv(f)
        print(f"\n### {kind} — {tag}\n")
        mdf = d / f"length_{kind}_{tag}.md"
        if mdf.exists():
            print("config:", json.dumps(config(mdf)), "\n")
        print({"gap": gap_table, "window": window_table, "sufficiency": suff_table, "attention": head_table}[kind](s))
        rows_f = d / f"length_{kind}_rows_{tag}.csv"
        if kind == "window" and rows_f.exists():
            print("\n" + disentangled_vs_cap(pd.read_csv(rows_f)))
        if kind == "attention":
            print("\nclasses:", s["classes"].iloc[0], "| positional heads:", s["n_heads_positional"].iloc[0],
                  "| symbolic heads:", s["n_heads_symbolic"].iloc[0])


if __name__ == "__main__":
    main()
