"""Which TransformerLens is installed, and what it offers — the one place that knows.

In the spirit of SAELens' ``sae_lens/analysis/compat.py``: the version is read from the
package metadata (``importlib.metadata``, so nothing heavy is imported), and every
version-dependent fact posgen_tl relies on lives here, stated once:

| | TransformerLens 3.9 – 3.x | TransformerLens 4.x |
|---|---|---|
| ``HookedTransformer`` | yes (deprecated) | no (removed) |
| ``TransformerBridge`` | yes | yes |

and per model *backend* (:func:`backend`), the hook conventions (:func:`conventions`):

* ``"hooked"`` — a ``HookedTransformer`` (or subclass, e.g. SAELens' ``HookedSAETransformer``):
  ``hook_rot_q``/``hook_rot_k`` fire on every rotary model, ``[batch, pos, head, d_head]``;
  QK-norm has **no** ``hook_q_normed``: the tensor that enters RoPE is
  ``attn.q_norm.hook_normalized`` (flattened ``[batch·pos·head, d_head]``, *before* the norm
  weight ``attn.q_norm.w``) times that weight; ``hook_attn_scores`` is pre-softmax, after
  the soft-cap and after the causal/sliding mask (masked entries ``-inf``); ``forward`` takes
  no ``position_ids``; and when its tokenizer pads on the left (Gemma's does) ``forward`` derives
  an attention mask from the tokens themselves: *leading pad tokens* are masked and the
  positions of the rest shifted (:func:`implicit_attention_mask`).
* ``"bridge"`` — a ``TransformerBridge`` (3.9 and 4.x alike, checked): ``hook_q_normed``/
  ``hook_k_normed`` fire on ``[batch, head, pos, d_head]`` (Gemma3's post-reshape norm);
  ``hook_rot_q``/``hook_rot_k`` fire on the HF position-embeddings attention and never on
  TransformerLens-native models, where ``hook_attn_scores`` holds post-softmax weights
  (detected by :func:`posgen_tl.hooks.capture.probe_hooks`, never assumed); ``forward`` takes
  ``position_ids``.

No TransformerLens class is patched; nothing here imports TransformerLens unless a model
object (which has already imported it) is inspected.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

__all__ = [
    "SUPPORTED_RANGE",
    "MIN_VERSION",
    "MAX_VERSION_EXCLUSIVE",
    "TransformerLensVersionError",
    "tl_version",
    "tl_version_tuple",
    "check_supported",
    "has_hooked_transformer",
    "has_transformer_bridge",
    "backend",
    "Backend",
    "HookConventions",
    "conventions",
    "accepts_position_ids",
    "implicit_attention_mask",
    "native_rope_scaling",
    "summary",
]

#: the TransformerLens versions posgen_tl is tested on (CI runs 3.9.0 and 4.3.x)
SUPPORTED_RANGE = ">=3.9,<5"
MIN_VERSION = (3, 9, 0)
MAX_VERSION_EXCLUSIVE = (5, 0, 0)

Backend = Literal["hooked", "bridge", "other"]


class TransformerLensVersionError(ImportError):
    """The installed TransformerLens is outside the supported range (the message names both)."""


@lru_cache(maxsize=1)
def tl_version() -> str:
    """The installed ``transformer-lens`` version string (package metadata; TL is not imported).

    Raises:
        TransformerLensVersionError: transformer-lens is not installed.
    """
    try:
        return importlib.metadata.version("transformer-lens")
    except importlib.metadata.PackageNotFoundError:
        raise TransformerLensVersionError(
            f"posgen_tl needs transformer-lens {SUPPORTED_RANGE}, which is not installed: "
            f"pip install 'transformer-lens{SUPPORTED_RANGE}'"
        ) from None


def _parse(version: str) -> tuple[int, int, int]:
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def tl_version_tuple() -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the installed transformer-lens (pre-release tags dropped)."""
    return _parse(tl_version())


def check_supported(version: str | None = None) -> str:
    """Return the installed version if it is supported, else raise a clear error.

    ``0.0.0`` (TransformerLens installed from a source checkout) is accepted, as SAELens
    does, and treated as the newest major (4.x).

    Raises:
        TransformerLensVersionError: naming the installed version and :data:`SUPPORTED_RANGE`.
    """
    v = tl_version() if version is None else version
    t = _parse(v)
    if t == (0, 0, 0):
        return v
    if not (MIN_VERSION <= t < MAX_VERSION_EXCLUSIVE):
        hint = (
            "TransformerLens 3.9 is the oldest release posgen_tl is tested on (SAELens users: "
            "sae-lens allows transformer-lens<4, so 3.9.0 installs beside it)"
            if t < MIN_VERSION
            else "TransformerLens 5 is not released/tested yet"
        )
        raise TransformerLensVersionError(
            f"posgen_tl supports transformer-lens {SUPPORTED_RANGE}; the installed version is {v}. "
            f"{hint}: pip install 'transformer-lens{SUPPORTED_RANGE}'"
        )
    return v


def _major() -> int:
    t = tl_version_tuple()
    return 4 if t == (0, 0, 0) else t[0]


def has_hooked_transformer() -> bool:
    """``HookedTransformer``/``HookedTransformerConfig`` exist (TL 3.x; removed in 4.0)."""
    return _major() == 3


def has_transformer_bridge() -> bool:
    """``TransformerBridge`` exists (TL 3.x and 4.x)."""
    return _major() >= 3


def _is_instance_of(model: Any, module: str, cls_name: str) -> bool:
    """isinstance without importing: if ``module`` was never imported, ``model`` cannot be one."""
    mod = sys.modules.get(module)
    cls = getattr(mod, cls_name, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(model, cls)


def backend(model: Any) -> Backend:
    """``"hooked"`` (a HookedTransformer or subclass), ``"bridge"`` (a TransformerBridge), or ``"other"``."""
    if _is_instance_of(model, "transformer_lens.model_bridge.bridge", "TransformerBridge"):
        return "bridge"
    if _is_instance_of(model, "transformer_lens.HookedTransformer", "HookedTransformer"):
        return "hooked"
    return "other"


@dataclass(frozen=True)
class HookConventions:
    """Where a backend exposes what posgen_tl reads (hook names relative to ``blocks.{l}.attn.``).

    Attributes:
        backend: ``"hooked"`` / ``"bridge"`` / ``"other"``.
        q_pre, k_pre: the pre-rotation q/k hooks of a model **without** QK-norm.
        q_normed, k_normed: the pre-rotation q/k hooks of a model **with** QK-norm.
        normed_layout: layout of the QK-norm hooks: ``"bhsd"`` (``[batch, head, pos, d_head]``),
            ``"bshd"``, or ``"flat_prescale"`` (``[batch·pos·head, d_head]`` before the norm's
            weight, which must be multiplied in: see ``norm_weight``).
        norm_weight: for ``"flat_prescale"``: ``(q_module, k_module, attribute)`` of the norm
            weight, e.g. ``("q_norm", "k_norm", "w")``; else ``None``.
        rot_always_fires: ``hook_rot_q``/``hook_rot_k`` fire on every rotary model of this backend
            (``False``: probe it).
        scores: what ``hook_attn_scores`` holds when known in advance (``"pre_softmax"``), or
            ``"probe"`` (it depends on the model: HF adapters pre-softmax, native post-softmax).
        scores_masked: ``hook_attn_scores`` fires after the causal/sliding-window mask.
        position_ids: ``forward`` accepts ``position_ids``.
    """

    backend: Backend
    q_pre: str = "hook_q"
    k_pre: str = "hook_k"
    q_normed: str = "hook_q_normed"
    k_normed: str = "hook_k_normed"
    normed_layout: str = "bhsd"
    norm_weight: tuple[str, str, str] | None = None
    rot_always_fires: bool = False
    scores: str = "probe"
    scores_masked: bool = True
    position_ids: bool = True


_HOOKED = HookConventions(
    backend="hooked",
    q_normed="q_norm.hook_normalized",
    k_normed="k_norm.hook_normalized",
    normed_layout="flat_prescale",
    norm_weight=("q_norm", "k_norm", "w"),
    rot_always_fires=True,
    scores="pre_softmax",
    scores_masked=True,
    position_ids=False,
)
_BRIDGE = HookConventions(backend="bridge")
_OTHER = HookConventions(backend="other")


def conventions(model: Any) -> HookConventions:
    """The :class:`HookConventions` of ``model``'s backend (what the probe then verifies)."""
    b = backend(model)
    if b == "hooked":
        return _HOOKED
    if b == "bridge":
        return _BRIDGE
    # an unknown class exposing TransformerLens hook names: bridge-style names, probed
    return dataclasses.replace(_OTHER, position_ids=accepts_position_ids(model))


def accepts_position_ids(model: Any) -> bool:
    """Does ``model.forward`` take ``position_ids`` (explicitly or through ``**kwargs``)?"""
    fwd = getattr(model, "forward", None)
    if fwd is None:
        return False
    b = backend(model)
    if b != "other":
        return (_HOOKED if b == "hooked" else _BRIDGE).position_ids
    try:
        params = inspect.signature(fwd).parameters
    except (TypeError, ValueError):
        return False
    return "position_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def implicit_attention_mask(model: Any, tokens: Any) -> Any | None:
    """The attention mask a TL 3.x ``HookedTransformer`` derives from ``tokens`` by itself (its
    tokenizer pads on the left: leading pad tokens masked, later positions shifted), computed by
    TransformerLens' own ``get_attention_mask``; ``None`` where the model derives none."""
    if backend(model) != "hooked":
        return None
    tok = getattr(model, "tokenizer", None)
    if tok is None or getattr(tok, "padding_side", None) != "left" or getattr(tok, "pad_token_id", None) is None:
        return None
    from transformer_lens.utilities import get_attention_mask  # noqa: PLC0415  (TL 3.x, already imported)

    return get_attention_mask(tok, tokens, bool(getattr(model.cfg, "default_prepend_bos", True)))


def native_rope_scaling(cfg: Any, rotary_dim: int) -> tuple[Any, Any, Any]:
    """TransformerLens' own RoPE scaling of a TL-native bridge model: ``(attention scale, position
    scale, inv_freq [rotary_dim // 2])``, from the one TL function that computes it (a private TL name:
    the only place posgen_tl reaches into TransformerLens internals, so a TL change breaks here, loudly).

    Raises:
        RuntimeError: the installed TransformerLens has no such function (it names the version).
    """
    try:
        from transformer_lens.model_bridge.sources.native.model import _resolve_rope_scaling  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the TL version
        raise RuntimeError(f"transformer-lens {tl_version()} has no native RoPE scaling resolver "
                           "(transformer_lens.model_bridge.sources.native.model._resolve_rope_scaling)") from e
    return _resolve_rope_scaling(cfg, rotary_dim)


def summary() -> dict[str, Any]:
    """The installed version and what it offers (for ``posgen-tl check`` and bug reports)."""
    return {
        "transformer_lens": tl_version(),
        "supported_range": SUPPORTED_RANGE,
        "HookedTransformer": has_hooked_transformer(),
        "TransformerBridge": has_transformer_bridge(),
    }
