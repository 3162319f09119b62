"""posgen_tl — how RoPE language models tolerate positions, read through TransformerLens hooks.

The common path is here (``import posgen_tl as pg``)::

    model = pg.load_model("smollm2-135m")
    tokens = pg.corpus_tokens(model, seq_len=256, n_seq=8)
    res = pg.decompose_head(model, tokens, layer=15, head=3)
    pg.plot.head_maps(res)

Everything else lives in namespaces, imported on first use (PEP 562), so ``import posgen_tl``
stays light: ``pg.plot`` (figures), ``pg.stats`` (sign-flip tests, bootstrap, Holm, TOST),
``pg.rope`` (RoPE maths, the causal mask), ``pg.decompose`` (D1/D2/D3 on tensors),
``pg.features`` (per-band statistics), ``pg.heads`` (taxonomy maths), ``pg.perturb``
(transpositions), ``pg.interventions`` (edits as TransformerLens hooks), ``pg.analysis``
(one runner per experiment), ``pg.studies`` (the recipes behind ``posgen-tl study NAME``).

Layers (data flows one way):
    corpus → models + capture (hooks) → rope / decompose / features / heads / perturb / stats
    (pure maths) → analysis (DataFrames) → plot / report / studies / cli / notebooks
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .compat import check_supported as _check_supported  # noqa: E402  (importlib.metadata only: light)

_check_supported()  # a TransformerLens outside the supported range fails here, naming both versions

#: top-level name → module that defines it (imported on first access)
_EXPORTS: dict[str, str] = {
    # models, text, hooks
    "load_model": "models",
    "random_twin": "models",
    "corpus_tokens": "corpus",
    "document_windows": "corpus",
    "rope_spec": "rope_spec",
    "probe_hooks": "capture",
    "capture_qk": "capture",
    "stream_qk": "capture",
    "exactness_table": "exactness",
    # decomposition (METHOD §2)
    "decompose_head": "analysis.head",
    "decompose_model": "analysis.decomposition",
    "decompose_with_twin": "analysis.decomposition",
    # feature pattern (§3), head taxonomy (§6)
    "feature_pattern": "analysis.pattern",
    "feature_pattern_with_twin": "analysis.pattern",
    "head_taxonomy": "analysis.taxonomy",
    # interventions and tolerance (§4–§5)
    "Intervention": "interventions",
    "intervention_hooks": "interventions",
    "key_means": "interventions",
    "nll_on_target": "analysis.tolerance",
    "transposition_curve": "analysis.tolerance",
    "causal_study": "analysis.causal",
    # errors
    "RopeError": "rope",
    "CaptureError": "capture",
    "CorpusError": "corpus",
    "ModelLoadError": "models",
}

#: namespaces (submodules) in ``__all__``; the other submodules resolve too, lazily
_NAMESPACES = ("plot", "stats", "analysis", "interventions", "studies")
_SUBMODULES = frozenset({
    *_NAMESPACES, "rope", "rope_spec", "decompose", "features", "heads", "perturb", "capture", "corpus",
    "models", "exactness", "report", "cli", "compat",
})

#: recipes other branches add; they resolve here as soon as their module exists
_LATER: dict[str, str] = {
    "sufficiency": "analysis.sufficiency",
    "gap_probe": "analysis.length",
}

__all__ = [*_EXPORTS, *_NAMESPACES]


class _Package(types.ModuleType):
    """``posgen_tl`` itself. Importing a submodule binds it on the package; ``rope_spec`` is both a
    submodule and the function of the same name, and ``pg.rope_spec`` must stay the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return  # the submodule stays reachable through sys.modules / ``from posgen_tl.rope_spec import ...``
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _EXPORTS or name in _LATER:
        mod = _EXPORTS.get(name) or _LATER[name]
        try:
            value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{mod}":
                raise
            raise AttributeError(f"posgen_tl.{name} needs posgen_tl.{mod}, which this installation does not have") from None
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"posgen_tl.{name} is not part of this installation") from None
        globals()[name] = value
        return value
    raise AttributeError(f"module 'posgen_tl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


if TYPE_CHECKING:  # for editors and type checkers; nothing is imported at run time
    from . import analysis, interventions, plot, stats, studies
    from .analysis.decomposition import decompose_model, decompose_with_twin
    from .analysis.head import decompose_head
    from .analysis.pattern import feature_pattern, feature_pattern_with_twin
    from .analysis.taxonomy import head_taxonomy
    from .analysis.causal import causal_study
    from .analysis.tolerance import nll_on_target, transposition_curve
    from .capture import CaptureError, capture_qk, probe_hooks, stream_qk
    from .corpus import CorpusError, corpus_tokens, document_windows
    from .exactness import exactness_table
    from .interventions import Intervention, intervention_hooks, key_means
    from .models import ModelLoadError, load_model, random_twin
    from .rope import RopeError
    from .rope_spec import rope_spec
