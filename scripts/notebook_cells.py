"""Cells of notebooks 2 and 3 (imported by make_notebooks.py). Public API only."""


def feature_pattern_nb(md, code, SETUP):
    return [
        md("""
# 2 · The feature pattern in the RoPE planes, and random twins

Why does `W ≈ f + g` work? The bound says: it is exact when keys are the same for every
token in the fast-rotating bands. Here we measure, per band, how token-invariant the keys
are (offset ratio ρ), and compare everything with a **randomly initialised twin** — the
same architecture with fresh weights. A number only means something beside its twin."""),
        code(SETUP),
        code('''model = pg.load_model("smollm2-135m")
twin = pg.random_twin(model, seed=0)                 # built once, reused by every comparison below
layers = [0, 10, 20, 29] if SMALL else None          # all 30 layers when not in CI
n_seq, seq_len = (2, 64) if SMALL else (16, 256)
tokens = pg.corpus_tokens(model, seq_len=seq_len, n_seq=n_seq + 2)'''),
        md("## Per-band statistics, streamed (memory does not grow with the corpus)"),
        code('''pat = pg.feature_pattern_with_twin(model, tokens[:n_seq], twin=twin, layers=layers, n_seq=n_seq, seq_len=seq_len)
pat.heads.groupby("twin")[["pattern_score", "fast_key_offset", "key_energy_centroid"]].mean()'''),
        code('''pg.plot.band_heatmaps(pat.bands, which="k", stat="offset_ratio")'''),
        md("""In the trained model the fastest key bands carry a large token-invariant offset (ρ near 1); in the
random twin ρ stays low. The energy share shows which frequencies each layer uses:"""),
        code('''pg.plot.band_heatmaps(pat.bands, which="k", stat="energy_share")'''),
        md("## Does the pattern explain the decomposition, head by head?"),
        code('''dec = pg.decompose_with_twin(model, tokens, twin=twin, layers=layers, n_seq=n_seq, seq_len=seq_len, n_ref=2)
pg.plot.r_by_layer(dec)'''),
        code('''merged, summary = pg.analysis.pattern.link_to_decomposition(pat.heads, dec, on=("twin", "layer", "head"))
summary'''),
        code('''pg.plot.pattern_vs_d3(merged)'''),
        md("""**Read it honestly:** D1 (the free additive fit) scores about as well on the random twin as on the
trained model; D3 (the constructive split that uses the measured k̄) does not. And judge the
pattern ↔ D3 relation *within* the trained heads: pooling the two clusters manufactures a
correlation. Compare the rows:"""),
        code('''pg.analysis.decomposition.summarize_decomposition(dec, by=("twin", "estimator")).round(3)'''),
        md("## Phases of one band, trained beside twin"),
        code('''phases = pg.analysis.head.phase_angles_with_twin(model, tokens[:1], layer=10, head=0, band=0, twin=twin)
pg.plot.phase_histogram(phases)'''),
    ]


def patching_nb(md, code, SETUP):
    return [
        md("""
# 3 · Patching the pattern: does position tolerance depend on it? (course exercise)

**Goal.** Language models barely mind if a few neighbouring tokens are swapped. We measure that
tolerance, then *intervene* on the feature pattern from notebook 2 with ordinary TransformerLens
hooks, and ask whether tolerance changes **more than under a control that does the same amount of
damage**. You will meet the three traps of causal claims in interpretability: floor effects,
unmatched controls, and too few samples — and the verdict rule of METHOD.md §8 that guards against them.

Exercises are marked **✎**; a worked answer follows each."""),
        code(SETUP),
        code('''model = pg.load_model("smollm2-135m")
n_seq, seq_len, target = (4, 64, 16) if SMALL else (32, 256, 64)
win = pg.document_windows(model, seq_len=seq_len, n_seq=n_seq)     # one window per document
tokens, docs = win.tokens, win.doc_ids.numpy()
fracs = (0.0, 0.1, 0.2) if SMALL else (0.0, 0.05, 0.1, 0.2)
import pandas as pd
win.frame().head()'''),
        md("""## 1. Tolerance, measured
T1 swaps a fraction *p* of adjacent token pairs in the context (never the last `target` tokens) and
reads the NLL of the untouched target span; ≈ 2p of the context tokens move. T2 applies the same swaps
to the **position ids only**. The random twin is the reference for "how much would any model mind"."""),
        code('''twin = pg.random_twin(model, seed=0)
curves = pd.concat([pg.transposition_curve(m, tokens, fracs=fracs, seeds=(0,), target_len=target, modes=("T1", "T2"),
                                           progress=False).assign(twin=t) for t, m in (("trained", model), ("random", twin))])
summary = pd.concat([pg.analysis.tolerance.curve_summary(g, by=("mode",)).assign(twin=t) for t, g in curves.groupby("twin")])
pg.plot.tolerance_curves(summary, hue="twin", title="SmolLM2 vs its random twin: ΔNLL vs swap fraction")'''),
        md("""**✎ Exercise 1.** Are T1 and T2 *alike*? A confidence interval that contains 0 does **not** say so —
it may just be wide. Only an equivalence test with a stated margin can (`pg.stats.t1_t2_equivalence`, a TOST).

*Answer:* per-sequence slopes of T1 and T2, then the TOST at a margin of 0.5 nats per unit p. Read the note:
T1 − T2 measures the causal-order effect, not "tokens vs ids" (RoPE is equivariant to moving tokens and ids together)."""),
        code('''tr = curves[curves.twin == "trained"]
s1 = pg.stats.per_sequence_slopes(tr[tr["mode"] == "T1"])
s2 = pg.stats.per_sequence_slopes(tr[tr["mode"] == "T2"])
eq = pg.stats.t1_t2_equivalence(s1.to_numpy(), s2.to_numpy(), docs[s1.index], margin=0.5)
print(eq["note"])
{k: eq[k] for k in ("alike", "n_seq", "p_diff")}'''),
        md("""## 2. An intervention is just a list of hooks
`Intervention("destroy", bands=...)` removes each key's token-invariant offset k̄ in the chosen bands
(pre-rotation keys). It needs k̄, measured on **other documents** than the analysed ones."""),
        code('''_, ref = pg.corpus.reference_windows(model, seq_len=seq_len, n_seq=2)
k_means = pg.key_means(model, ref.tokens[:, : seq_len - target])
mid = list(range(10, 12)) if SMALL else list(range(10, 20))
destroy = pg.Intervention("destroy", bands=range(8), layers=mid, alpha=0.5, label="destroy")
hooks = pg.intervention_hooks(model, destroy, k_means)
print(len(hooks), "hooks, e.g.", hooks[0][0])
with model.hooks(fwd_hooks=hooks):                 # plain TransformerLens usage (run_with_hooks works too)
    nll = pg.nll_on_target(model, tokens, target_len=target)
base = pg.nll_on_target(model, tokens, target_len=target)
print("clean NLL", float(base.mean()), "→ with intervention", float(nll.mean()))'''),
        md("""**✎ Exercise 2.** A no-op patch must change nothing. Check that `pg.interventions.noop_hooks(model)`
leaves the logits bit-identical.

*Answer:*"""),
        code('''with torch.no_grad():
    clean = model(tokens[:1])
    same = model.run_with_hooks(tokens[:1], fwd_hooks=pg.interventions.noop_hooks(model))
assert torch.equal(clean, same)
torch.equal(clean, same)'''),
        md("""## 3. The control must do the same damage
The intervention raised the clean NLL. Any change that damages the model may also change its
tolerance — so we compare with a **random-band control** (the same per-token change moved to random
bands with random phases) whose strength α is chosen so its clean damage matches.

**✎ Exercise 3.** Find α by bisection on the clean damage.

*Answer:*"""),
        code('''def damage(iv):
    return float((pg.nll_on_target(model, tokens, target_len=target,
                                   fwd_hooks=pg.intervention_hooks(model, iv, k_means)) - base).mean())

goal = damage(destroy)
control = pg.Intervention("random_bands", bands=range(8), layers=mid, base="destroy", seed=1, label="control")
lo, hi = 0.0, 4.0
for _ in range(3 if SMALL else 8):
    mid_alpha = (lo + hi) / 2
    lo, hi = (mid_alpha, hi) if damage(control.with_alpha(mid_alpha)) < goal else (lo, mid_alpha)
control = control.with_alpha((lo + hi) / 2)
print(f"intervention damage {goal:.3f}, control alpha {control.alpha:.2f} → damage {damage(control):.3f}")'''),
        md("""## 4. Tolerance under each condition, and the verdict
Per sequence: the slope of ΔNLL over p under each condition; the contrast is the paired difference
of slopes, intervention − control. `pg.stats.verdict_table` says **"depends"** only when the Holm-adjusted
exact sign-flip p < 0.05, the damages match, and both halves of the documents agree in sign;
otherwise **"no evidence"**, with the smallest effect this n could have detected."""),
        code('''rows = []
for iv in (destroy, control):
    c = pg.transposition_curve(model, tokens, fracs=fracs, seeds=(0,), target_len=target,
                               fwd_hooks=pg.intervention_hooks(model, iv, k_means), progress=False)
    rows.append(c.assign(intervention=iv.label, base_clean_nll=base.numpy()[c.seq], doc=docs[c.seq]))
rows = pd.concat(rows, ignore_index=True)
contrast = pg.stats.contrast_from_rows(rows, "destroy", "control", primary=True)
table = pg.stats.verdict_table([contrast])
table[["contrast", "n_seq", "mean_diff", "boot_lo", "boot_hi", "p_exact", "p_holm", "damage_matched", "mde", "verdict"]]'''),
        code('''table.loc[0, "reason"]'''),
        md("""**✎ Exercise 4.** With 4 sequences (the CI setting), what verdict do you expect, and why is
"no evidence" not the same as "no effect"?

*Answer:* with 4 sequences the smallest exact sign-flip p is 2/16 = 0.125, so "depends" is impossible
whatever the data; the reason column gives the minimum detectable effect at 80 % power. A null says only
that the data cannot separate the two conditions; and any run with fewer than 32 sequences is
exploratory. The full recipe — controls C1–C4 each matched on damage, attention change, many documents —
is `posgen-tl study` / `pg.analysis` (METHOD §5).

**✎ Exercise 5 (open).** Repeat at `alpha=1.0`. The damage grows a lot; what happens to both slopes,
and why does METHOD.md call this a floor effect?"""),
    ]
