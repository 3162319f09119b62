"""METHOD §3 results: feature pattern of a model and its random-init twin, figures + CSVs + markdown.

Example::

    python scripts/pattern_results.py --model smollm2-135m --n-seq 32 --seq-len 512 --out results/
    python scripts/pattern_results.py --model gemma3-270m --n-seq 16 --out results/ --decomp d3.csv

Writes into ``--out`` (prefix ``pattern_<model>_``): ``heads.csv`` (per head), ``bands_mean.csv``
(per twin/layer/which/band, mean over heads), ``bands.csv.gz`` (full tidy frame), PNG figures,
``summary.md``; prints the markdown summary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


def layer_groups(n_layers: int, n_groups: int = 3) -> list[tuple[str, list[int]]]:
    names = ["early", "middle", "late"] if n_groups == 3 else [f"g{i}" for i in range(n_groups)]
    chunks = np.array_split(np.arange(n_layers), n_groups)
    return [(n, c.tolist()) for n, c in zip(names, chunks)]


def summary_table(bands: pd.DataFrame, heads: pd.DataFrame, n_groups: int = 3) -> pd.DataFrame:
    """Per layer group and twin: mean cross-fitted key ρ of the fastest / slowest quarter of bands,
    median rotation-aware pattern score (predicted relative D3 error, global k̄)."""
    k = bands[bands["which"] == "k"]
    nb = int(k["band"].max()) + 1
    q = max(1, nb // 4)
    rows = []
    n_layers = int(heads["layer"].max()) + 1
    present = sorted(set(heads["layer"]))
    for name, layers in layer_groups(n_layers, n_groups):
        layers = [x for x in layers if x in present]
        if not layers:
            continue
        row = {"group": name, "layers": f"{layers[0]}-{layers[-1]}"}
        for twin in ("trained", "random"):
            kb = k[(k.twin == twin) & k.layer.isin(layers)]
            hd = heads[(heads.twin == twin) & heads.layer.isin(layers)]
            row[f"fast_k_rho_{twin}"] = kb[kb.band < q]["rho_cross"].mean()
            row[f"slow_k_rho_{twin}"] = kb[kb.band >= nb - q]["rho_cross"].mean()
            row[f"slow_k_energy_{twin}"] = kb[kb.band >= nb // 2].groupby(["layer", "head"])["energy_share"].sum().mean()
            row[f"pred_d3_err_{twin}"] = hd["pred_d3_err_global"].median()
        rows.append(row)
    all_row = {"group": "all", "layers": f"0-{n_layers - 1}"}
    for twin in ("trained", "random"):
        kb, hd = k[k.twin == twin], heads[heads.twin == twin]
        all_row[f"fast_k_rho_{twin}"] = kb[kb.band < q]["rho_cross"].mean()
        all_row[f"slow_k_rho_{twin}"] = kb[kb.band >= nb - q]["rho_cross"].mean()
        all_row[f"slow_k_energy_{twin}"] = kb[kb.band >= nb // 2].groupby(["layer", "head"])["energy_share"].sum().mean()
        all_row[f"pred_d3_err_{twin}"] = hd["pred_d3_err_global"].median()
    rows.append(all_row)
    return pd.DataFrame(rows)


def to_markdown(df: pd.DataFrame, digits: int = 3) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for _, r in df.iterrows():
        cells = [f"{v:.{digits}f}" if isinstance(v, (float, np.floating)) else str(v) for v in r]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="random-twin seed")
    ap.add_argument("--out", default="results/")
    ap.add_argument("--decomp", default=None, help="per-sequence decomposition CSV (decompose_model rows)")
    ap.add_argument("--phase", default=None, help="layer,kv_head,band for the phase histogram (default mid layer,0,0)")
    args = ap.parse_args(argv)

    from posgen_tl.analysis.pattern import feature_pattern_with_twin, link_to_decomposition
    from posgen_tl.corpus import corpus_tokens
    from posgen_tl.models import load_model, random_twin
    from posgen_tl.plot.pattern import (
        plot_band_heatmaps,
        plot_pattern_distribution,
        plot_pattern_vs_d3,
        plot_phase_histogram,
    )

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model)
    label = args.model
    stem = f"pattern_{label}_"
    tokens = corpus_tokens(model, None, seq_len=args.seq_len, n_seq=args.n_seq)
    # document windows; the global k̄ from 8 windows of OTHER documents (same split as the decomposition runner)
    tp = feature_pattern_with_twin(model, None, seed=args.seed, sink=args.sink, batch_size=args.batch_size,
                                   n_seq=args.n_seq, seq_len=args.seq_len, n_ref=8, model_label=label)
    t_pass = time.time() - t0
    bands, heads = tp.bands, tp.heads
    heads.to_csv(out / f"{stem}heads.csv", index=False, float_format="%.6g")
    bands.to_csv(out / f"{stem}bands.csv.gz", index=False, float_format="%.5g")
    bands.groupby(["model", "twin", "layer", "kind", "which", "band"], as_index=False)[
        ["energy_share", "offset_ratio", "phase_concentration", "residual_rms", "energy", "period"]
    ].mean().to_csv(out / f"{stem}bands_mean.csv", index=False, float_format="%.6g")

    figs = {}
    for which in ("k", "q"):
        for stat in ("offset_ratio", "energy_share"):
            figs[f"heat_{which}_{stat}"] = plot_band_heatmaps(bands, which=which, stat=stat)
    figs["heat_k_phase_concentration"] = plot_band_heatmaps(bands, which="k", stat="phase_concentration")
    figs["pattern_hist"] = plot_pattern_distribution(heads)
    figs["fast_k_rho_hist"] = plot_pattern_distribution(heads, "fast_key_offset")
    n_layers = int(heads["layer"].max()) + 1
    ph_layer, ph_head, ph_band = (n_layers // 2, 0, 0) if args.phase is None else map(int, args.phase.split(","))
    twin = random_twin(model, args.seed)
    figs["phase_hist"] = plot_phase_histogram(model, tokens[:2, :256], ph_layer, ph_head, ph_band, "k", twin=twin,
                                              sink=args.sink)
    del twin

    table = summary_table(bands, heads)
    table.to_csv(out / f"{stem}summary.csv", index=False, float_format="%.6g")
    kinds = bands.groupby("layer")["kind"].first()
    by_kind = None
    if kinds.nunique() > 1:  # e.g. Gemma3 local (sliding window) vs global layers
        parts = []
        for kind, ls in kinds.groupby(kinds):
            t = summary_table(bands[bands.layer.isin(ls.index)], heads[heads.layer.isin(ls.index)], n_groups=1)
            t = t[t.group == "all"].assign(group=kind, layers=",".join(map(str, ls.index)))
            parts.append(t)
        by_kind = pd.concat(parts, ignore_index=True)
    md = [f"### Feature pattern: {label} ({args.n_seq}×{args.seq_len} tokens, sink={args.sink}, twin seed {args.seed})",
          "", f"tokens per layer (sink excluded): {tp.trained.n_tokens}; pass time (trained+twin): {t_pass:.0f} s",
          "", "fast/slow = fastest/slowest quarter of the bands; k ρ = cross-fitted key offset ratio ρ_cross (mean over"
          " kv-heads, bands); slow_k_energy = key energy share in the slower half of the bands; pred_d3_err = median"
          " predicted relative D3 error (rotation-aware pattern score, global k̄).",
          "", to_markdown(table)]
    if by_kind is not None:
        md += ["", "By attention kind:", "", to_markdown(by_kind)]
    if args.decomp:
        dec = pd.read_csv(args.decomp)
        on = ["model", "twin", "layer", "head"]
        if dec["model"].nunique() == 1 and set(dec["model"]) != set(heads["model"]):
            on.remove("model")  # one model each side, labelled differently (e.g. hub name vs zoo name)
        merged, summ = link_to_decomposition(heads, dec, on=on)
        merged.to_csv(out / f"{stem}vs_d3.csv", index=False, float_format="%.6g")
        figs["vs_d3"] = plot_pattern_vs_d3(merged)
        md += ["", "Pattern scores vs D3 within-row r (sink excluded, mean over sequences), Spearman across heads,"
               " each twin and k̄ apart:", "", to_markdown(summ.drop(columns=["description"]))]
        summ.to_csv(out / f"{stem}vs_d3_summary.csv", index=False)
    for name, fig in figs.items():
        fig.savefig(out / f"{stem}{name}.png", dpi=80)
        plt.close(fig)
    md += ["", f"wall time: {time.time() - t0:.0f} s"]
    text = "\n".join(md)
    (out / f"{stem}summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
