"""Where does the damage of perturbed positions live? Activation patching per head (docs/method.md §9).

Each analysed window runs clean (ids ``0 … n−1``) and corrupted (the same tokens at perturbed ids: T2 swaps of a
fraction of adjacent pairs, a gap past the trained context before the target span, or the null uniform shift); per
(quantity, direction) every head of the chosen layers is patched alone, and every layer as a whole
(:mod:`posgen_tl.patching`). The metric is the target span's NLL, with the KL to the clean run's next-token
distributions beside it.

Per document the EFFECT of a patch is the part of the damage it accounts for — denoising (clean → corrupted):
``corrupted − patched``; noising (corrupted → clean): ``patched − clean`` — in nats; a head's normalised recovery is the
ratio of its mean effect to the mean damage ``corrupted − clean`` (a ratio of means: a document with no damage adds
nothing instead of dividing by zero), with a document-bootstrap interval. Heads are tested together: max-T sign-flip
over documents (:func:`posgen_tl.stats.familywise.maxt_signflip`), so the list of significant heads holds a false one
with probability ≤ α. Where the corruption did no damage distinguishable from 0 the recovery is undefined and is not
drawn.

:func:`run` returns a frozen :class:`Result`; :func:`render` turns it into a report section; :func:`save` / :func:`load`
keep one in a folder; with ``checkpoint`` each finished batch of windows is kept, so an interrupted run continues where
it stopped.
"""

from __future__ import annotations

import dataclasses
import itertools
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
from posgen_tl.hooks.memory import logit_row_bytes
from posgen_tl.hooks.patching import TERMS
from posgen_tl.io.checkpoint import Pieces
from posgen_tl.io.provenance import git_commit
from posgen_tl.io.sampling import Windows, check_disjoint, sample_windows
from posgen_tl.stats.familywise import maxt_signflip
from posgen_tl.stats.inference import bootstrap_ci, ratio_ci
from posgen_tl.stats.taxonomy_tables import taxonomy_link

__all__ = ["NAME", "ABOUT", "NEEDS", "TITLE", "TABLES", "Config", "Result", "run", "run_or_skip", "save", "load",
           "render", "corruption_of", "corruptions_of", "headline_findings", "ranked", "taxonomy_link", "upgrade"]

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
                                           "shift (every id + 1000: the null control); several, comma-separated "
                                           "(swaps,gap), are each swept on the same windows", "text")
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
    layers: str | tuple[int, ...] = base.option("every10", "layers whose heads are patched (every10: every 10th and "
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
    replicas: int = base.option(0, "patches per forward, stacked (0: a layer's heads, fewer if memory is short)", "count")
    batch_size: int = base.batch_option(4, auto=True)

    def check(self) -> None:
        """Raise ValueError naming the option: fewer than 3 sequences, an unknown corruption, quantity or direction, a
        swap fraction outside (0, 0.5], a target that does not fit, α outside (0, 1)."""
        if self.n_seq < 3:
            raise ValueError(f"{NAME}: n_seq={self.n_seq}: a test over documents needs at least 3")
        names = self.corruptions()
        if not names or any(c not in CORRUPTIONS for c in names) or len(set(names)) < len(names):
            raise ValueError(f"{NAME}: corruption={self.corruption!r}; one or more distinct names of "
                             f"{', '.join(CORRUPTIONS)}, comma-separated")
        bad = [q for q in self.quantities if q not in P.QUANTITIES]
        if bad or not self.quantities:
            raise ValueError(f"{NAME}: quantities {bad or '(none)'}; choose from {', '.join(P.QUANTITIES)}")
        badd = [d for d in self.directions if d not in DIRECTIONS]
        if badd or not self.directions:
            raise ValueError(f"{NAME}: directions {badd or '(none)'}; choose from {', '.join(DIRECTIONS)}")
        if "swaps" in names and not 0 < self.frac <= 0.5:
            raise ValueError(f"{NAME}: frac={self.frac} must be in (0, 0.5]")
        if not 0 < self.target() < self.seq_len - 2:
            raise ValueError(f"{NAME}: target_len={self.target()} must be in (0, {self.seq_len - 2})")
        if not 0 < self.test_alpha < 1:
            raise ValueError(f"{NAME}: test_alpha={self.test_alpha} must be in (0, 1)")
        if self.taxonomy is not None and not Path(self.taxonomy).is_file():
            raise ValueError(f"{NAME}: taxonomy={self.taxonomy!r} is not a file (a taxonomy study's heads.csv)")

    def corruptions(self) -> tuple[str, ...]:
        """The corruption names ``corruption`` lists, in its order (``"swaps,gap"`` → ``("swaps", "gap")``)."""
        return tuple(c.strip() for c in str(self.corruption).split(",") if c.strip())

    def target(self) -> int:
        """The target length in tokens (``target_len``, or ``min(32, seq_len // 4)`` when it is 0)."""
        return self.target_len or min(32, self.seq_len // 4)


def corruption_of(cfg: Config, n_ctx: int, name: str | None = None) -> P.Corruption:
    """The :class:`posgen_tl.patching.Corruption` called ``name`` with a Config's options (``gap = 0``: the trained
    context ``n_ctx``); ``name`` may be left out when the Config names one corruption.

    Raises:
        ValueError: ``name`` left out while the Config names several, or not one the Config names."""
    names = cfg.corruptions()
    if name is None:
        if len(names) != 1:
            raise ValueError(f"{NAME}: the config names {len(names)} corruptions ({cfg.corruption}); say which")
        name = names[0]
    if name not in names:
        raise ValueError(f"{NAME}: corruption {name!r} is not among the config's ({cfg.corruption})")
    if name == "swaps":
        return P.Swaps(cfg.frac, seed=cfg.seed)
    if name == "gap":
        return P.Gap(cfg.gap or int(n_ctx))
    return P.Shift(1000)


def corruptions_of(cfg: Config, n_ctx: int) -> dict[str, P.Corruption]:
    """Every corruption a Config names, ``{name: Corruption}`` in its order (:func:`corruption_of`)."""
    return {c: corruption_of(cfg, n_ctx, c) for c in cfg.corruptions()}


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


def _batch_rows(model: Any, w: Windows, cfg: Config, corrs: dict[str, P.Corruption], layers: list[int],
                km: dict | None, n_idx: dict[str, int], km_random: dict | None = None) -> list[dict[str, Any]]:
    """Unit rows of one batch of windows: per document × (corruption, quantity, direction, level, layer, head) the
    patched metrics and both baselines (one clean run serves every corruption)."""
    toks = w.tokens
    metric = P.target_metrics(model, toks, cfg.target())
    docs, starts = w.doc_ids.tolist(), w.starts.tolist()
    rows: list[dict[str, Any]] = []
    jobs = [(q, q, km) for q in cfg.quantities]
    if km_random is not None:
        jobs += [(q + RANDOM, q, km_random) for q in cfg.quantities if q in TERMS]
    done: dict[tuple[str, str, str], P.PatchSweep] = {}  # a control reuses its term's recording and baselines
    for (cname, corr), (label, q, means) in itertools.product(corrs.items(), jobs):
        heads = [{layer: [h]} for layer in layers for h in range(n_idx[q])]
        whole = [{layer: list(range(n_idx[q]))} for layer in layers]
        for d in cfg.directions:
            sw = P.patch_sweep(model, corr, toks, metric, quantity=q, groups=heads + whole, direction=d,  # type: ignore[arg-type]
                               k_means=means if q in TERMS else None, doc_ids=docs, starts=starts,
                               replicas=cfg.replicas or None, reuse=done.get((cname, q, d)))
            done.setdefault((cname, q, d), sw)
            labels = [("head", layer, h) for layer in layers for h in range(n_idx[q])] + \
                     [("layer", layer, -1) for layer in layers]
            for g, (level, layer, h) in enumerate(labels):
                for i in range(len(w)):
                    rows.append(dict(doc=int(docs[i]), seq=i, corruption=cname, quantity=label, direction=d,
                                     level=level, layer=layer, head=h, nll=float(sw.values[g, i, 0]), kl=float(sw.values[g, i, 1]),
                                     clean_nll=float(sw.clean[i, 0]), corrupted_nll=float(sw.corrupted[i, 0]),
                                     corrupted_kl=float(sw.corrupted[i, 1])))
    return rows


def _unit_order(u: pd.DataFrame) -> pd.DataFrame:
    """The unit rows in an order the batches do not change: each patch (corruption, quantity, direction, level, layer,
    head) in the order the sweep first ran it, its sequences in order."""
    g = u.groupby(["corruption", "quantity", "direction", "level", "layer", "head"], sort=False).ngroup()
    return u.assign(_g=g).sort_values(["_g", "seq"], kind="stable", ignore_index=True).drop(columns="_g")


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
    for (c, level, q, d), g in u.groupby(["corruption", "level", "quantity", "direction"], sort=False):
        piv = g.pivot_table(index="doc", columns=["layer", "head"], values="effect", aggfunc="mean")
        dmg = g.groupby("doc")["damage"].mean().reindex(piv.index).to_numpy()
        fw = maxt_signflip(piv.to_numpy(), n_perm=cfg.n_perm, seed=cfg.seed)
        kind = fw["p_kind"]
        kl = g.groupby(["doc", "layer", "head"])["kl_effect"].mean().groupby(["layer", "head"]).mean()  # per doc
        rows = []
        for j, (layer, h) in enumerate(piv.columns):
            e = piv.iloc[:, j].to_numpy()
            m, lo, hi = bootstrap_ci(e, seed=cfg.seed)
            rec, rlo, rhi = ratio_ci(e, dmg, seed=cfg.seed)
            rows.append(dict(corruption=c, quantity=q, direction=d, layer=int(layer), head=int(h), n_docs=len(e),
                             effect=m,
                             ci_low=lo, ci_high=hi, ci_level=0.95, recovery=rec, recovery_low=rlo, recovery_high=rhi,
                             kl_effect=float(kl.loc[(layer, h)]), t=float(fw["t"][j]), p_fwe=float(fw["p_fwe"][j]),
                             p_kind=fw["p_kind"], significant=bool(fw["p_fwe"][j] <= cfg.test_alpha),
                             sign="repairs" if m > 0 else "worsens"))
        out[str(level)].append(pd.DataFrame(rows))
    cat = {k: pd.concat(v, ignore_index=True) if v else pd.DataFrame() for k, v in out.items()}
    if len(cat["layer"]):
        cat["layer"] = cat["layer"].drop(columns="head")
    return cat["head"], cat["layer"], kind


def _baselines(u: pd.DataFrame) -> pd.DataFrame:
    """Per corruption and document (its windows averaged, as everywhere): clean and corrupted NLL, the corrupted
    run's KL, damage."""
    w = u.drop_duplicates(["corruption", "seq"])[["corruption", "doc", "seq", "clean_nll", "corrupted_nll",
                                                  "corrupted_kl"]]
    b = w.groupby(["corruption", "doc"], sort=False)[["clean_nll", "corrupted_nll", "corrupted_kl"]].mean()
    b = b.reset_index().sort_values(["corruption", "doc"], key=_in_order(u), kind="stable", ignore_index=True)
    b["damage"] = b["corrupted_nll"] - b["clean_nll"]
    return b


def _in_order(u: pd.DataFrame) -> Any:
    """A sort key that keeps the corruptions in the order the run swept them (documents in number order)."""
    order = {c: i for i, c in enumerate(dict.fromkeys(u["corruption"]))}
    return lambda col: col.map(order) if col.name == "corruption" else col


@base.shares_heap
@torch.no_grad()
def run(model: Any, cfg: Config | None = None, *, corpus: Any = None, windows: Windows | None = None,
        twin: Any = None, checkpoint: str | Path | None = None, progress: bool = True, **options: Any) -> Result:
    """The sweep on ``windows`` (default: ``cfg.n_seq`` windows of distinct documents of ``corpus``; the global k̄
    from ``cfg.n_ref`` windows of other documents when a logit term is patched), and — unless ``cfg.twin`` is false or
    ``twin`` is ``False`` — the same corruptions' damage on the random-init twin (``twin``: a model or a callable giving
    one, e.g. a report's shared twin; ``None`` builds it). ``options`` change single options of ``cfg`` (default
    :class:`Config`). Returns a :class:`Result`.

    Raises:
        CorpusError: the corpus cannot give the windows. CaptureError: the model cannot deliver a quantity.
        ValueError: a checkpoint of another design in ``checkpoint``."""
    cfg = base.config_of(Config, cfg, options)
    t0, commit = time.time(), git_commit()  # the code that runs is the code at the start
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
    bs = base.auto_batch(cfg, model, int(ana.tokens.shape[1]), len(ana), extra=logit_row_bytes(model, cfg.target()))
    km = key_means(model, ref.tokens, layers, batch_size=bs) if need_km and ref is not None else None
    km_random = random_means(km, cfg.seed) if km is not None and cfg.random_control else None
    corrs = corruptions_of(cfg, spec.n_ctx)
    n_idx = {q: spec.n_kv_heads if q == "rot_k" else spec.n_heads for q in cfg.quantities}  # by quantity
    from posgen_tl.hooks.capture import model_dtype  # noqa: PLC0415

    design = {k: v for k, v in cfg.as_dict().items() if k not in ("test_alpha", "n_perm")}  # statistics only
    fp = dict(format=2, config=design, model=spec.model_name, dtype=str(model_dtype(model)), windows=windows_fingerprint(ana),
              docs=ana.doc_ids.tolist(), starts=ana.starts.tolist(), layers=layers,
              reference=windows_fingerprint(ref) if ref is not None and km is not None else None,
              **({"batch": bs} if cfg.batch_size == 0 else {}))  # an automatic batch: the one it resolved to
    ck = Pieces(checkpoint, fp, "patching")
    starts = list(range(0, len(ana), bs))
    parts: list[pd.DataFrame | None] = [ck.get(f"batch_{i:06d}") for i in range(len(starts))]
    todo = [i for i, got in enumerate(parts) if got is None]
    bar = tqdm(total=len(starts), initial=len(starts) - len(todo), desc=f"{NAME} batches", disable=not progress)
    if len(todo) < len(starts):  # a resumed run says so at once, with the kept batches counted
        bar.set_postfix_str(f"resumed: {len(starts) - len(todo)} kept")
    for i in todo:
        s = starts[i]
        w = ana.subset(range(s, min(s + bs, len(ana))))
        got = pd.DataFrame(_batch_rows(model, w, cfg, corrs, layers, km, n_idx, km_random))
        got["seq"] += s
        parts[i] = ck.rows(f"batch_{i:06d}", _given(got))
        bar.update(1)
    bar.close()
    units = _unit_order(pd.concat([p for p in parts if p is not None], ignore_index=True))
    tables, kind = _statistics(units, cfg)
    b = tables["baselines"]
    if cfg.twin and twin is not False:
        tables["twin"] = _twin_damage(base.twin_of(model, twin, cfg.seed), ana, corrs, cfg, bs)
    meta = dict(model=spec.model_name, n_seq=len(ana), n_docs=ana.n_docs,
                corruption={c: str(k) for c, k in corrs.items()}, layers=layers, target_len=cfg.target(), p_kind=kind,
                damage=_damage(b, cfg.seed), commit=commit, wall_s=time.time() - t0,
                kept_batches=len(starts) - len(todo), n_layers=spec.n_layers,
                n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
                twin_damage=_damage(tables["twin"], cfg.seed) if "twin" in tables else None)
    return Result(tables, cfg.as_dict(), meta)


def restat(result: Result, *, kept_batches: int | None = None) -> Result:
    """``result`` with its statistics recomputed from its kept per-document rows (``units``) by today's code — the
    head and layer maps with their family-wise p, the baselines, the damage and the taxonomy link (no forward runs;
    the random twin's rows are kept as they are). ``kept_batches``: record how many batches the run had kept from an
    interrupted earlier run, where the run itself did not (its page then says so). Returns the new Result."""
    cfg = Config(**{k: v for k, v in result.config.items() if k in {f.name for f in dataclasses.fields(Config)}})
    tables, kind = _statistics(result["units"], cfg)
    if "twin" in result.tables:
        tables["twin"] = result["twin"]
    meta = {**result.meta, "p_kind": kind, "damage": _damage(tables["baselines"], cfg.seed)}
    if kept_batches is not None:
        meta["kept_batches"] = int(kept_batches)
    return Result(tables, result.config, meta)


def _statistics(units: pd.DataFrame, cfg: Config) -> tuple[dict[str, pd.DataFrame], str]:
    """The tables computed from the per-document rows (heads, layers, baselines, units, the taxonomy link where
    ``cfg.taxonomy`` names one) and the p kind: the statistics :func:`run` and :func:`restat` share."""
    heads, lay, kind = _summaries(units, cfg)
    tables = dict(heads=heads, layers=lay, baselines=_baselines(units), units=units)
    if cfg.taxonomy:
        tables["taxonomy_link"] = taxonomy_link(heads, pd.read_csv(cfg.taxonomy), seed=cfg.seed)
    return tables, kind


def _given(rows: pd.DataFrame) -> Any:
    """A ``compute`` for :meth:`Pieces.rows` that returns the rows already computed (kept as they are)."""
    return lambda: rows


def _damage(b: pd.DataFrame, seed: int) -> dict[str, dict[str, Any]]:
    """Per corruption of a per-document table (``corruption, doc, damage``): the mean damage with its 95 %
    document-bootstrap interval and whether the interval excludes 0 (``detected``: recovery is defined)."""
    out = {}
    for c, g in b.groupby("corruption", sort=False):
        m, lo, hi = bootstrap_ci(g["damage"].to_numpy(), seed=seed)
        out[str(c)] = dict(mean=m, ci_low=lo, ci_high=hi, detected=bool(lo > 0 or hi < 0))
    return out


def _twin_damage(twin: Any, ana: Windows, corrs: dict[str, P.Corruption], cfg: Config, bs: int) -> pd.DataFrame:
    """The same corruptions on the random-init ``twin``: per corruption and document clean and corrupted NLL and the
    damage (a twin that does not use positions takes no damage, and a recovery would divide noise by ≈ 0: it gets no
    map)."""
    rows = []
    for s in range(0, len(ana), bs):  # one clean forward per batch of bs windows, one per corruption
        w = ana.subset(range(s, min(s + bs, len(ana))))
        b = P.corrupted_metrics(twin, corrs, w.tokens, P.target_nll(w.tokens, cfg.target()),
                                doc_ids=w.doc_ids.tolist(), starts=w.starts.tolist())
        rows += [dict(corruption=cname, doc=int(d), clean_nll=float(c), corrupted_nll=float(k))
                 for cname in corrs for d, c, k in zip(w.doc_ids.tolist(), b["clean"], b[cname])]
    t = pd.DataFrame(rows).groupby(["corruption", "doc"], sort=False).mean().reset_index()
    t = t.sort_values(["corruption", "doc"], key=_in_order(pd.DataFrame(rows)), kind="stable", ignore_index=True)
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


def upgrade(result: Result) -> Result:
    """A Result saved before several corruptions could be swept in one run (no ``corruption`` column; meta
    ``corruption`` a string, ``damage``/``damage_detected``/``twin_damage`` of the one corruption) in today's form:
    the config's one corruption name added to every table and the meta keyed by it. Today's Results come back
    unchanged."""
    meta = result.meta
    if "skipped" in meta or isinstance(meta.get("corruption"), dict):
        return result
    name = str(result.config.get("corruption", "swaps"))
    tables = {k: (v if "corruption" in v.columns or not len(v.columns) else v.assign(corruption=name)[
        ["corruption", *v.columns]]) for k, v in result.tables.items()}
    dmg = dict(meta.get("damage") or {})
    dmg["detected"] = bool(meta.get("damage_detected", dmg.get("ci_low", 0) > 0 or dmg.get("ci_high", 0) < 0))
    new = {**{k: v for k, v in meta.items() if k != "damage_detected"}, "corruption": {name: str(meta.get("corruption"))},
           "damage": {name: dmg}}
    tw = meta.get("twin_damage")
    new["twin_damage"] = {name: {**tw, "detected": bool(tw["ci_low"] > 0 or tw["ci_high"] < 0)}} if tw else None
    return Result(tables, result.config, new)


def load(folder: str | Path) -> Result:
    """The :class:`Result` :func:`save` wrote into ``folder`` (:func:`posgen_tl.experiments.registry.load`).

    Raises:
        FileNotFoundError: no result of this experiment there."""
    from posgen_tl.experiments import registry  # noqa: PLC0415

    return upgrade(registry.load(NAME, folder))


# ----------------------------------------------------------------------------- render

_WORDS = {"rot_q": "rotated queries", "rot_k": "rotated keys", "pos_term": "positional term f",
          "sem_term": "semantic term g", "remainder": "remainder W − f − g", "pattern": "attention pattern"}
_WORDS.update({k + RANDOM: v + " with a random k̄ (control)" for k, v in list(_WORDS.items())})


def _groups(heads: pd.DataFrame, keys: tuple[str, ...] = ("corruption", "quantity", "direction")) -> Any:
    """``heads`` grouped by the map's keys present in it, in the run's order."""
    return heads.groupby([k for k in keys if k in heads.columns], sort=False)


def ranked(heads: pd.DataFrame, k: int = 10) -> pd.DataFrame:
    """The ``k`` heads with the largest mean effect of each map, with word headers (what a page shows)."""
    rows = []
    several = "corruption" in heads.columns and heads["corruption"].nunique() > 1
    for _, g in _groups(heads):
        top = g.sort_values("effect", ascending=False).head(k)
        for r in top.itertuples():
            rows.append({**({"corruption": r.corruption} if several else {}),
                         "patched": _WORDS.get(str(r.quantity), str(r.quantity)), "direction": r.direction,
                         "layer": r.layer, "head": r.head, "effect (nats)": r.effect,
                         "95 % interval": f"[{r.ci_low:.3g}, {r.ci_high:.3g}]", "recovery": r.recovery,
                         "KL effect (nats)": r.kl_effect, "family-wise p (max-T)": r.p_fwe,
                         "significant": (r.sign if r.significant else "no")})
    return pd.DataFrame(rows)


def _sentence(heads: pd.DataFrame, meta: dict[str, Any], alpha: float) -> str:
    parts = []
    n = int(meta["n_docs"])
    if 2 / 2**n > alpha:  # exact max-T: the identity and its mirror tie, so p ≥ 2/2^n
        parts.append(f"with {n} documents the smallest family-wise p a head can reach is 2/2^{n} = {2 / 2**n:.3g} > "
                     f"α = {alpha:g}: no head can be significant at this n")
    for c, what_c in meta["corruption"].items():
        dmg = meta["damage"][c]
        parts.append(f"{what_c} raised the target NLL by {dmg['mean']:.3g} nats [{dmg['ci_low']:.3g}, "
                     f"{dmg['ci_high']:.3g}] over {n} documents"
                     + ("" if dmg["detected"] else " — no damage distinguishable from 0, so no recovery is defined "
                        "(the maps show the effects in nats)"))
        tw = (meta.get("twin_damage") or {}).get(c)
        if tw:
            parts.append(f"on the random-init twin the same corruption did {tw['mean']:.3g} nats [{tw['ci_low']:.3g}, "
                         f"{tw['ci_high']:.3g}] (a recovery there would divide by ≈ 0: no map)")
        hc = heads[heads["corruption"] == c]
        for q in dict.fromkeys(str(x) for x in hc["quantity"] if not str(x).endswith(RANDOM)):
            said = []
            for (d,), g in _groups(hc[hc["quantity"] == q], ("direction",)):
                sig = g[g["significant"]].sort_values("effect", ascending=False)
                pos, neg = sig[sig["effect"] > 0], sig[sig["effect"] <= 0]
                names = ", ".join(f"L{r.layer}H{r.head}" for r in pos.head(5).itertuples())
                more = f" and {len(pos) - 5} more" if len(pos) > 5 else ""
                what = "account for part of the damage" if d == "denoising" else "do part of the damage alone"
                said.append(f"{d}: {len(pos)} of {len(g)} heads significantly {what}"
                            + (f" ({names}{more})" if len(pos) else "")
                            + (f", {len(neg)} significantly the opposite" if len(neg) else ""))
            ctrl = [f"{int((g['significant'] & (g['effect'] > 0)).sum())} ({d})"
                    for (d,), g in _groups(hc[hc["quantity"] == q + RANDOM], ("direction",))]
            parts.append(f"{_WORDS.get(q, q)} — " + ", ".join(said)
                         + (f"; with a random k̄ (control): {', '.join(ctrl)}" if ctrl else ""))
    parts.append(f"significance: family-wise α = {alpha:g} over each map's heads (max-T sign-flip over documents)")
    return "; ".join(parts) + "."


def _figures(heads: pd.DataFrame, meta: dict[str, Any], alpha: float) -> list[tuple[Any, str]]:
    """One figure per (corruption, patched quantity): its maps in both directions side by side, a logit term's
    random-k̄ control below it, on one colour scale."""
    from posgen_tl.plot.patching import plot_patching_maps  # noqa: PLC0415

    out = []
    for c, gc in heads.groupby("corruption", sort=False):
        for q in dict.fromkeys(str(x) for x in gc["quantity"] if not str(x).endswith(RANDOM)):
            maps = {("random k̄ (control), " if qq.endswith(RANDOM) else "") + str(d): g for qq in (q, q + RANDOM)
                    for (d,), g in _groups(gc[gc["quantity"] == qq], ("direction",))}
            fig = plot_patching_maps(maps, n_layers=meta["n_layers"], title=f"{meta['model']}: {_WORDS.get(q, q)} "
                                     f"patched — {meta['corruption'][c]}", ncols=len(set(gc["direction"])))
            ctrl = " and its random-k̄ control" if (gc["quantity"] == q + RANDOM).any() else ""
            value = ("normalised recovery" if meta["damage"][str(c)]["detected"] else
                     "mean effect in nats (no detectable damage: recovery undefined)")
            out.append((fig, f"{_WORDS.get(q, q)} patched per head ({c}){ctrl}: {value} per head; outlined: "
                             f"significant at family-wise α = {alpha:g} (max-T sign-flip over documents)"))
    return out


def headline_findings(heads: pd.DataFrame, meta: dict[str, Any], alpha: float) -> list[Any]:
    """The pages' headline of a sweep: per corruption, ONE map — the positional term f (else the first patched
    quantity), denoising (else noising) — as "k of H heads" significantly carrying part of the damage at
    family-wise ``alpha``, with ONE head's normalised recovery (mean effect in nats where the damage is not detectable),
    95 % document-bootstrap interval and family-wise p: the strongest significant head, else the strongest head. It is
    selected on these documents, so its interval is not adjusted for that choice (the note says so); the p is."""
    from posgen_tl.report.html import Finding  # noqa: PLC0415

    out = []
    for c, gc in heads.groupby("corruption", sort=False):
        qs = list(dict.fromkeys(gc["quantity"]))
        q = "pos_term" if "pos_term" in qs else qs[0]
        ds = list(dict.fromkeys(gc.loc[gc["quantity"] == q, "direction"]))
        d = "denoising" if "denoising" in ds else ds[0]
        g = gc[(gc["quantity"] == q) & (gc["direction"] == d)]
        dmg = meta["damage"][str(c)]
        rec = bool(dmg["detected"])
        k = int((sig := g["significant"] & (g["effect"] > 0)).sum())
        top = (g[sig] if k else g).sort_values("effect", ascending=False).iloc[0]
        ctrl = gc[(gc["quantity"] == q + RANDOM) & (gc["direction"] == d)]
        kc = int((ctrl["significant"] & (ctrl["effect"] > 0)).sum()) if len(ctrl) else None
        what = (f"{'normalised recovery' if rec else 'effect (nats)'} by the strongest significant head (else the "
                f"strongest head), {_WORDS.get(q, q)} patched ({d}), {meta['corruption'][c]}")
        note = (f"{c}: {'strongest significant head' if k else 'strongest head (none significant)'} "
                f"L{int(top['layer'])}H{int(top['head'])}, selected among {len(g)} on these "
                "documents (its interval is not adjusted for that choice; its p is family-wise)"
                + (f"; the random-k̄ control: {kc} significant heads" if kc is not None else "")
                + ("" if rec else "; no detectable damage, so no recovery is defined")
                + ("; the corruption LOWERED the target NLL, so a positive recovery moves it back up" if dmg["ci_high"] < 0
                   else ""))
        out.append(Finding("patching", f"{k} of {len(g)} heads",
                           effect=float(top["recovery"] if rec else top["effect"]),
                           ci=(float(top["recovery_low"]), float(top["recovery_high"])) if rec else
                           (float(top["ci_low"]), float(top["ci_high"])),
                           p=float(top["p_fwe"]), n=int(meta["n_docs"]), what=what, note=note,
                           p_kind=f"{meta['p_kind']}, family-wise over the map's {len(g)} heads"))
    return out


def render(result: Result) -> Any:
    """The report section: one sentence with the damage and the significant heads per map, per (corruption, patched
    quantity) a figure of layer × head maps of normalised recovery (both directions, a term's random-k̄ control
    below; fixed −1 … 1 scale, family-wise significant heads outlined), the ranked heads, the per-layer patches."""
    from posgen_tl.report.html import Section, figure_to_png, skipped_section  # noqa: PLC0415

    result = upgrade(result)
    t, meta, cfg = result.tables, result.meta, result.config
    if "skipped" in meta:
        return skipped_section(TITLE, meta["skipped"], NAME, meta.get("hint"))
    heads = t["heads"]
    figs = [(figure_to_png(f), cap) for f, cap in _figures(heads, meta, cfg["test_alpha"])]
    sentence = _sentence(heads, meta, cfg["test_alpha"])
    findings = headline_findings(heads, meta, cfg["test_alpha"])
    corr = "; ".join(meta["corruption"].values())
    return Section(TITLE, verdict=sentence,
        paragraphs=[f"{meta['n_seq']} windows of {meta['n_docs']} documents; clean ids 0 … n−1, corrupted: "
                    f"{corr}; metric: mean NLL of the last {meta['target_len']} tokens (tokens never "
                    "change). Effect = the part of the damage a patch accounts for (denoising: corrupted − patched; "
                    "noising: patched − clean); recovery = mean effect / mean damage; KL effect = the same for the "
                    "KL of the target's next-token distributions to the clean run's (denoising: KL removed; "
                    f"noising: KL added). p: {meta['p_kind']}, over every head of a map."
                    + (f" Resumed: {meta['kept_batches']} batches were kept from an earlier, interrupted run; the "
                       "wall time is this run's only." if meta.get("kept_batches") else "")],
        tables=[("Heads with the largest effect per map", ranked(heads)),
                ("Whole layers patched (all heads together)", t["layers"]),
                *([("Positional − symbolic heads (taxonomy labels), mean effect per layer; the layer is the unit",
                    t["taxonomy_link"])] if "taxonomy_link" in t else [])],
        details=[("Every head", heads), ("Per document: clean and corrupted NLL", t["baselines"]),
                 *([("The random-init twin, per document: clean and corrupted NLL", t["twin"])] if "twin" in t else [])],
        figures=figs, findings=findings,
        results=dict(meta=meta, significant=heads[heads["significant"]].to_dict("records")))
