"""Tables for results/README_estimators.md from the saved runs of scripts/estimators_results.py.

    python scripts/estimators_tables.py results/est/pattern_smollm2-135m   # a `posgen-tl study pattern` folder
    python scripts/estimators_tables.py results/est_smollm2 results/est_gemma3   # outputs of the older script

Per model: decomposition (both k̄ kinds, trained vs twin), paired per-sequence contrasts with exact
sign tests, ρ in three forms by band group, and the pattern-score Spearman across heads (each twin
apart; controls beside it). Recomputes the link with the installed ``link_to_decomposition`` so
runs made before a control column existed still get the controls that can be derived.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from posgen_tl.experiments.pattern import link_to_decomposition


def f3(x: float) -> str:
    return "—" if x is None or not np.isfinite(x) else f"{x:.3f}"


def decomposition(dec: pd.DataFrame) -> list[str]:
    d = dec[dec["sink_excluded"].astype(bool)]
    out = ["| estimator | k̄ | r trained | r random | within-row r trained | within-row r random | R² trained | R² random |",
           "|---|---|---|---|---|---|---|---|"]
    for (est, km), g in d.groupby(["estimator", "k_mean"], sort=True):
        cells = []
        for m in ("r", "r_within", "r2"):
            for twin in ("trained", "random"):
                x = g.loc[g["twin"] == twin, m]
                cells.append(f"{x.mean():.3f} ± {x.std():.3f}" if m != "r2" else f"{x.mean():.3f}")
        out.append(f"| {est} | {'— (no k̄)' if km == 'none' else km} | " + " | ".join(cells) + " |")
    return out


def by_group(dec: pd.DataFrame) -> list[str]:
    d = dec[dec["sink_excluded"].astype(bool)]
    out = ["| layers | D1 within-row r trained / random | D3 global trained / random | D3 per-sequence trained / random |",
           "|---|---|---|---|"]
    for grp in ("early", "middle", "late"):
        g = d[d.layer_group == grp]
        cell = []
        for est, km in (("D1", "none"), ("D3", "global"), ("D3", "per_sequence")):
            h = g[(g.estimator == est) & (g.k_mean == km)]
            cell.append(f"{h[h.twin == 'trained'].r_within.mean():.3f} / {h[h.twin == 'random'].r_within.mean():.3f}")
        out.append(f"| {grp} | " + " | ".join(cell) + " |")
    return out


def paired(dec: pd.DataFrame) -> list[str]:
    """Per sequence (mean over layers × heads): trained − random D3 within-row r, and global − per-sequence."""
    d = dec[dec["sink_excluded"].astype(bool) & (dec.estimator == "D3")]
    m = d.groupby(["twin", "k_mean", "seq"])["r_within"].mean().unstack(["twin", "k_mean"])
    rows = [("trained − random, global k̄", m[("trained", "global")] - m[("random", "global")]),
            ("trained − random, per-sequence k̄", m[("trained", "per_sequence")] - m[("random", "per_sequence")]),
            ("trained: global − per-sequence k̄", m[("trained", "global")] - m[("trained", "per_sequence")]),
            ("random: global − per-sequence k̄", m[("random", "global")] - m[("random", "per_sequence")])]
    out = ["| contrast (D3 within-row r, per sequence) | mean | min | max | sequences > 0 | exact sign test p |",
           "|---|---|---|---|---|---|"]
    for name, x in rows:
        k, n = int((x > 0).sum()), int(x.notna().sum())
        p = stats.binomtest(k, n).pvalue
        out.append(f"| {name} | {x.mean():+.3f} | {x.min():+.3f} | {x.max():+.3f} | {k}/{n} | {p:.2g} |")
    return out


def rho(bands: pd.DataFrame) -> list[str]:
    k = bands[bands.which == "k"]
    share = k.groupby(["twin", "layer", "head", "band_group"])["energy_share"].sum().groupby(["twin", "band_group"]).mean()
    out = ["| band group | twin | ρ_within | ρ_cross | stability (median) | plug-in ρ (legacy) | key energy share |",
           "|---|---|---|---|---|---|---|"]
    for grp in ("fast", "middle", "slow"):
        for twin in ("trained", "random"):
            g = k[(k.band_group == grp) & (k.twin == twin)]
            out.append(f"| {grp} | {twin} | {g.rho_within.mean():.3f} | {g.rho_cross.mean():.3f} | {g.stability.median():.3f} | "
                       f"{g.offset_ratio.mean():.3f} | {share[(twin, grp)]:.3f} |")
    return out


def link(heads: pd.DataFrame, dec: pd.DataFrame) -> tuple[list[str], pd.DataFrame]:
    _, s = link_to_decomposition(heads, dec, on=("model", "twin", "layer", "head"))
    out = ["| twin | k̄ | score | Spearman with D3 within-row r | p (scipy) | heads |", "|---|---|---|---|---|---|"]
    for _, r in s.iterrows():
        out.append(f"| {r.twin} | {r.k_mean} | {r.score} | {f3(r.spearman)} | {r.p:.2g} | {r.n_heads} |")
    return out, s


def load(path: str) -> tuple[dict, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(meta, decomposition rows, band rows, head rows)`` of one run: a ``posgen-tl study pattern``
    folder (``scripts/estimators_results.py``) or the output prefix of the older script."""
    d = Path(path)
    if d.is_dir():
        dec = pd.read_csv(d / "decomposition.csv")
        study = json.loads((d / "pattern.json").read_text())
        docs = json.loads((d / "windows.json").read_text())
        cfg = study["config"]
        meta = {"model": study["model"], "n_seq": int(dec["seq"].nunique()), "seq_len": cfg["seq_len"],
                "n_docs_analysed": len(docs["analysed_docs"]), "n_ref": docs["n_ref"],
                "n_docs_reference": len(docs["reference_docs"]),
                "wall_s": f"{study['wall_seconds']:.0f} s (decomposition + pattern, commit {study['git_commit'][:7]})",
                "bound_holds_min": float(dec.loc[dec.estimator == "D3", "d3_bound_holds"].min())}
        return meta, dec, pd.read_csv(d / "pattern_bands.csv"), pd.read_csv(d / "pattern_heads.csv")
    meta = json.loads(Path(f"{path}_meta.json").read_text())
    return (meta, pd.read_csv(f"{path}_decomp.csv.gz"), pd.read_csv(f"{path}_bands.csv.gz"),
            pd.read_csv(f"{path}_heads.csv.gz"))


def main() -> None:
    for prefix in sys.argv[1:]:
        meta, dec, bands, heads = load(prefix)
        lk, s = link(heads, dec)
        if not Path(prefix).is_dir():
            s.to_csv(f"{prefix}_link.csv", index=False)
        print(f"## {meta['model']}: {meta['n_seq']} windows × {meta['seq_len']} tokens from {meta['n_docs_analysed']} documents; "
              f"global k̄ from {meta['n_ref']} windows of {meta['n_docs_reference']} other documents; wall {meta['wall_s']}\n")
        for title, lines in (("Decomposition, sink excluded, mean ± std over heads × sequences × layers", decomposition(dec)),
                             ("Within-row r by layer group", by_group(dec)),
                             ("Paired per-sequence contrasts", paired(dec)),
                             ("Key ρ by band group", rho(bands)),
                             ("Pattern scores vs D3 within-row r across heads", lk)):
            print(f"### {title}\n")
            print("\n".join(lines) + "\n")
        print(f"D3 bound held on fraction {meta['bound_holds_min']} of sampled entries.\n")


if __name__ == "__main__":
    main()
