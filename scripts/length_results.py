"""METHOD §7 (longer texts) and §5 sufficiency results, written as CSVs + markdown under --out.

    python scripts/length_results.py gap --model smollm2-135m --n-seq 32 --prefix-len 256 --suffix-len 256
    python scripts/length_results.py attention --model smollm2-135m --n-seq 16
    python scripts/length_results.py window --model gemma3-270m --n-seq 16 --seq-len 2048
    python scripts/length_results.py sufficiency --model smollm2-135m --n-seq 32 --seq-len 256

Every experiment is the library recipe (posgen_tl.analysis.length / .sufficiency); this script
only picks sizes, times the run and writes tables.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import pandas as pd  # noqa: E402

from posgen_tl.analysis import length as L  # noqa: E402
from posgen_tl.analysis import sufficiency as S  # noqa: E402
from posgen_tl.analysis.decomposition import analysis_windows, reference_key_means  # noqa: E402
from posgen_tl.models import load_model  # noqa: E402


def md(df: pd.DataFrame, cols=None, digits: int = 3) -> str:
    d = df if cols is None else df[[c for c in cols if c in df.columns]]

    def fmt(v) -> str:
        if isinstance(v, float):
            return "" if v != v else f"{v:.{digits}f}"
        return str(v)

    head = "| " + " | ".join(map(str, d.columns)) + " |"
    sep = "|" + "|".join("---" for _ in d.columns) + "|"
    body = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in d.itertuples(index=False)]
    return "\n".join([head, sep, *body])


COLS = ["condition", "source", "group", "layers", "gap", "gap_frac", "bucket_start", "estimator", "value", "ci_low",
        "ci_high", "t_low", "t_high", "p", "p_holm", "n_seq", "n_docs", "label"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["gap", "attention", "window", "sufficiency"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=32)
    ap.add_argument("--n-ref", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--skip", type=int, default=16)
    ap.add_argument("--gaps", default="0,0.25,0.5,1,2")
    ap.add_argument("--gap", type=float, default=2.0, help="attention: gap in units of n_ctx")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--max-per-doc", type=int, default=None)
    ap.add_argument("--target-len", type=int, default=64)
    ap.add_argument("--delta0", type=int, default=0)
    ap.add_argument("--gamma", type=float, default=0.9)
    ap.add_argument("--tolerance", default="", help="sufficiency: 'source:group,...' pairs with a slope")
    ap.add_argument("--fracs", default="0,0.05,0.1,0.2")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--classes", default=None,
                    help="attention: per-head §6 taxonomy table (heads_<model>.csv) for the head classes "
                         "(default: the D3 f_share proxy)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="results")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = a.model + (f"_{a.tag}" if a.tag else "")
    t0 = time.time()
    model = load_model(a.model)
    t_load = time.time() - t0
    t0 = time.time()
    if a.what == "gap":
        res = L.gap_probe(model, None, prefix_len=a.prefix_len, suffix_len=a.suffix_len,
                          gaps=tuple(float(x) for x in a.gaps.split(",")), skip=a.skip, n_seq=a.n_seq, n_ref=a.n_ref,
                          delta0=a.delta0, batch_size=a.batch_size)
        name = "gap"
    elif a.what == "window":
        res = L.window_removal(model, None, seq_len=a.seq_len, n_seq=a.n_seq, bucket=a.bucket, n_ref=a.n_ref,
                               delta0=a.delta0, max_per_doc=a.max_per_doc)
        name = "window"
    elif a.what == "sufficiency":
        tol = [tuple(x.split(":")) for x in a.tolerance.split(",") if x]
        res = S.sufficiency(model, None, n_seq=a.n_seq, seq_len=a.seq_len, target_len=a.target_len, n_ref=a.n_ref,
                            gamma=a.gamma, delta0=a.delta0, tolerance=tol,
                            fracs=tuple(float(x) for x in a.fracs.split(",")), batch_size=a.batch_size)
        name = "sufficiency"
    else:  # attention
        n = a.prefix_len + a.suffix_len
        win, ref = analysis_windows(model, None, n_seq=a.n_seq, seq_len=n, n_ref=a.n_ref)
        km = reference_key_means(model, ref.tokens, sink=1, progress=False)
        spec_n_ctx = int(model.cfg.n_ctx)
        rows = L.gap_attention(model, win, prefix_len=a.prefix_len, suffix_len=a.suffix_len,
                               gap=int(round(a.gap * spec_n_ctx)), k_means=km, skip=a.skip)
        classes = L.classes_from_taxonomy(pd.read_csv(a.classes)) if a.classes else None
        summ = L.head_class_test(rows, classes)
        res = L.LengthResult(rows, summ, dict(model=a.model, n_seq=len(win), n_docs=win.n_docs, gap=a.gap,
                                               n_ctx=spec_n_ctx))
        name = "attention"
    wall = time.time() - t0
    res.rows.to_csv(out / f"length_{name}_rows_{tag}.csv", index=False)
    res.summary.to_csv(out / f"length_{name}_summary_{tag}.csv", index=False)
    cfg = {**res.config, "wall_s": round(wall, 1), "load_s": round(t_load, 1), "threads": torch.get_num_threads()}
    lines = [f"## {name} — {a.model}", "", "```", json.dumps(cfg, default=str), "```", "",
             md(res.summary, [c for c in COLS if c in res.summary.columns] + [c for c in res.summary.columns
                                                                              if c.startswith("n_heads") or c == "classes"])]
    (out / f"length_{name}_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wall {wall:.0f}s (load {t_load:.0f}s)")


if __name__ == "__main__":
    main()
