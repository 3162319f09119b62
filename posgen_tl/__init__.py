"""posgen_tl — how RoPE language models tolerate positions, read through TransformerLens hooks.

The common path is here (``import posgen_tl as pg``)::

    model = pg.load_model("smollm2-135m")
    tokens = pg.corpus_tokens(model, seq_len=256, n_seq=8)
    res = pg.decompose_head(model, tokens, layer=15, head=3)
    pg.plot.head_maps(res)

Everything else lives in subpackages, imported on first use (PEP 562), so ``import posgen_tl``
stays light. Data flows one way through them:

* ``pg.io`` — models (``models``), text (``corpus``), THE analysed/reference split (``sampling``),
  the RoPE spec read off a model (``spec``);
* ``pg.hooks`` — the only code that knows TransformerLens hook names: ``capture`` (read q/k),
  ``edits`` (key edits), ``positions`` (position-id hooks), ``logits`` (logit substitution);
* ``pg.maths`` — pure tensor maths: ``rope``, ``decompose``, ``band_stats``, ``taxonomy``,
  ``perturb``, ``groups`` (layer groups), ``approx_logits``;
* ``pg.stats`` — sign-flip tests, bootstrap, Holm, TOST, verdicts;
* ``pg.experiments`` — one module per experiment, each owning its ``Config``;
* ``pg.patching`` — activation patching over positions, in TransformerLens' idiom
  (``pg.patching.get_act_patch_pos_term(model, pg.patching.Swaps(0.1), tokens, metric, k_means=...)``);
* ``pg.plot``, ``pg.report``, the ``posgen-tl`` command (``pg.cli``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

# tqdm.auto (imported by transformers, huggingface_hub and our loops) warns "IProgress not found" in red in a Jupyter
# kernel without ipywidgets, then shows its text bar anyway; the text bar is all a reader needs, so that one
# message is silenced (every other warning stays). With ipywidgets installed, the bars are widgets.
warnings.filterwarnings("ignore", message="IProgress not found", module="tqdm")

from posgen_tl._version import __version__  # noqa: E402
from posgen_tl.compat import check_supported as _check_supported  # noqa: E402

_check_supported()  # a TransformerLens outside the supported range fails here, naming both versions

#: top-level name → module that defines it (imported on first access)
_EXPORTS: dict[str, str] = {
    # models, text, hooks
    "load_model": "io.models",
    "random_twin": "io.models",
    "corpus_tokens": "io.corpus",
    "document_windows": "io.sampling",
    "rope_spec": "io.spec",
    "probe_hooks": "hooks.capture",
    "capture_qk": "hooks.stream",
    "stream_qk": "hooks.stream",
    "exactness_table": "experiments.exactness",
    # every experiment, one door: pg.run(NAME, model, cfg) -> its Result (posgen_tl.experiments.registry)
    "run": "experiments.registry",
    # decomposition (docs/method.md §2)
    "decompose_head": "experiments.head_maps",
    "decompose_heads": "experiments.head_maps",
    "decompose_model": "experiments.decomposition",
    "decompose_with_twin": "experiments.decomposition",
    # feature pattern (§3), head taxonomy (§6)
    "feature_pattern": "experiments.pattern",
    "feature_pattern_with_twin": "experiments.pattern",
    "head_taxonomy": "experiments.taxonomy",
    # interventions and tolerance (§4–§5)
    "Intervention": "hooks.edits",
    "intervention_hooks": "hooks.edits",
    "key_means": "hooks.edits",
    "nll_on_target": "experiments.tolerance",
    "transposition_curve": "experiments.tolerance",
    "causal_study": "experiments.causal",
    "sufficiency": "experiments.sufficiency",
    "gap_probe": "experiments.length",
    # the gate: analyses run only on layers whose exactness check passed
    "allow_unchecked": "hooks.gate",
    "UncheckedModelError": "hooks.gate",
    # errors
    "RopeError": "maths.rope",
    "IndexRangeError": "maths.rope",
    "CaptureError": "hooks.capture",
    "CorpusError": "io.corpus",
    "ModelLoadError": "io.models",
}

#: subpackages and modules reachable as ``pg.NAME`` (imported on first access)
_NAMESPACES = ("io", "hooks", "maths", "stats", "experiments", "patching", "plot", "report", "cli", "compat",
               "distributed")

#: the common path (≤ 30 names); every name of ``_EXPORTS`` and ``_NAMESPACES`` resolves (``pg.patching`` too)
__all__ = [
    *(n for n in _EXPORTS if n not in ("document_windows", "decompose_with_twin", "feature_pattern_with_twin",
                                       "allow_unchecked", "UncheckedModelError", "IndexRangeError", "gap_probe",
                                       "decompose_heads")),
    "io", "hooks", "maths", "stats", "experiments", "plot",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _NAMESPACES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'posgen_tl' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_EXPORTS, *_NAMESPACES})


if TYPE_CHECKING:  # for editors and type checkers; nothing is imported at run time
    from posgen_tl import cli, compat, distributed, experiments, hooks, io, maths, plot, report, stats
    from posgen_tl.experiments.causal import causal_study
    from posgen_tl.experiments.decomposition import decompose_model, decompose_with_twin
    from posgen_tl.experiments.exactness import exactness_table
    from posgen_tl.experiments.head_maps import decompose_head, decompose_heads
    from posgen_tl.experiments.length import gap_probe
    from posgen_tl.experiments.pattern import feature_pattern, feature_pattern_with_twin
    from posgen_tl.experiments.registry import run
    from posgen_tl.experiments.sufficiency import sufficiency
    from posgen_tl.experiments.taxonomy import head_taxonomy
    from posgen_tl.experiments.tolerance import nll_on_target, transposition_curve
    from posgen_tl.hooks.capture import CaptureError, probe_hooks
    from posgen_tl.hooks.edits import Intervention, intervention_hooks, key_means
    from posgen_tl.hooks.gate import UncheckedModelError, allow_unchecked
    from posgen_tl.hooks.stream import capture_qk, stream_qk
    from posgen_tl.io.corpus import CorpusError, corpus_tokens
    from posgen_tl.io.models import ModelLoadError, load_model, random_twin
    from posgen_tl.io.sampling import document_windows
    from posgen_tl.io.spec import rope_spec
    from posgen_tl.maths.rope import IndexRangeError, RopeError
