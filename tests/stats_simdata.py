"""Synthetic per-document units for the verdict tests (no model): realistic damage spread.

Magnitudes from the committed SmolLM2 L10–19 n64 rows (document level): destroy's damage ≈ 0.48
nats with a coefficient of variation ≈ 0.34 across documents; a control's damage / destroy's
damage varies by ≈ 0.3 (sd) across documents; the unedited AUC ≈ 0.038 ± 0.0145 nats × p;
the AUC falls by ≈ 0.02 per nat of damage (regression of destroy − C1 on the damage gap), and a
condition's own document noise ≈ 0.004.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

CONTROLS = ("C1", "C2", "C3", "C4")


def entry_units(rng, *, model="m", layers="L1-2", n_docs=32, gamma=-0.02, delta=None, ratio=None, ratio_sd=0.3,
                noise=0.004, seqs_per_doc=1):  # fmt: skip
    """Units (estimators ``auc``, ``damage``) of one entry: AUC_c = AUC_none + γ·damage_c + δ_c + noise."""
    delta = {"destroy": 0.0, **{c: 0.0 for c in CONTROLS}, **(delta or {})}
    ratio = {"C1": 1.0, "C2": 1.0, "C3": 1.0, "C4": 1.0, **(ratio or {})}
    dmg_d = 0.48 * np.exp(rng.normal(0, 0.33, n_docs) - 0.33**2 / 2)
    dmg = {"none": np.zeros(n_docs), "destroy": dmg_d}
    for c in CONTROLS:
        dmg[c] = dmg_d * np.clip(rng.normal(ratio[c], ratio_sd, n_docs), 0.05, None)
    base = rng.normal(0.038, 0.0145, n_docs)
    rows = []
    for c, d in dmg.items():
        auc = base + (0 if c == "none" else gamma * d + delta[c] + rng.normal(0, noise, n_docs))
        for est, v in (("auc", auc), ("damage", d)):
            rows.append(pd.DataFrame(dict(model=model, layers=layers, condition=c, doc=np.arange(n_docs),
                                          estimator=est, frac=np.nan, value=v, n_seqs=seqs_per_doc)))
    return pd.concat(rows, ignore_index=True)
