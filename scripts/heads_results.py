"""METHOD.md §6 head taxonomy: run, save CSV + PNG figures, print a markdown summary.

    python scripts/heads_results.py --model smollm2-135m --n-prompts 8 --seq-len 256 --out results/

Trained model and its random-init twin (seed ``--seed``) run on the same tokens.
Outputs in ``--out``: ``heads_<model>_bands.csv`` (all rows, per head and band),
``heads_<model>.csv`` (one row per head), ``heads_<model>_plane.png``,
``heads_<model>_freq.png``, ``heads_<model>_share.png``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import matplotlib.pyplot as plt
import torch

from posgen_tl import load_model
from posgen_tl.analysis.taxonomy import head_table, head_taxonomy_with_twin, taxonomy_agreement
from posgen_tl.plot.heads import (
    plot_frequency_usage,
    plot_positional_symbolic_plane,
    plot_taxonomy_vs_share,
)


def layer_groups(n_layers: int) -> dict[int, str]:
    """Early / middle / late thirds of the layer stack."""
    cuts = np.array_split(np.arange(n_layers), 3)
    return {int(l): name for name, part in zip(("early", "middle", "late"), cuts) for l in part}


def summary(heads: pd.DataFrame, n_layers: int) -> str:
    """Markdown: class counts per layer group and twin, mean centroids and shares, rank correlation."""
    groups = layer_groups(n_layers)
    h = heads.assign(group=heads["layer"].map(groups))
    h["group"] = pd.Categorical(h["group"], ["early", "middle", "late"])
    counts = (
        h.groupby(["twin", "group"], observed=False, sort=False)["label"].value_counts().unstack(fill_value=0)
    )
    for c in ("positional", "symbolic", "mixed"):
        if c not in counts:
            counts[c] = 0
    counts = counts[["positional", "symbolic", "mixed"]].add_prefix("n_")
    means = h.groupby(["twin", "group"], observed=False, sort=False)[
        ["positional", "symbolic", "q_centroid", "k_centroid", "positional_share"]
    ].mean().add_prefix("mean_")
    tab = counts.join(means.round(3)).reset_index()
    lines = ["| " + " | ".join(tab.columns) + " |", "|" + "---|" * len(tab.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in tab.itertuples(index=False)]
    agree = taxonomy_agreement(heads)
    lines += ["", "| twin | heads | mean k centroid | Spearman ρ(pos−sym, positional share) | p |", "|---|---|---|---|---|"]
    for twin, a in agree.items():
        kc = heads.loc[heads["twin"] == twin, "k_centroid"].mean()
        lines.append(f"| {twin} | {a['n']} | {kc:.2f} | {a['rho']:.3f} | {a['p']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-prompts", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--block-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--layers", type=int, nargs="*", default=None)
    ap.add_argument("--seed", type=int, default=0, help="random twin seed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--from-csv", action="store_true",
                    help="re-draw figures and summary from the CSV already in --out (no model run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"heads_{args.model}"

    t0 = time.time()
    if args.from_csv:
        df = pd.read_csv(args.out / f"{stem}_bands.csv")
        n_layers = int(df["layer"].max()) + 1
    else:
        model = load_model(args.model)
        n_layers = int(model.cfg.n_layers)
        df = head_taxonomy_with_twin(
            model, None, seed=args.seed, layers=args.layers, n_prompts=args.n_prompts, seq_len=args.seq_len,
            block_len=args.block_len, batch_size=args.batch_size, model_label=args.model,
        )
    wall = time.time() - t0
    heads = head_table(df)
    if not args.from_csv:
        df.to_csv(args.out / f"{stem}_bands.csv", index=False)
        heads.to_csv(args.out / f"{stem}.csv", index=False)
    figs = {
        "plane": plot_positional_symbolic_plane(heads),
        "freq": plot_frequency_usage(df),
        "share": plot_taxonomy_vs_share(heads),
    }
    for name, fig in figs.items():
        fig.savefig(args.out / f"{stem}_{name}.png", dpi=90)
        plt.close(fig)
    print(f"## Head taxonomy — {args.model} ({args.n_prompts} prompts × {args.seq_len} tokens, "
          f"block {args.block_len}, layers {'all' if args.layers is None else args.layers}; twin seed {args.seed})\n")
    print(summary(heads, n_layers))
    print(f"\nwall time {wall:.0f} s (both twins); outputs in {args.out}/{stem}*")


if __name__ == "__main__":
    main()
