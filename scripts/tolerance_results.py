"""METHOD.md §4–§5 results: T1/T2 curves (trained vs random twin), T3 with/without a distance
cap, and the causal table (interventions on pre-rotation keys vs damage-matched controls).

    python scripts/tolerance_results.py --model smollm2-135m --n-seq 8 --seq-len 256 --target-len 64 --out results/

Writes CSVs, a markdown summary (``tolerance_<model>.md``) and PNG figures under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import pandas as pd  # noqa: E402

from posgen_tl.interventions import Intervention, intervention_hooks, key_means  # noqa: E402
from posgen_tl.analysis import tolerance as tol  # noqa: E402
from posgen_tl.capture import probe_hooks  # noqa: E402
from posgen_tl.corpus import corpus_tokens  # noqa: E402
from posgen_tl.models import load_model, random_twin  # noqa: E402
from posgen_tl.plot.tolerance import plot_dose_response, plot_length, plot_tolerance_curves  # noqa: E402


def floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(","))


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


def run_t12(a, model, tokens, out: Path, tag: str, times: dict) -> list[str]:
    """T1/T2 curves for the trained model and its random twin; returns markdown lines."""
    t0, bs = time.time(), a.batch_size
    frames = [tol.transposition_curve(model, tokens, fracs=a.fracs, seeds=a.seeds, target_len=a.target_len,
                                      modes=("T1", "T2"), batch_size=bs).assign(twin="trained")]
    if not a.no_twin:
        twin = random_twin(model, 0)
        tf = tuple(f for f in a.fracs if f in (0.0, 0.05, 0.1, 0.2)) or a.fracs
        frames.append(tol.transposition_curve(twin, tokens, fracs=tf, seeds=a.seeds[:1], target_len=a.target_len,
                                              modes=("T1", "T2"), batch_size=bs).assign(twin="random"))
        del twin
    curves = pd.concat(frames, ignore_index=True)
    curves.to_csv(out / f"tolerance_curves_{tag}.csv", index=False)
    summ = pd.concat([tol.curve_summary(c, by=("twin", "mode")) for _, c in curves.groupby("twin", sort=False)])
    summ.to_csv(out / f"tolerance_curve_summary_{tag}.csv", index=False)
    cmp_ = pd.concat([tol.t1_vs_t2(c).assign(twin=t) for t, c in curves.groupby("twin", sort=False)])
    plot_tolerance_curves(summ, title=f"{a.model}: T1 vs T2").savefig(out / f"fig_tolerance_{tag}.png", dpi=120)
    times["T1/T2"] = time.time() - t0
    return ["## T1 / T2 (ΔNLL on target; slope = ΔNLL per unit p)", "",
            md(summ, ["twin", "mode", "estimator", "frac", "value", "ci_low", "ci_high", "n_seq"], 4), "",
            "T1 − T2 (paired over sequences; `alike` = CI contains 0):", "",
            md(cmp_, ["twin", "estimator", "frac", "value", "ci_low", "ci_high", "alike"], 4), ""]


def matched_control(model, tokens, iv: Intervention, km, a, base, lay: str) -> tuple[Intervention, float, float]:
    """A random-band control (same base kind, bands, layers) with alpha matched on clean damage."""
    bs = a.batch_size
    target = float((tol.nll_on_target(model, tokens, target_len=a.target_len, batch_size=bs,
                                      fwd_hooks=intervention_hooks(model, iv, km)) - base).mean())
    c0 = Intervention("random_bands", iv.bands, layers=iv.layers, base=iv.kind, label="tmp")
    alpha, dmg = tol.matched_alpha(model, tokens, c0, target, k_means=km, target_len=a.target_len, base=base, batch_size=bs)
    ctrl = dataclasses.replace(c0, alpha=alpha, label=f"control: {iv.kind}-change moved to random bands {lay} @{alpha:.3g}")
    return ctrl, target, dmg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seq", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--target-len", type=int, default=64)
    ap.add_argument("--out", default="results/")
    ap.add_argument("--fracs", type=floats, default=(0.0, 0.01, 0.02, 0.05, 0.1, 0.2))
    ap.add_argument("--causal-fracs", type=floats, default=(0.0, 0.05, 0.1, 0.2))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="intervened layers (default: middle third)")
    ap.add_argument("--alphas", type=floats, default=(0.5, 1.0), help="strengths of the fast-band destroy (dose)")
    ap.add_argument("--minimal", action="store_true", help="only destroy-fast and its matched control")
    ap.add_argument("--match-alpha", type=float, default=None, help="destroy strength the control is matched to (default: max)")
    ap.add_argument("--enforce-control", action="store_true", help="add enforce-fast with its own matched control")
    ap.add_argument("--skip-t12", action="store_true", help="skip T1/T2 curves (causal test only)")
    ap.add_argument("--suffix", default="", help="appended to output file names")
    ap.add_argument("--no-twin", action="store_true")
    ap.add_argument("--no-length", action="store_true")
    ap.add_argument("--cap", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    a = ap.parse_args()

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t00 = time.time()
    times: dict[str, float] = {}
    model = load_model(a.model)
    spec, _ = probe_hooks(model)
    tokens = corpus_tokens(model, None, seq_len=a.seq_len, n_seq=a.n_seq)
    ref = corpus_tokens(model, None, seq_len=a.seq_len, n_seq=4, offset=a.n_seq)  # k̄ reference set (disjoint)
    tag = a.model.replace("/", "_") + a.suffix
    bs = a.batch_size
    lines = [f"# Position tolerance — {a.model}", "",
             f"{a.n_seq} sequences × {a.seq_len} tokens (pydoc prose), target = last {a.target_len} tokens, "
             f"swaps in [1, {a.seq_len - a.target_len}), seeds {a.seeds}. CIs: 95 % bootstrap over sequences.", ""]

    # ---- T1 / T2, trained and random twin
    if not a.skip_t12:
        lines += run_t12(a, model, tokens, out, tag, times)

    # ---- T3
    if not (a.no_length or a.skip_t12):
        t0 = time.time()
        L = pd.concat([tol.length_curve(model, tokens, cap=c, bucket=64) for c in (None, a.cap)])
        ls = tol.length_summary(L)
        ls.to_csv(out / f"length_{tag}.csv", index=False)
        plot_length(ls, title=f"{a.model}: T3").savefig(out / f"fig_length_{tag}.png", dpi=120)
        times["T3"] = time.time() - t0
        lines += [f"## T3: NLL by position bucket, uncapped vs distance cap {a.cap} (within {a.seq_len} tokens)", "",
                  md(ls, None, 4), ""]

    # ---- causal test
    t0 = time.time()
    layers = a.layers if a.layers else list(range(spec.n_layers // 3, 2 * spec.n_layers // 3))
    nb = spec.layer(layers[0]).n_bands
    q = max(1, nb // 4)
    fast, slow = list(range(q)), list(range(nb - q, nb))
    km = key_means(model, ref[:, : a.seq_len - a.target_len], layers)
    lay = f"L{layers[0]}–{layers[-1]}"
    destroy = [Intervention("destroy", fast, layers=layers, alpha=al, label=f"destroy fast {fast[0]}–{fast[-1]} {lay} @{al:g}")
               for al in sorted(a.alphas)]
    d1 = destroy[-1] if a.match_alpha is None else next(d for d in destroy if d.alpha == a.match_alpha)
    base = tol.nll_on_target(model, tokens, target_len=a.target_len, batch_size=bs)
    ctrl, target, dmg_c = matched_control(model, tokens, d1, km, a, base, lay)
    notes = [f"control for `{d1.label}`: target damage {target:.4f}, control damage {dmg_c:.4f} at α={ctrl.alpha:.3g}"]
    ivs = destroy + [ctrl]
    pairs = [(d1.label, ctrl.label)]
    enf = Intervention("enforce", fast, layers=layers, label=f"enforce fast {fast[0]}–{fast[-1]} {lay} @1")
    if a.enforce_control:
        ectrl, et, ed = matched_control(model, tokens, enf, km, a, base, lay)
        notes.append(f"control for `{enf.label}`: target damage {et:.4f}, control damage {ed:.4f} at α={ectrl.alpha:.3g}")
        ivs += [enf, ectrl]
        pairs += [(enf.label, ectrl.label)]
    if not a.minimal:
        slow_iv = Intervention("destroy", slow, layers=layers, label=f"control: destroy slow {slow[0]}–{slow[-1]} {lay} @1")
        ivs += ([] if a.enforce_control else [enf]) + [slow_iv]
        pairs += ([] if a.enforce_control else [(enf.label, ctrl.label)]) + [(d1.label, slow_iv.label)]
    times["matched_alpha"] = time.time() - t0
    rows = tol.tolerance_rows(model, tokens, ivs, k_means=km, fracs=a.causal_fracs, seeds=a.seeds,
                              target_len=a.target_len, mode="T1", batch_size=bs)
    rows.to_csv(out / f"causal_rows_{tag}.csv", index=False)
    summary = tol.summarize_tolerance(rows)
    summary.to_csv(out / f"causal_summary_{tag}.csv", index=False)
    table = pd.concat([tol.causal_table(summary, {iv: c}) for iv, c in pairs], ignore_index=True)
    table.to_csv(out / f"causal_table_{tag}.csv", index=False)
    plot_dose_response(summary, title=f"{a.model}: dose–response ({lay})").savefig(out / f"fig_dose_{tag}.png", dpi=120)
    times["causal"] = time.time() - t0
    pcols = [c for c in summary.columns if c.startswith("dnll@") and not c.endswith(("_lo", "_hi"))]
    lines += [f"## Causal test (T1, keys, layers {lay}; fast = bands {fast[0]}–{fast[-1]}, slow = {slow[0]}–{slow[-1]} of {nb})", "",
              "k̄ from 4 disjoint reference sequences (context part). Control α matched by bisection on clean damage; "
              + "; ".join(notes) + ".", "",
              md(summary, ["intervention", "alpha", "n_seq", "clean_nll", "damage", "damage_lo", "damage_hi", *pcols,
                           "slope", "slope_lo", "slope_hi", "dslope", "dslope_lo", "dslope_hi",
                           "dslope_per_damage", "dslope_per_damage_lo", "dslope_per_damage_hi"], 4), "",
              "Intervention vs control (`depends` only if slope CIs separate or the paired difference CI excludes 0):", "",
              md(table, ["intervention", "control", "damage", "control_damage", "slope", "slope_lo", "slope_hi",
                         "control_slope", "control_slope_lo", "control_slope_hi", "diff", "diff_lo", "diff_hi", "n_seq", "damage_matched", "verdict", "direction"], 4), ""]
    times["total"] = time.time() - t00
    lines += ["Wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()), ""]
    (out / f"tolerance_{tag}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
