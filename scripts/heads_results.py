"""METHOD.md §6 head taxonomy: run, save CSV + PNG figures, print a markdown summary.

    python scripts/heads_results.py --model smollm2-135m --n-prompts 16 --seq-len 256 --out results/

Trained model and its random-init twin (seed ``--seed``) on the same windows (distinct
documents, :func:`posgen_tl.analysis.taxonomy.taxonomy_windows`), the same region
permutations and the same reference windows (global k̄, disjoint documents).
Outputs in ``--out``: ``heads_<model>_bands.csv`` (all rows, per head and band),
``heads_<model>.csv`` (one row per head), ``heads_<model>_{plane,bands,freq,share}.png``,
``heads_<model>_summary.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from posgen_tl import load_model
from posgen_tl.analysis.taxonomy import (
    head_table,
    head_taxonomy,
    head_taxonomy_with_twin,
    label_counts,
    share_by_class,
    taxonomy_agreement,
    taxonomy_windows,
)
from posgen_tl.heads import LABELS
from posgen_tl.models import random_twin
from posgen_tl.plot.heads import (
    plot_frequency_usage,
    plot_label_counts,
    plot_positional_symbolic_plane,
    plot_taxonomy_vs_share,
)


def _md(tab: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, tab.columns)) + " |", "|" + "---|" * len(tab.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in tab.itertuples(index=False)]
    return "\n".join(lines)


def layer_groups(n_layers: int) -> dict[int, str]:
    """Early / middle / late thirds of the layer stack."""
    cuts = np.array_split(np.arange(n_layers), 3)
    return {int(l): name for name, part in zip(("early", "middle", "late"), cuts) for l in part}


def summary(df: pd.DataFrame, n_layers: int) -> str:
    """Markdown: label counts (heads; per layer group; bands), scores and null, link to D3, frequency use."""
    heads = head_table(df)
    out = []
    c = label_counts(df).pivot_table(index="twin", columns="label", values="n", sort=False)[list(LABELS)].astype(int)
    out += ["**Head labels** (all layers)", "", _md(c.reset_index()), ""]
    h = heads.assign(group=heads["layer"].map(layer_groups(n_layers)))
    g = h.groupby(["twin", "group"], sort=False)["label"].value_counts().unstack(fill_value=0)
    g = g.reindex(columns=list(LABELS), fill_value=0).reset_index()
    out += ["**Head labels by layer third**", "", _md(g), ""]
    b = label_counts(df, by_band=True).groupby(["twin", "label"], sort=False)["n"].sum().unstack(fill_value=0)
    out += ["**Band labels** (each RoPE band alone as a 2-D head; layer × head × band)", "",
            _md(b.reindex(columns=list(LABELS), fill_value=0).reset_index()), ""]
    s = heads.groupby("twin", sort=False).agg(
        positional_mean=("positional", "mean"), symbolic_mean=("symbolic", "mean"),
        null_mc_mean=("null_mc", "mean"), null_q95_median=("null_q", "median"), null_q95_max=("null_q", "max"),
        rows_used=("n_rows_used", "sum"), rows_excluded=("n_rows_excluded", "sum"),
        region_mass_median=("region_mass", "median")).round(4).reset_index()
    out += ["**Scores and null** (means over heads; rows = query rows × permutations)", "", _md(s), ""]
    bc = heads.groupby(["twin", "label"], sort=False).agg(
        n=("head", "size"), positional_share_median=("positional_share", "median"),
        k_centroid_median=("k_centroid", "median"), q_centroid_median=("q_centroid", "median"),
        positional_median=("positional", "median"), symbolic_median=("symbolic", "median")).round(3).reset_index()
    out += ["**Per label**: D3 positional share (global k̄), frequency centroid (band, 0 = fastest)", "", _md(bc), ""]
    link = share_by_class(df).drop(columns=["class_a", "class_b"])
    link[["median_a", "median_b", "U"]] = link[["median_a", "median_b", "U"]].round(3)
    link["p"] = link["p"].map(lambda v: f"{v:.2g}")
    out += ["**D3 positional share, positional (a) vs symbolic (b) heads**, Mann–Whitney U (two-sided)", "",
            _md(link), ""]
    agree = taxonomy_agreement(df)
    out += ["| twin | heads | Spearman ρ(positional − symbolic, positional share) | p |", "|---|---|---|---|"]
    out += [f"| {t} | {a['n']} | {a['rho']:.3f} | {a['p']:.2g} |" for t, a in agree.items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--n-ref", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--region-len", type=int, default=64)
    ap.add_argument("--n-query", type=int, default=64)
    ap.add_argument("--n-perm", type=int, default=8)
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--min-score", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--layers", type=int, nargs="*", default=None)
    ap.add_argument("--seed", type=int, default=0, help="random twin, document split and permutation seed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--twin", choices=["both", "trained", "random"], default="both",
                    help="run both (default) or one side only (writes heads_<model>_<side>_bands.csv; the "
                         "sides use the same windows, permutations and reference; --from-csv merges them)")
    ap.add_argument("--from-csv", action="store_true",
                    help="re-draw figures and summary from the CSV already in --out (no model run); "
                         "merges the _trained/_random parts if the joint CSV is absent")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"heads_{args.model}"

    t0 = time.time()
    if args.from_csv:
        joint = args.out / f"{stem}_bands.csv"
        parts = [args.out / f"{stem}_{side}_bands.csv" for side in ("trained", "random")]
        df = pd.read_csv(joint) if joint.exists() else pd.concat([pd.read_csv(p) for p in parts], ignore_index=True)
        n_layers = int(df["layer"].max()) + 1
        n_docs = int(df["n_docs"].iloc[0])
    else:
        model = load_model(args.model)
        n_layers = int(model.cfg.n_layers)
        tokens, ref = taxonomy_windows(model, None, n_prompts=args.n_prompts, seq_len=args.seq_len, n_ref=args.n_ref,
                                       seed=args.seed)
        n_docs = tokens.n_docs
        kw = dict(seed=args.seed, layers=args.layers, region_len=args.region_len, n_query=args.n_query,
                  n_perm=args.n_perm, block=args.block, min_score=args.min_score, batch_size=args.batch_size,
                  model_label=args.model)
        if args.twin == "both":
            df = head_taxonomy_with_twin(model, tokens, ref, **kw)
        else:
            subject = model if args.twin == "trained" else random_twin(model, args.seed)
            df = head_taxonomy(subject, tokens, ref, twin_label=args.twin, **kw)
            stem = f"{stem}_{args.twin}"
        df.to_csv(args.out / f"{stem}_bands.csv", index=False)
        head_table(df).to_csv(args.out / f"{stem}.csv", index=False)
    wall = time.time() - t0
    heads = head_table(df)
    figs = {
        "plane": plot_positional_symbolic_plane(heads),
        "bands": plot_label_counts(df),
        "freq": plot_frequency_usage(df),
        "share": plot_taxonomy_vs_share(heads),
    }
    for name, fig in figs.items():
        fig.savefig(args.out / f"{stem}_{name}.png", dpi=90)
        plt.close(fig)
    if df["twin"].nunique() < 2:  # one side of a split run: data saved, figures/summary after the merge
        print(f"{args.twin} side done in {time.time() - t0:.0f} s; run again with --from-csv to merge")
        return
    text = (f"## Head taxonomy — {args.model} ({args.n_prompts} prompts from {n_docs} documents × {args.seq_len} "
            f"tokens; region {args.region_len} tokens permuted {args.n_perm}× per prompt (block {args.block}), "
            f"{args.n_query} query rows; min score {args.min_score}; layers "
            f"{'all' if args.layers is None else args.layers}; global k̄ from {args.n_ref} windows of other "
            f"documents; twin seed {args.seed})\n\n" + summary(df, n_layers)
            + ("" if args.from_csv else f"\n\nwall time {wall:.0f} s (both twins, 1 thread); outputs in {args.out}/{stem}*"))
    (args.out / f"{stem}_summary.md").write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
