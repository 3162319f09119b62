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
        code('''pg.plot.band_heatmaps(pat.bands, which="k", stat="rho_cross")'''),
        code('''pg.plot.band_heatmaps(pat.bands, which="k", stat="rho_within")'''),
        md("The energy share shows which frequencies each layer uses:"),
        code('''pg.plot.band_heatmaps(pat.bands, which="k", stat="energy_share")'''),
        md("## Does the pattern explain the decomposition, head by head?"),
        code('''dec = pg.decompose_with_twin(model, None, seed=0, layers=layers, n_seq=n_seq, seq_len=seq_len, n_ref=2)
merged, summary = pg.experiments.pattern.link_to_decomposition(pat.heads, dec, on=("twin", "layer", "head"))
summary  # Spearman across heads, each twin and k̄ kind apart (never pooled)'''),
        code('''pg.plot.pattern_vs_d3(merged, k_mean="global")'''),
        md("""**Read it honestly:** D1 (the free additive fit) scores about as well on the random twin as on the
trained model. D3 with each sequence's own k̄ ALSO fits the twin; only with one global k̄ (from other
documents) does the twin fall behind. Compare the rows:"""),
        code('''pg.experiments.decomposition.summarize_decomposition(dec, by=("twin", "k_mean", "estimator")).round(3)'''),
        md("## Phases of one band"),
        code('''tokens = pg.corpus_tokens(model, None, seq_len=seq_len, n_seq=1)
phases = pg.experiments.head_maps.phase_angles_with_twin(model, tokens, layer=10, head=0, band=0, which="k")
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
summary = pg.stats.curve_summary(curves, by=("mode",))   # document means, 95 % bootstrap over documents
summary'''),
        code('''pg.plot.tolerance_curves(summary, title="SmolLM2: ΔNLL vs swap fraction")'''),
        md("""**✎ Exercise 1.** Is T1 ≈ T2? "The CI contains 0" is not an answer: only an equivalence test
(TOST) with a margin stated in advance can say "alike". `pg.experiments.tolerance.t1_t2_study` runs both curves on
windows of many documents, with the random twin, and tests the T1 − T2 area under the curve by TOST at the
margin its Config declares.

*Answer:* read `verdict` and the margin below, and the equivariance note: T1 and T2 differ only in
the causal order among context tokens, so T1 − T2 is a causal-order effect, not "tokens vs ids"."""),
        code('''t12 = pg.experiments.tolerance.t1_t2_study(model, n_seq=max(n_seq, 4), seq_len=seq_len, target_len=target,
                                          fracs=fracs, twin=not SMALL, progress=False)
print(t12.meta["note"])
t12.equivalence[["twin", "t1_auc", "t2_auc", "estimate", "ci_low", "ci_high", "ci_level", "margin", "p", "verdict"]]'''),
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
        md("""**✎ Exercise 2.** A no-op patch must change nothing. Check that `pg.hooks.edits.noop_hooks(model)` leaves the
logits bit-identical.

*Answer:*"""),
        code('''with torch.no_grad():
    clean = model(tokens[:1])
    with model.hooks(fwd_hooks=pg.hooks.edits.noop_hooks(model)):
        same = model(tokens[:1])
assert torch.equal(clean, same)
torch.equal(clean, same)'''),
        md("""## 3. Controls compared at the same damage, and a verdict that survives an exact test
The intervention raised the clean NLL. Any change that damages the model may also change its
tolerance — so `pg.causal_study` runs the intervention and controls (C1 the same change in random bands,
C2 the offset removed in slow bands, C3 the offset rephased, C4 same-norm noise in the same bands) each
at a GRID of strengths, and compares their tolerance only where they did the same damage: every
document's curve of tolerance loss against damage is read at common damage levels, by interpolation.
A pilot on other, disjoint documents sets each grid and the levels before the analysed documents are
looked at; the random controls are drawn afresh for every document."""),
        code('''res = pg.causal_study(model, n_seq=max(n_seq, 4), seq_len=seq_len, target_len=target, fracs=fracs,
                      groups=("10-11",) if SMALL else ("middle",), controls=("C1",) if SMALL else ("C1", "C2", "C3", "C4"),
                      n_ref=4, match_steps=2 if SMALL else 5, progress=False)
res["conditions"]'''),
        code('''label = res["verdicts"]["layers"].iloc[0]
pg.plot.dose_curves(res["curves"][res["curves"]["layers"] == label], res.meta["levels"][label], title=label)'''),
        code('''res["verdicts"][["layers", "verdict", "estimate", "ci_low", "ci_high", "p", "p_iut", "binding", "mde",
                 "n_docs", "reason"]]'''),
        md("""**✎ Exercise 3.** The verdict says `depends` only if destroy changes tolerance (its area under the
ΔNLL-over-p curve differs from the unedited model's at the common damage levels) AND differs, in the
same direction, from every control at the same damage — the largest of those p-values must be below
0.05. With 4 documents, what do you expect, and why is "not detected" not the same as "no effect"?

*Answer:* with 4 documents the smallest exact two-sided sign-flip p is 2/16 = 0.125, so "depends" is
impossible; "not detected" only says the data cannot separate the two — the `mde` column gives the
effect this n could have detected, and a control whose curve never reaches a level makes the entry "not
testable" instead of being dropped. The documentation's results pages have the powered runs.

**✎ Exercise 4 (open).** Look at the figure: where do the control curves lie relative to destroy's at
the dotted damage levels? Repeat with `relative=(0.5, 1.0, 2.0)`: which levels stop being bracketed?"""),
    ]


def length_nb(md, code, SETUP):
    """Notebook 4, "longer texts" (docs/method.md §7) and the sufficiency test (§5): public API only."""
    return [
        md("""
# 4 · Longer texts: unseen distances, LM-Infinite and the "disentangled" approximation

A RoPE model trained on `n_ctx` tokens has never seen a query–key distance above `n_ctx`. Running
it on longer texts is expensive on a CPU, so we use a **gap probe**: a sequence is a prefix ‖ suffix
whose suffix position ids are moved `G` positions further. RoPE logits depend on ids only through
`i − j`, so distances inside prefix and suffix stay natural while every suffix→prefix distance
grows by exactly `G` — past `n_ctx` when `G ≥ n_ctx`. (Shifting *all* ids by a constant changes
no distance and therefore nothing — a test checks it.)

Two fixes from LM-Infinite are hooks on the attention scores: **LM-Infinite** clamps distances
`> C` to `C` (first key kept at its true distance); **disentangled** replaces far logits by
`f(q_i, C) + g_Δ0(q_i, k_j)` — the decomposition of notebook 1 with a global mean key `k̄`."""),
        code(SETUP),
        code('''length, sufficiency = pg.experiments.length, pg.experiments.sufficiency
gap_heads = pg.experiments.gap_attention
sample_windows = pg.io.sampling.sample_windows
reference_key_means = pg.hooks.edits.reference_key_means
lm_infinite_hooks = pg.hooks.logits.lm_infinite_hooks
gap_position_ids = pg.maths.perturb.gap_position_ids
plot_gap_heads, plot_gap_probe, plot_sufficiency = pg.plot.gap_heads, pg.plot.gap_probe, pg.plot.sufficiency

model = pg.load_model("smollm2-135m")
n_ctx = model.cfg.n_ctx
n_seq, half = (2, 32) if SMALL else (16, 256)
print("n_ctx =", n_ctx, "  ids with G = n_ctx:", gap_position_ids(4, 4, n_ctx).tolist())'''),
        md("## 1. The gap probe: vanilla vs LM-Infinite vs disentangled"),
        code('''res = length.gap_probe(model, None, prefix_len=half, suffix_len=half, gaps=(0, 0.5, 1, 2), n_seq=n_seq,
                       n_ref=2 if SMALL else 8, skip=min(16, half // 4), seq_len=2 * half)
res.summary[res.summary.estimator != "nll"].round(3)
plot_gap_probe(res.summary)'''),
        md("""Read the `d_vs_gap0` rows of `vanilla`: if their CIs include 0 the model *tolerates* far distances
for this task (the prefix matters little to the suffix), and the probe shows tolerance, not failure.
`d_vs_vanilla` says whether each fix helps where distances are unseen.

## 2. The same hooks, by hand (they compose with `run_with_hooks`)"""),
        code('''ids = gap_position_ids(half, half, 2 * n_ctx)
win, ref = sample_windows(model, None, n_seq=1 if SMALL else 4, seq_len=2 * half, n_ref=2)  # disjoint documents
hooks = lm_infinite_hooks(model, n_ctx, n_sink=1, position_ids=ids)
for name, h in (("vanilla", []), ("LM-Infinite", hooks)):
    nll = length.span_nll(model, win.tokens, half + 1, position_ids=ids, fwd_hooks=h)
    print(f"{name:12s} suffix NLL {nll.mean():.3f}")
plot_gap_probe(res.summary[res.summary.condition != "disentangled"])'''),
        md("""## 3. Which heads change under the gap?
Seed 003 predicts symbolic heads extrapolate better than positional ones. Without the §6 taxonomy at
hand we group heads by a stated proxy: D3's positional share of the within-row logit variance."""),
        code('''km = reference_key_means(model, ref.tokens)  # global k̄ from the reference documents
heads = gap_heads.gap_attention(model, win, prefix_len=half, suffix_len=half, k_means=km, skip=min(16, half // 4))
gap_heads.head_class_test(heads).round(3)
plot_gap_heads(heads)'''),
        md("""## 4. Sufficiency: replace the logits by f + g in a layer group
If `f + g` carries what the model uses, NLL barely moves; the D1 fit and a wrong `k̄` are the controls."""),
        code('''groups = {"20–29": list(range(20, 30)), "all": list(range(30))} if not SMALL else {"29": [29]}
suf = sufficiency.sufficiency(model, None, n_seq=n_seq, seq_len=2 * half, target_len=half // 2,
                              n_ref=2 if SMALL else 8, groups=groups, sources=("d3", "d1", "wrong_kbar"))
suf.summary[suf.summary.estimator == "dnll"].round(3)
plot_sufficiency(suf.summary)'''),
    ]


def positions_patching_nb(md, code, SETUP):
    """Notebook 5: activation patching over positions — which heads carry the damage of swapped position ids."""

    def solution(s: str):
        c = code(s)
        c.metadata["jupyter"] = {"source_hidden": True}  # collapsed: expand to read the solution
        return c

    return [
        md("""
# 5 · Patching positions: which heads carry the damage of swapped position ids? (course exercise)

Activation patching localises a behaviour: run the model on a clean and a corrupted input, carry one
activation from one run into the other, and see how much of the difference it brings along. Here the two
runs see the **same tokens**; only their **position ids** differ (docs/method.md §9). So the runs are
aligned token by token, and we can ask of every head: does its *positional* part repair the damage?

- **clean**: ids `0 … n−1`; **corrupted**: the same swaps of adjacent pairs as notebook 3's T2, applied to the ids;
- **denoising** (clean → corrupted) measures sufficiency, **noising** (corrupted → clean) necessity;
- patched quantities: rotated queries/keys, or one term of the logits `W = f + g + remainder` —
  `f = s·q_iᵀR_{p_j−p_i}k̄` (positional: depends on q and the distance only) and `g = s·q_iᵀ(k_j − k̄)` (semantic)."""),
        code(SETUP),
        code('''model = pg.load_model("smollm2-135m")
n_seq, seq_len, target = (3, 64, 16) if SMALL else (8, 128, 32)
layers = [10, 20] if SMALL else list(range(0, 30, 3))
ana, ref = pg.io.sampling.sample_windows(model, None, n_seq=n_seq, seq_len=seq_len, n_ref=4)   # disjoint documents
tokens = ana.tokens
k_means = pg.key_means(model, ref.tokens, layers)           # the global k̄ of each layer, from OTHER documents
corrupted = pg.patching.Swaps(0.2)                         # T2: 20 % of adjacent pairs swapped in the ids
metric = pg.patching.target_nll(tokens, target)            # NLL of the last `target` tokens, per sequence
base = pg.patching.baselines(model, corrupted, tokens, metric)
base'''),
        md("""The corrupted run's NLL is higher: the swapped ids did damage. Now patch every head's positional
term f from the clean run into the corrupted one — TransformerLens' `get_act_patch_*` idiom, one value per
(layer, head) and sequence."""),
        code('''f_map = pg.patching.get_act_patch_pos_term(model, corrupted, tokens, metric, k_means=k_means, layers=layers)
recovery = pg.patching.normalised_recovery(f_map.mean(-1), base["clean"].mean(), base["corrupted"].mean())
recovery[layers]        # 1 = this head's f alone repairs all the damage; 0 = nothing'''),
        md("""## The study: many documents, a family-wise head list, the map

One head's number from three documents is noise until tested. `pg.experiments.patching.run` samples windows
of distinct documents, patches every head and every whole layer, and tests all heads of a map together
(max-T sign-flip over documents): the outlined heads hold a false one with probability ≤ 5 %."""),
        code('''res = pg.experiments.patching.run(model, n_seq=n_seq, seq_len=seq_len, target_len=target, layers=tuple(layers),
                                  quantities=("pos_term", "sem_term"), progress=False)
print(pg.experiments.patching.render(res).verdict)'''),
        code('''heads = res["heads"]
pg.plot.patching_heatmap(heads[heads["quantity"] == "pos_term"], n_layers=30, title="positional term f, denoising")'''),
        code('''pg.experiments.patching.ranked(heads, k=5)'''),
        md("""**✎ Exercise 1 (the null control).** Shift *every* id by 1000. Under RoPE no distance changes, so no
metric may move: check that the corrupted run equals the clean one, and that the f-patch map is flat. Then
patch the rotated queries alone under the same shift — why do they move the NLL? *(Solution below: expand.)*"""),
        solution('''shift = pg.patching.Shift(1000)
b0 = pg.patching.baselines(model, shift, tokens, metric)
f0 = pg.patching.get_act_patch_pos_term(model, shift, tokens, metric, k_means=k_means, layers=layers[:1])
q0 = pg.patching.get_act_patch_rot_q(model, shift, tokens, metric, layers=layers[:1])
print("corrupted − clean:", (b0["corrupted"] - b0["clean"]).abs().max().item())
print("f patch − clean:  ", (f0[layers[0]] - b0["clean"]).abs().max().item())
print("rot_q patch − clean:", (q0[layers[0]] - b0["clean"]).abs().max().item())
# f depends on the ids only through distances: flat. A rotated query carries ABSOLUTE angles: patched into the
# shifted run it meets keys rotated 1000 positions further, so that head's every distance moves by 1000.'''),
        md("""**✎ Exercise 2 (f or g?).** Compare the positional-term map with the semantic-term map. Which term
carries the repair, and in which layers? Does the whole-layer patch (`res["layers"]`) exceed the best single
head — backup heads hiding single-head effects?"""),
        solution('''lay = res["layers"]
best = heads.groupby("quantity")["effect"].max()
print(lay[["quantity", "layer", "effect", "ci_low", "ci_high", "recovery", "p_fwe"]])
print("best single head per quantity:", best.to_dict())'''),
        md("""**✎ Exercise 3 (necessity).** Run the study with `directions=("noising",)`: which heads' positional term,
carried from the corrupted run into the clean one, does the damage by itself? Are they the heads that repaired
it? *(With the layer as the unit, not the head: heads of one layer share their input.)*"""),
        solution('''noise = pg.experiments.patching.run(model, n_seq=n_seq, seq_len=seq_len, target_len=target,
                                    layers=tuple(layers), directions=("noising",), progress=False)
both = heads[heads["quantity"] == "pos_term"].merge(noise["heads"], on=["layer", "head"], suffixes=("_den", "_noise"))
both.groupby("layer")[["effect_den", "effect_noise"]].mean()'''),
    ]
