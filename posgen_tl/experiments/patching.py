"""Where does the damage of perturbed positions live? Activation patching per head (docs/method.md §9).

Each analysed window runs clean (ids ``0 … n−1``) and corrupted (the same tokens at perturbed ids: T2 swaps of a
fraction of adjacent pairs, a gap past the trained context before the target span, or the null uniform shift);
per (quantity, direction) every head of the chosen layers is patched alone, and every layer as a whole
(:mod:`posgen_tl.patching`). The metric is the target span's NLL, with the KL to the clean run's next-token
distributions beside it.

Per document the EFFECT of a patch is the part of the damage it accounts for — denoising (clean → corrupted):
``corrupted − patched``; noising (corrupted → clean): ``patched − clean`` — in nats; a head's normalised
recovery is the ratio of its mean effect to the mean damage ``corrupted − clean`` (a ratio of means: a document
with no damage adds nothing instead of dividing by zero), with a document-bootstrap interval. Heads are tested
together: max-T sign-flip over documents (:func:`posgen_tl.stats.familywise.maxt_signflip`), so the list of
significant heads holds a false one with probability ≤ α. Where the corruption did no damage distinguishable
from 0 the recovery is undefined and is not drawn.

:func:`run` returns a frozen :class:`Result`; :func:`render` turns it into a report section; :func:`save` /
:func:`load` keep one in a folder; with ``checkpoint`` each finished batch of windows is kept, so an
interrupted run continues where it stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from posgen_tl import patching as P
from posgen_tl.engine.swaps import windows_fingerprint
from posgen_tl.experiments import base
from posgen_tl.hooks.capture import probe_hooks
from posgen_tl.hooks.edits import key_means
from posgen_tl.hooks.patching import TERMS
from posgen_tl.io.checkpoint import RunFolder
from posgen_tl.io.provenance import git_commit
from posgen_tl.io.sampling import Windows, check_disjoint, sample_windows
from posgen_tl.stats.familywise import maxt_signflip
from posgen_tl.stats.inference import bootstrap_ci

__all__ = ["NAME", "ABOUT", "NEEDS", "TITLE", "TABLES", "Config", "Result", "run", "run_or_skip", "save", "load",
           "render", "corruption_of"]

NAME = "patching"
ABOUT = ("which heads carry the damage of perturbed positions? activation patching of rotated q/k, the positional "
         "term f and the semantic term g per head between clean and T2-swapped (or gap) ids (docs/method.md §9)")
NEEDS: tuple[str, ...] = ()
TITLE = "9 · Where does the damage of perturbed positions live? Activation patching per head (docs/method.md §9)"
#: the tables of a Result, in the order a page shows them
TABLES = ("heads", "layers", "baselines", "units", "twin", "taxonomy_link")
CORRUPTIONS = ("swaps", "gap", "shift")
#: the suffix of a logit term's random-k̄ control in the tables (``pos_term (random k̄)``)
RANDOM = " (random k̄)"
DIRECTIONS = ("denoising", "noising")


@dataclass(frozen=True)
class Config(base.Config):
    """Options of the patching sweep: the corruption, the patched quantities and directions, the layers, n."""

    NAME: ClassVar[str] = NAME
    n_seq: int = base.option(8, "analysed sequences (windows of distinct documents first)", "int", quick=4, full=32)
    target_len: int = base.option(0, "tokens at the end whose NLL is the metric (tokens never change); 0 = min(32, "
                                     "seq_len / 4)", "count")
    corruption: str = base.option("swaps", "the corrupted run's ids: swaps (T2: a fraction of adjacent pairs swapped "
                                           "in the ids), gap (the target span moved past the trained context) or "
                                           "shift (every id + 1000: the null control)", "text")
    frac: float = base.option(0.2, "swaps: fraction of disjoint adjacent pairs swapped (≈ 2·frac of the tokens move)",
                              "float")
    gap: int = base.option(0, "gap: positions between the context and the target span; 0 = the model's trained "
                              "context length", "count")
    quantities: tuple[str, ...] = base.option(("pos_term",), "patched quantities, from rot_q, rot_k, pos_term "
                                              "(f only), sem_term (g only), remainder, pattern", "names",
                                              full=("rot_q", "rot_k", "pos_term", "sem_term"))
    directions: tuple[str, ...] = base.option(("denoising",), "denoising (clean → corrupted: sufficiency) and/or "
                                              "noising (corrupted → clean: necessity)", "names",
                                              full=("denoising", "noising"))
    layers: str | tuple[int, ...] = base.option("every5", "layers whose heads are patched (every5: every 5th and "
                                                "the last)", "layers", full="all")
    n_ref: int = base.n_ref_option(4, quick=2, full=8)
    test_alpha: float = base.option(0.05, "family-wise level α of the significant-head list (per map)", "float")
    taxonomy: str | None = base.option(None, "heads.csv of a taxonomy study of this model: test whether its positional "
                                             "heads carry more effect than its symbolic heads, with the layer as the "
                                             "unit", "text")
    random_control: bool = base.option(True, "beside each logit term, the same patch with k̄ replaced by a random "
                                             "vector of the same norm per kv head (a term patch can have effects of "
                                             "its own)", "bool", quick=False)
    n_perm: int = base.option(20_000, "sign vectors of the max-T test when 2^documents exceeds it", "int")
    replicas: int = base.option(0, "patches per forward, stacked in the batch (0 = the heads of one layer)", "count")
    batch_size: int = base.batch_option(4)

    def check(self) -> None:
        """Raise ValueError naming the option: fewer than 3 sequences, an unknown corruption, quantity or direction, a
        swap fraction outside (0, 0.5], a target that does not fit, α outside (0, 1)."""
        if self.n_seq < 3:
            raise ValueError(f"{NAME}: n_seq={self.n_seq}: a test over documents needs at least 3")
        if self.corruption not in CORRUPTIONS:
            raise ValueError(f"{NAME}: corruption={self.corruption!r}; one of {', '.join(CORRUPTIONS)}")
        bad = [q for q in self.quantities if q not in P.QUANTITIES]
        if bad or not self.quantities:
            raise ValueError(f"{NAME}: quantities {bad or '(none)'}; choose from {', '.join(P.QUANTITIES)}")
        badd = [d for d in self.directions if d not in DIRECTIONS]
        if badd or not self.directions:
            raise ValueError(f"{NAME}: directions {badd or '(none)'}; choose from {', '.join(DIRECTIONS)}")
        if self.corruption == "swaps" and not 0 < self.frac <= 0.5:
            raise ValueError(f"{NAME}: frac={self.frac} must be in (0, 0.5]")
        if not 0 < self.target() < self.seq_len - 2:
            raise ValueError(f"{NAME}: target_len={self.target()} must be in (0, {self.seq_len - 2})")
        if not 0 < self.test_alpha < 1:
            raise ValueError(f"{NAME}: test_alpha={self.test_alpha} must be in (0, 1)")
        if self.taxonomy is not None and not Path(self.taxonomy).is_file():
            raise ValueError(f"{NAME}: taxonomy={self.taxonomy!r} is not a file (a taxonomy study's heads.csv)")

    def target(self) -> int:
        """The target length in tokens (``target_len``, or ``min(32, seq_len // 4)`` when it is 0)."""
        return self.target_len or min(32, self.seq_len // 4)


def corruption_of(cfg: Config, n_ctx: int) -> P.Corruption:
    """The :class:`posgen_tl.patching.Corruption` a Config names (``gap = 0``: the trained context ``n_ctx``)."""
    if cfg.corruption == "swaps":
        return P.Swaps(cfg.frac, seed=cfg.seed)
    if cfg.corruption == "gap":
        return P.Gap(cfg.gap or int(n_ctx))
    return P.Shift(1000)


class Result(base.Result):
    """A patching sweep: ``tables`` (:data:`TABLES`: tidy DataFrames), ``config`` (the Config as a dict) and
    ``meta`` (model, documents, corruption, p kind, wall time, commit; ``skipped`` when it could not run)."""



# ----------------------------------------------------------------------------- the sweep


def random_means(k_means: dict[int, torch.Tensor], seed: int) -> dict[int, torch.Tensor]:
    """The control's k̄: per layer and kv head a random direction (seeded by ``seed`` and the layer) with the norm of
    that head's k̄ — the same patch along a direction the model did not learn."""
    out = {}
    for layer, km in k_means.items():
        g = torch.Generator().manual_seed(int(seed) * 1009 + int(layer))
        u = torch.randn(km.shape, generator=g, dtype=torch.float64)
        out[layer] = (u / u.norm(dim=-1, keepdim=True) * km.double().norm(dim=-1, keepdim=True)).to(km.dtype)
    return out


def _batch_rows(model: Any, w: Windows, cfg: Config, corr: P.Corruption, layers: list[int], km: dict | None,
                n_idx: dict[str, int], km_random: dict | None = None) -> list[dict[str, Any]]:
    """Unit rows of one batch of windows: per document × (quantity, direction, level, layer, head) the patched
    metrics and both baselines."""
    toks = w.tokens
    metric = P.target_metrics(model, toks, cfg.target())
    docs, starts = w.doc_ids.tolist(), w.starts.tolist()
    rows: list[dict[str, Any]] = []
    jobs = [(q, q, km) for q in cfg.quantities]
    if km_random is not None:
        jobs += [(q + RANDOM, q, km_random) for q in cfg.quantities if q in TERMS]
    done: dict[tuple[str, str], P.PatchSweep] = {}  # a control reuses its term's recording and baselines
    for label, q, means in jobs:
        heads = [{layer: [h]} for layer in layers for h in range(n_idx[q])]
        whole = [{layer: list(range(n_idx[q]))} for layer in layers]
        for d in cfg.directions:
            sw = P.patch_sweep(model, corr, toks, metric, quantity=q, groups=heads + whole, direction=d,  # type: ignore[arg-type]
                               k_means=means if q in TERMS else None, doc_ids=docs, starts=starts,
                               replicas=cfg.replicas or None, reuse=done.get((q, d)))
            done.setdefault((q, d), sw)
            labels = [("head", layer, h) for layer in layers for h in range(n_idx[q])] + \
                     [("layer", layer, -1) for layer in layers]
            for g, (level, layer, h) in enumerate(labels):
                for i in range(len(w)):
                    rows.append(dict(doc=int(docs[i]), seq=i, quantity=label, direction=d, level=level, layer=layer,
                                     head=h, nll=float(sw.values[g, i, 0]), kl=float(sw.values[g, i, 1]),
                                     clean_nll=float(sw.clean[i, 0]), corrupted_nll=float(sw.corrupted[i, 0]),
                                     corrupted_kl=float(sw.corrupted[i, 1])))
    return rows


def _effects(u: pd.DataFrame) -> pd.DataFrame:
    den = u["direction"] == "denoising"
    return u.assign(damage=u["corrupted_nll"] - u["clean_nll"],
                    effect=np.where(den, u["corrupted_nll"] - u["nll"], u["nll"] - u["clean_nll"]),
                    kl_effect=np.where(den, u["corrupted_kl"] - u["kl"], u["kl"]))


def _summaries(u: pd.DataFrame, cfg: Config) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """``heads`` and ``layers`` tables: per patch the mean effect, its interval, the normalised recovery, the KL,
    the max-T family-wise p over the map (all heads of one (quantity, direction), or all layers)."""
    u = _effects(u)
    out: dict[str, list[pd.DataFrame]] = {"head": [], "layer": []}
    kind = ""
    for (level, q, d), g in u.groupby(["level", "quantity", "direction"], sort=False):
        piv = g.pivot_table(index="doc", columns=["layer", "head"], values="effect", aggfunc="mean")
        dmg = g.groupby("doc")["damage"].mean().reindex(piv.index).to_numpy()
        fw = maxt_signflip(piv.to_numpy(), n_perm=cfg.n_perm, seed=cfg.seed)
        kind = fw["p_kind"]
        kl = g.groupby(["doc", "layer", "head"])["kl_effect"].mean().groupby(["layer", "head"]).mean()  # per doc
        rows = []
        for j, (layer, h) in enumerate(piv.columns):
            e = piv.iloc[:, j].to_numpy()
            m, lo, hi = bootstrap_ci(e, seed=cfg.seed)
            rec, rlo, rhi = _ratio_ci(e, dmg, seed=cfg.seed)
            rows.append(dict(quantity=q, direction=d, layer=int(layer), head=int(h), n_docs=len(e), effect=m,
                             ci_low=lo, ci_high=hi, ci_level=0.95, recovery=rec, recovery_low=rlo, recovery_high=rhi,
                             kl_effect=float(kl.loc[(layer, h)]), t=float(fw["t"][j]), p_fwe=float(fw["p_fwe"][j]),
                             p_kind=fw["p_kind"], significant=bool(fw["p_fwe"][j] <= cfg.test_alpha),
                             sign="repairs" if m > 0 else "worsens"))
        out[str(level)].append(pd.DataFrame(rows))
    cat = {k: pd.concat(v, ignore_index=True) if v else pd.DataFrame() for k, v in out.items()}
    if len(cat["layer"]):
        cat["layer"] = cat["layer"].drop(columns="head")
    return cat["head"], cat["layer"], kind


def _ratio_ci(e: np.ndarray, dmg: np.ndarray, *, seed: int, n_boot: int = 10_000) -> tuple[float, float, float]:
    """``mean(e) / mean(dmg)`` with a 95 % document-bootstrap interval (NaN where the damage's interval holds 0:
    recovery is undefined without damage)."""
    m_d, lo_d, hi_d = bootstrap_ci(dmg, seed=seed)
    if not (lo_d > 0 or hi_d < 0):
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(e), size=(n_boot, len(e)))
    r = e[idx].mean(1) / dmg[idx].mean(1)
    return float(e.mean() / dmg.mean()), float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))


def _baselines(u: pd.DataFrame) -> pd.DataFrame:
    """Per document (its windows averaged, as everywhere): clean and corrupted NLL, the corrupted run's KL, damage."""
    w = u.drop_duplicates("seq")[["doc", "seq", "clean_nll", "corrupted_nll", "corrupted_kl"]]
    b = w.groupby("doc", sort=True)[["clean_nll", "corrupted_nll", "corrupted_kl"]].mean().reset_index()
    b["damage"] = b["corrupted_nll"] - b["clean_nll"]
    return b


class _Checkpoint(RunFolder):
    """Finished batches of one run in a folder: ``fingerprint.json`` (the design) and ``batch_NNNNNN.csv``."""

    def __init__(self, folder: str | Path, fingerprint: dict[str, Any]):
        super().__init__(folder)
        old = self.read_json("fingerprint")
        if old is not None and old != fingerprint:
            raise ValueError(f"{self.dir} holds a checkpoint of another patching design (config, model or windows "
                             "differ); remove it or choose another output folder")
        self.write_json("fingerprint", fingerprint, indent=1, sort_keys=True)

    def get(self, i: int) -> pd.DataFrame | None:
        return self.read_rows(f"batch_{i:06d}")

    def put(self, i: int, rows: pd.DataFrame) -> None:
        self.write_rows(f"batch_{i:06d}", rows)


@torch.no_grad()
def run(model: Any, cfg: Config | None = None, *, corpus: Any = None, windows: Windows | None = None,
        checkpoint: str | Path | None = None, progress: bool = True, **options: Any) -> Result:
    """The sweep on ``windows`` (default: ``cfg.n_seq`` windows of distinct documents of ``corpus``; the global k̄
    from ``cfg.n_ref`` windows of other documents when a logit term is patched). ``options`` change single
    options of ``cfg`` (default :class:`Config`). Returns a :class:`Result`.

    Raises:
        CorpusError: the corpus cannot give the windows. CaptureError: the model cannot deliver a quantity.
        ValueError: a checkpoint of another design in ``checkpoint``."""
    cfg = base.config_of(Config, cfg, options)
    t0 = time.time()
    spec, _ = probe_hooks(model)
    layers = base.resolve_layers(cfg.layers, spec.n_layers)
    need_km = any(q in TERMS for q in cfg.quantities)
    ref: Windows | None = None
    if windows is None or need_km:
        ana, ref = sample_windows(model, cfg.corpus if corpus is None else corpus, n_seq=cfg.n_seq,
                                  seq_len=cfg.seq_len, n_ref=cfg.n_ref if need_km else 0, seed=cfg.seed)
    if windows is not None:
        ana = windows
        if ref is not None:
            check_disjoint(ana, ref)
    km = key_means(model, ref.tokens, layers, batch_size=cfg.batch_size) if need_km and ref is not None else None
    km_random = random_means(km, cfg.seed) if km is not None and cfg.random_control else None
    corr = corruption_of(cfg, spec.n_ctx)
    n_idx = {q: spec.n_kv_heads if q == "rot_k" else spec.n_heads for q in cfg.quantities}  # by quantity
    from posgen_tl.hooks.capture import model_dtype  # noqa: PLC0415

    design = {k: v for k, v in cfg.as_dict().items() if k not in ("test_alpha", "n_perm")}  # statistics only
    fp = dict(config=design, model=spec.model_name, dtype=str(model_dtype(model)), windows=windows_fingerprint(ana),
              docs=ana.doc_ids.tolist(), starts=ana.starts.tolist(), layers=layers,
              reference=windows_fingerprint(ref) if ref is not None and km is not None else None)
    ck = _Checkpoint(checkpoint, fp) if checkpoint is not None else None
    parts = []
    starts = list(range(0, len(ana), cfg.batch_size))
    for i, s in enumerate(tqdm(starts, desc=f"{NAME} batches", disable=not progress)):
        got = ck.get(i) if ck is not None else None
        if got is None:
            w = ana.subset(range(s, min(s + cfg.batch_size, len(ana))))
            got = pd.DataFrame(_batch_rows(model, w, cfg, corr, layers, km, n_idx, km_random))
            got["seq"] += s
            if ck is not None:
                ck.put(i, got)
        parts.append(got)
    units = pd.concat(parts, ignore_index=True)
    heads, lay, kind = _summaries(units, cfg)
    b = _baselines(units)
    dm, dlo, dhi = bootstrap_ci(b["damage"].to_numpy(), seed=cfg.seed)
    tables = dict(heads=heads, layers=lay, baselines=b, units=units)
    if cfg.taxonomy:
        tables["taxonomy_link"] = taxonomy_link(heads, pd.read_csv(cfg.taxonomy), seed=cfg.seed)
    twin_meta = None
    if cfg.twin:
        tables["twin"] = _twin_damage(model, ana, corr, cfg)
        tm_, tlo, thi = bootstrap_ci(tables["twin"]["damage"].to_numpy(), seed=cfg.seed)
        twin_meta = dict(mean=tm_, ci_low=tlo, ci_high=thi)
    meta = dict(model=spec.model_name, n_seq=len(ana), n_docs=ana.n_docs, corruption=str(corr), layers=layers,
                target_len=cfg.target(), p_kind=kind, damage=dict(mean=dm, ci_low=dlo, ci_high=dhi),
                damage_detected=bool(dlo > 0 or dhi < 0), commit=git_commit(), wall_s=time.time() - t0,
                n_layers=spec.n_layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, twin_damage=twin_meta)
    return Result(tables, cfg.as_dict(), meta)


def taxonomy_link(heads: pd.DataFrame, labels: pd.DataFrame, *, seed: int = 0) -> pd.DataFrame:
    """Do the heads a taxonomy labels ``positional`` carry more patching effect than its ``symbolic`` heads? Per map
    (quantity, direction), per layer holding both kinds among the patched heads: mean effect of its positional heads
    − mean effect of its symbolic heads; the LAYER is the unit (heads of one layer share their input and are not
    independent): mean over layers, 95 % bootstrap over layers, exact sign-flip over layers.

    ``labels``: ``layer, head, label`` (a taxonomy study's ``heads.csv``; rows of its random twin are ignored).
    Returns one row per map: ``quantity, direction, n_layers, estimate, ci_low, ci_high, ci_level, p, p_kind``
    (``n_layers < 3``: no test, NaN)."""
    from posgen_tl.stats.inference import sign_flip  # noqa: PLC0415

    missing = {"layer", "head", "label"} - set(labels.columns)
    if missing:
        raise ValueError(f"the taxonomy table lacks the column(s) {sorted(missing)} (a taxonomy study's heads.csv has them)")
    lab = labels[labels["twin"] == "trained"] if "twin" in labels.columns else labels
    lab = lab[["layer", "head", "label"]]
    rows = []
    for (q, d), g in heads.groupby(["quantity", "direction"], sort=False):
        m = g.merge(lab, on=["layer", "head"])
        per = m[m["label"].isin(["positional", "symbolic"])].groupby(["layer", "label"])["effect"].mean().unstack()
        per = per.dropna() if {"positional", "symbolic"} <= set(per.columns) else per.iloc[0:0]
        diff = (per["positional"] - per["symbolic"]).to_numpy() if len(per) else np.array([])
        row: dict[str, Any] = dict(quantity=q, direction=d, n_layers=len(diff), estimate=np.nan, ci_low=np.nan,
                                   ci_high=np.nan, ci_level=0.95, p=np.nan, p_kind="too few layers with both kinds")
        if len(diff) >= 3:
            est, lo, hi = bootstrap_ci(diff, seed=seed)
            p, kind = sign_flip(diff)
            row.update(estimate=est, ci_low=lo, ci_high=hi, p=p, p_kind=kind)
        rows.append(row)
    return pd.DataFrame(rows)


def _twin_damage(model: Any, ana: Windows, corr: P.Corruption, cfg: Config) -> pd.DataFrame:
    """The same corruption on the random-init twin: per document clean and corrupted NLL and the damage (a twin
    that does not use positions takes no damage, and a recovery would divide noise by ≈ 0: it gets no map)."""
    from posgen_tl.io.models import random_twin  # noqa: PLC0415

    twin = random_twin(model, cfg.seed)
    rows = []
    for s in range(0, len(ana), cfg.batch_size):
        w = ana.subset(range(s, min(s + cfg.batch_size, len(ana))))
        b = P.baselines(twin, corr, w.tokens, P.target_nll(w.tokens, cfg.target()), doc_ids=w.doc_ids.tolist(),
                        starts=w.starts.tolist())
        rows += [dict(doc=int(d), clean_nll=float(c), corrupted_nll=float(k)) for d, c, k in
                 zip(w.doc_ids.tolist(), b["clean"], b["corrupted"])]
    t = pd.DataFrame(rows).groupby("doc", sort=True).mean().reset_index()
    t["damage"] = t["corrupted_nll"] - t["clean_nll"]
    return t


def run_or_skip(model: Any, cfg: Config, **kw: Any) -> Result:
    """:func:`run`, or a Result whose ``meta["skipped"]`` says why when the corpus cannot give the windows or the
    library refuses the model by name (:func:`posgen_tl.experiments.base.run_or_skip`). Any other error propagates."""
    return base.run_or_skip(run, Result, "the patching study", model, cfg, **kw)


# ----------------------------------------------------------------------------- files


def save(result: Result, folder: str | Path) -> list[Path]:
    """:func:`posgen_tl.experiments.registry.save` of this experiment: ``patching_<table>.csv`` per table and
    ``patching_result.json`` (config and meta) in ``folder``. Returns the written paths."""
    from posgen_tl.experiments import registry  # noqa: PLC0415

    return registry.save(NAME, result, folder)


def load(folder: str | Path) -> Result:
    """The :class:`Result` :func:`save` wrote into ``folder`` (:func:`posgen_tl.experiments.registry.load`).

    Raises:
        FileNotFoundError: no result of this experiment there."""
    from posgen_tl.experiments import registry  # noqa: PLC0415

    return registry.load(NAME, folder)


# ----------------------------------------------------------------------------- render

_WORDS = {"rot_q": "rotated queries", "rot_k": "rotated keys", "pos_term": "positional term f",
          "sem_term": "semantic term g", "remainder": "remainder W − f − g", "pattern": "attention pattern"}
_WORDS.update({k + RANDOM: v + " with a random k̄ (control)" for k, v in list(_WORDS.items())})


def ranked(heads: pd.DataFrame, k: int = 10) -> pd.DataFrame:
    """The ``k`` heads with the largest mean effect of each map, with word headers (what a page shows)."""
    rows = []
    for (q, d), g in heads.groupby(["quantity", "direction"], sort=False):
        top = g.sort_values("effect", ascending=False).head(k)
        for r in top.itertuples():
            rows.append({"patched": _WORDS.get(str(q), str(q)), "direction": d, "layer": r.layer, "head": r.head,
                         "effect (nats)": r.effect, "95 % interval": f"[{r.ci_low:.3g}, {r.ci_high:.3g}]",
                         "recovery": r.recovery, "KL effect (nats)": r.kl_effect, "family-wise p (max-T)": r.p_fwe,
                         "significant": (r.sign if r.significant else "no")})
    return pd.DataFrame(rows)


def _sentence(heads: pd.DataFrame, meta: dict[str, Any], alpha: float) -> str:
    dmg = meta["damage"]
    parts = [f"{meta['corruption']} raised the target NLL by {dmg['mean']:.3g} nats [{dmg['ci_low']:.3g}, "
             f"{dmg['ci_high']:.3g}] over {meta['n_docs']} documents"
             + ("" if meta["damage_detected"] else " — no damage distinguishable from 0, so no recovery is defined "
                "(the maps show the effects in nats)")]
    n = int(meta["n_docs"])
    if 2 / 2**n > alpha:  # exact max-T: the identity and its mirror tie, so p ≥ 2/2^n
        parts.append(f"with {n} documents the smallest family-wise p a head can reach is 2/2^{n} = {2 / 2**n:.3g} > "
                     f"α = {alpha:g}: no head can be significant at this n")
    tw = meta.get("twin_damage")
    if tw:
        parts.append(f"on the random-init twin the same corruption did {tw['mean']:.3g} nats [{tw['ci_low']:.3g}, "
                     f"{tw['ci_high']:.3g}] (a recovery there would divide by ≈ 0: no map)")
    for (q, d), g in heads.groupby(["quantity", "direction"], sort=False):
        sig = g[g["significant"]].sort_values("effect", ascending=False)
        pos, neg = sig[sig["effect"] > 0], sig[sig["effect"] <= 0]
        names = ", ".join(f"L{r.layer}H{r.head}" for r in pos.head(5).itertuples())
        more = f" and {len(pos) - 5} more" if len(pos) > 5 else ""
        what = "account for part of the damage" if d == "denoising" else "do part of the damage alone"
        parts.append(f"{_WORDS.get(str(q), q)} ({d}): {len(pos)} of {len(g)} heads significantly {what} at "
                     f"family-wise α = {alpha:g}" + (f" ({names}{more})" if len(pos) else "")
                     + (f", {len(neg)} significantly the opposite" if len(neg) else ""))
    return "; ".join(parts) + "."


def render(result: Result) -> Any:
    """The report section: one sentence with the damage and the significant heads per map, a layer × head heatmap
    of normalised recovery per map (fixed −1 … 1 scale, family-wise significant heads outlined), the ranked heads,
    the per-layer patches."""
    from posgen_tl.plot.patching import plot_patching_heatmap  # noqa: PLC0415
    from posgen_tl.report.html import Finding, Section, figure_to_png, skipped_section  # noqa: PLC0415

    t, meta, cfg = result.tables, result.meta, result.config
    if "skipped" in meta:
        return skipped_section(TITLE, meta["skipped"], NAME, meta.get("hint"))
    heads = t["heads"]
    figs = []
    for (q, d), g in heads.groupby(["quantity", "direction"], sort=False):
        fig = plot_patching_heatmap(g, n_layers=meta["n_layers"],
                                    title=f"{meta['model']}: {_WORDS.get(str(q), q)} patched ({d})")
        figs.append((figure_to_png(fig), f"Normalised recovery per head, {_WORDS.get(str(q), q)}, {d}; outlined: "
                                         f"significant at family-wise α = {cfg['test_alpha']:g} (max-T sign-flip over "
                                         "documents)"))
    sentence = _sentence(heads, meta, cfg["test_alpha"])
    findings = [Finding("patching", f"{int((g['significant'] & (g['effect'] > 0)).sum())} heads",
                        effect=float(g["effect"].max()),
                        what=f"largest per-head effect, {_WORDS.get(str(q), q)} {d} (nats)", n=int(meta["n_docs"]))
                for (q, d), g in heads.groupby(["quantity", "direction"], sort=False)]
    return Section(
        TITLE, verdict=sentence,
        paragraphs=[f"{meta['n_seq']} windows of {meta['n_docs']} documents; clean ids 0 … n−1, corrupted: "
                    f"{meta['corruption']}; metric: mean NLL of the last {meta['target_len']} tokens (tokens never "
                    "change). Effect = the part of the damage a patch accounts for (denoising: corrupted − patched; "
                    "noising: patched − clean); recovery = mean effect / mean damage; KL effect = the same for the "
                    "KL of the target's next-token distributions to the clean run's (denoising: KL removed; "
                    f"noising: KL added). p: {meta['p_kind']}, over every head of a map."],
        tables=[("Heads with the largest effect per map", ranked(heads)),
                ("Whole layers patched (all heads together)", t["layers"]),
                *([("Positional − symbolic heads (taxonomy labels), mean effect per layer; the layer is the unit",
                    t["taxonomy_link"])] if "taxonomy_link" in t else [])],
        details=[("Every head", heads), ("Per document: clean and corrupted NLL", t["baselines"]),
                 *([("The random-init twin, per document: clean and corrupted NLL", t["twin"])] if "twin" in t else [])],
        figures=figs, findings=findings,
        results=dict(meta=meta, significant=heads[heads["significant"]].to_dict("records")))
