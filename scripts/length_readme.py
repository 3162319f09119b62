"""Assemble README-ready tables for longer texts and sufficiency from results/length/*.csv.

    python scripts/length_readme.py --dir results/length

Prints markdown tables (numbers only, from the summary CSVs written by length_results.py); the
prose around them is written by hand from these numbers.
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
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
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


def config(md: Path) -> dict:
    m = re.search(r"```\n(\{.*?\})\n```", md.read_text(), re.S)
    return json.loads(m.group(1)) if m else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="results/length")
    a = ap.parse_args()
    d = Path(a.dir)
    for f in sorted(d.glob("length_*_summary_*.csv")):
        kind = f.name.split("_")[1]
        tag = f.name.split("_summary_")[1][:-4]
        s = pd.read_csv(f)
        print(f"\n### {kind} — {tag}\n")
        mdf = d / f"length_{kind}_{tag}.md"
        if mdf.exists():
            print("config:", json.dumps(config(mdf)), "\n")
        print({"gap": gap_table, "window": window_table, "sufficiency": suff_table, "attention": head_table}[kind](s))
        if kind == "attention":
            print("\nclasses:", s["classes"].iloc[0], "| positional heads:", s["n_heads_positional"].iloc[0],
                  "| symbolic heads:", s["n_heads_symbolic"].iloc[0])


if __name__ == "__main__":
    main()
