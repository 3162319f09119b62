"""Cells of notebooks 2 and 3 (imported by make_notebooks.py)."""


def feature_pattern_nb(md, code, SETUP):
    return [
        md("""
# 2 · The feature pattern in the RoPE planes, and random twins

Why does `W ≈ f + g` work? The bound says: it is exact when keys are the same for every
token in the fast-rotating bands. Here we measure, per band, how token-invariant the keys
are (offset ratio ρ, in three forms), and compare everything with a **randomly initialised
twin** — the same architecture with fresh weights. A number only means something beside its twin."""),
        code(SETUP),
        code('''model = pg.load_model("smollm2-135m")
layers = [0, 10, 20, 29] if SMALL else None          # all 30 layers when not in CI
n_seq, seq_len = (4, 64) if SMALL else (32, 256)
# windows from many documents; the global mean key k̄ comes from 2 windows of OTHER documents'''),
        md("## Per-band statistics, streamed (memory does not grow with the corpus)"),
        code('''pat = pg.feature_pattern_with_twin(model, None, seed=0, layers=layers, n_seq=n_seq, seq_len=seq_len, n_ref=2)
pat.heads.groupby("twin")[["pred_d3_err_global", "pred_d3_err_per_sequence", "fast_key_rho_within",
                           "fast_key_rho_cross", "fast_key_stability"]].median()'''),
        md("""ρ_within: how constant a band is INSIDE one text; ρ_cross: the part of that constant shared ACROSS
texts (cross-fitted over two halves of the documents, unbiased). The random twin's keys are nearly
constant within a text but that constant changes from text to text; the trained model's is shared."""),
        code('''pg.plot_band_heatmaps(pat.bands, which="k", stat="rho_cross")'''),
        code('''pg.plot_band_heatmaps(pat.bands, which="k", stat="rho_within")'''),
        md("The energy share shows which frequencies each layer uses:"),
        code('''pg.plot_band_heatmaps(pat.bands, which="k", stat="energy_share")'''),
        md("## Does the pattern explain the decomposition, head by head?"),
        code('''dec = pg.decompose_with_twin(model, None, seed=0, layers=layers, n_seq=n_seq, seq_len=seq_len, n_ref=2)
merged, summary = pg.link_to_decomposition(pat.heads, dec, on=("twin", "layer", "head"))
summary  # Spearman across heads, each twin and k̄ kind apart (never pooled)'''),
        code('''pg.plot_pattern_vs_d3(merged, k_mean="global")'''),
        md("""**Read it honestly:** D1 (the free additive fit) scores about as well on the random twin as on the
trained model. D3 with each sequence's own k̄ ALSO fits the twin; only with one global k̄ (from other
documents) does the twin fall behind. Compare the rows:"""),
        code('''pg.summarize_decomposition(dec, by=("twin", "k_mean", "estimator")).round(3)'''),
        md("## Phases of one band"),
        code('''tokens = pg.corpus_tokens(model, None, seq_len=seq_len, n_seq=1)
pg.plot_phase_histogram(model, tokens, layer=10, head=0, band=0, which="k")'''),
    ]


def patching_nb(md, code, SETUP):
    return [
        md("""
# 3 · Patching the pattern: does position tolerance depend on it? (course exercise)

**Goal.** Language models barely mind if a few neighbouring tokens are swapped. We measure that
tolerance, then *intervene* on the feature pattern from notebook 2 with ordinary TransformerLens
hooks, and ask whether tolerance changes **more than under a control that does the same amount of
damage**. You will meet the three traps of causal claims in interpretability: floor effects,
unmatched controls, and too few samples.

Exercises are marked **✎**; a worked answer follows each."""),
        code(SETUP),
        code('''model = pg.load_model("smollm2-135m")
n_seq, seq_len, target = (2, 96, 24) if SMALL else (8, 256, 64)
tokens = pg.corpus_tokens(model, None, seq_len=seq_len, n_seq=n_seq)
fracs = (0.0, 0.1, 0.2) if SMALL else (0.0, 0.05, 0.1, 0.2)'''),
        md("""## 1. Tolerance, measured
T1 swaps a fraction *p* of adjacent token pairs in the context (never the last `target` tokens) and
reads the NLL of the untouched target span. T2 applies the same swaps to the **position ids only**."""),
        code('''curves = pg.transposition_curve(model, tokens, fracs=fracs, seeds=(0,), target_len=target, modes=("T1", "T2"))
summary = pg.curve_summary(curves, by=("mode",))
summary'''),
        code('''pg.plot_tolerance_curves(summary, title="SmolLM2: ΔNLL vs swap fraction")'''),
        md("""**✎ Exercise 1.** Is T1 ≈ T2? Use `pg.t1_vs_t2(curves)` and read the CI of the paired difference.

*Answer:* `t1_vs_t2` gives the paired difference per p and for the slope; `alike` means the CI contains 0."""),
        code('''pg.t1_vs_t2(curves)'''),
        md("""## 2. An intervention is just a list of hooks
`Intervention("destroy", bands=...)` removes each key's token-invariant offset k̄ in the chosen bands
(pre-rotation keys). It needs k̄, measured on the context part of the tokens."""),
        code('''k_means = pg.key_means(model, tokens[:, : seq_len - target])
mid = list(range(10, 12)) if SMALL else list(range(10, 20))
destroy = pg.Intervention("destroy", bands=range(8), layers=mid, alpha=0.5)
hooks = pg.intervention_hooks(model, destroy, k_means)
print(len(hooks), "hooks, e.g.", hooks[0][0])
with model.hooks(fwd_hooks=hooks):                 # plain TransformerLens usage
    nll = pg.nll_on_target(model, tokens, target_len=target)
base = pg.nll_on_target(model, tokens, target_len=target)
print("clean NLL", float(base.mean()), "→ with intervention", float(nll.mean()))'''),
        md("""**✎ Exercise 2.** A no-op patch must change nothing. Check that `pg.noop_hooks(model)` leaves the
logits bit-identical.

*Answer:*"""),
        code('''with torch.no_grad():
    clean = model(tokens[:1])
    with model.hooks(fwd_hooks=pg.noop_hooks(model)):
        same = model(tokens[:1])
assert torch.equal(clean, same)
torch.equal(clean, same)'''),
        md("""## 3. The control must do the same damage
The intervention raised the clean NLL. Any change that damages the model may also change its
tolerance — so we compare with a **random-band control** (same per-token change norm, placed in
random bands with random phases) whose strength is chosen so its clean damage matches."""),
        code('''damage = float((nll - base).mean())
control = pg.Intervention("random_bands", bands=range(8), layers=mid, base="destroy", seed=1)
alpha, control_damage = pg.matched_alpha(model, tokens, control, damage, k_means=k_means, target_len=target,
                                         base=base, max_iter=2 if SMALL else 6)
control = control.with_alpha(alpha)
print(f"intervention damage {damage:.3f}, control alpha {alpha:.2f} → damage {control_damage:.3f}")'''),
        code('''rows = pg.tolerance_rows(model, tokens, [destroy, control], k_means=k_means, fracs=fracs, seeds=(0,),
                         target_len=target)
pg.summarize_tolerance(rows)[["intervention", "clean_nll", "damage", "slope", "slope_lo", "slope_hi"]]'''),
        code('''pg.causal_table(rows, {destroy.label: control.label})'''),
        md("""**✎ Exercise 3.** The verdict says `depends` only if the damages match *and* the paired slope
difference excludes 0. With 2 sequences (the CI setting), what do you expect, and why is
"no evidence" not the same as "no effect"?

*Answer:* with so few sequences the bootstrap CIs are wide, so a null is expected; it only says the
data cannot separate the two. The README reports the same test with 8 sequences × 2 seeds.

**✎ Exercise 4 (open).** Repeat at `alpha=1.0`. The damage grows a lot; what happens to both slopes,
and why does METHOD.md call this a floor effect?"""),
    ]
