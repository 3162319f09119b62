"""The gate: no number about attention from a layer whose exactness check has not passed.

Every analysis reads q/k through :func:`posgen_tl.hooks.stream.stream_qk` (or
:func:`~posgen_tl.hooks.stream.capture_from_cache`) or rewrites the model's attention through the
hook builders of :mod:`posgen_tl.hooks` (logit substitution, key edits, re-positioning, distance
caps). Each of them calls :func:`require_exact` first, which

* runs the exactness check (:func:`posgen_tl.experiments.exactness.exactness_table`) on a short probe
  (2 sequences of deterministic token ids, long enough for every sliding window to mask keys) the
  first time a model is used with a given dtype and device, and caches its per-layer result;
* lets the call through only if every layer it touches ``passed``; otherwise it raises
  :class:`UncheckedModelError`, naming each failed or not-checked layer, what failed, and the remedy.

The explicit opt-out — ``posgen_tl.load_model(..., unchecked=True)``, :func:`allow_unchecked`, or the
CLI's ``--unchecked`` — lets such layers through with an :class:`UncheckedWarning` at every call;
the report and study outputs of such a model are stamped UNCHECKED (:func:`unchecked_reason`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pandas as pd
import torch

from posgen_tl.hooks.capture import CaptureError, model_device, model_dtype, probe_hooks

__all__ = ["UncheckedModelError", "UncheckedWarning", "require_exact", "check_result", "allow_unchecked",
           "unchecked", "unchecked_reason", "forget"]

#: model → {(dtype, device): the exactness table of the probe}
_RESULTS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], pd.DataFrame]] = weakref.WeakKeyDictionary()
#: model → the reason the user gave for running it unchecked
_OPT_OUT: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
#: a forward pass of the check itself is under way (its own captures are not gated)
_IN_CHECK: weakref.WeakSet[Any] = weakref.WeakSet()

PROBE_SEQ_LEN = 32
PROBE_N_SEQ = 2


class UncheckedModelError(CaptureError):
    """An analysis was asked of layers whose exactness check failed or could not compare."""


class UncheckedWarning(UserWarning):
    """Numbers are being computed from layers whose exactness check did not pass (opted out)."""


def _key(model: Any) -> tuple[str, str]:
    return str(model_dtype(model)), str(model_device(model))


def _user_hooks(model: Any) -> int:
    """Non-permanent hooks attached right now (the user's own, or an enclosing ``model.hooks``)."""
    n = 0
    for hp in getattr(model, "hook_dict", {}).values():
        n += sum(1 for h in getattr(hp, "fwd_hooks", []) if not getattr(h, "is_permanent", False))
    return n


def _probe_tokens(model: Any, spec: Any) -> torch.Tensor:
    """``[PROBE_N_SEQ, n]`` deterministic token ids, clear of the tokenizer's special ids, ``n`` long
    enough for the longest sliding window to mask keys (:func:`~posgen_tl.experiments.exactness.window_length`)."""
    from posgen_tl.experiments.exactness import window_length  # noqa: PLC0415

    n = PROBE_SEQ_LEN if not spec.n_ctx else min(PROBE_SEQ_LEN, spec.n_ctx)
    n, _ = window_length(spec, n)
    d_vocab = int(getattr(getattr(model, "cfg", None), "d_vocab", 0) or 0) or 256
    tok = getattr(model, "tokenizer", None)
    special = {int(i) for i in (getattr(tok, "all_special_ids", None) or []) if i is not None}
    g = torch.Generator().manual_seed(20261125)
    ids = torch.randint(0, d_vocab, (PROBE_N_SEQ, n), generator=g)
    safe = next((i for i in range(min(d_vocab, 1000) - 1, 0, -1) if i not in special), 0)
    for s in special:
        ids[ids == s] = safe
    return ids


def check_result(model: Any) -> pd.DataFrame:
    """The exactness table (one row per layer) of ``model`` in its current dtype and device, computed on
    the probe the first time and cached (a result obtained while hooks of yours were attached is cached
    only if every layer passed)."""
    key = _key(model)
    cached = _RESULTS.get(model, {}).get(key)
    if cached is not None:
        return cached
    from posgen_tl.experiments.exactness import exactness_table  # noqa: PLC0415

    spec, _ = probe_hooks(model)
    _IN_CHECK.add(model)
    try:
        table = exactness_table(model, _probe_tokens(model, spec))
    finally:
        _IN_CHECK.discard(model)
    if bool((table["status"] == "passed").all()) or not _user_hooks(model):
        _RESULTS.setdefault(model, {})[key] = table
    return table


def forget(model: Any) -> None:
    """Drop the cached check of ``model`` (after changing its weights in place)."""
    _RESULTS.pop(model, None)


def allow_unchecked(model: Any, reason: str = "opted out by the user") -> Any:
    """Let analyses run on ``model``'s layers whose exactness check did not pass; every such call warns
    (:class:`UncheckedWarning`) and report/study outputs are stamped UNCHECKED. Returns ``model``."""
    _OPT_OUT[model] = reason
    return model


@contextlib.contextmanager
def unchecked(model: Any, reason: str = "opted out by the user") -> Iterator[Any]:
    """:func:`allow_unchecked` for the duration of a ``with`` block."""
    before = _OPT_OUT.get(model)
    _OPT_OUT[model] = reason
    try:
        yield model
    finally:
        if before is None:
            _OPT_OUT.pop(model, None)
        else:
            _OPT_OUT[model] = before


def unchecked_reason(model: Any) -> str | None:
    """Why ``model`` runs unchecked (``None``: it does not — the gate is closed on failed layers)."""
    return _OPT_OUT.get(model)


def require_exact(model: Any, layers: Sequence[int] | None = None, what: str = "this analysis") -> None:
    """Return if every layer of ``layers`` (``None``: all) passed the exactness check for this model,
    dtype and device (running the check once if needed); otherwise raise :class:`UncheckedModelError`
    naming each failed or not-checked layer and the remedy — or, where the user opted out, warn.

    Raises:
        UncheckedModelError: a layer's check failed or compared nothing.
        IndexRangeError: a layer index outside the model."""
    if model in _IN_CHECK:
        return
    spec, _ = probe_hooks(model)
    want = spec.layer_indices(layers)
    table = check_result(model).set_index("layer")
    bad = [(layer, table.loc[layer, "status"], table.loc[layer, "reason"]) if layer in table.index
           else (layer, "not checked", "the check did not reach this layer") for layer in want
           if layer not in table.index or table.loc[layer, "status"] != "passed"]
    if not bad:
        return
    arch = spec.extra.get("architecture") or type(model).__name__
    dtype, device = _key(model)
    lines = "; ".join(f"layer {layer} {status}: {reason}" for layer, status, reason in bad[:4])
    more = f" (and {len(bad) - 4} more layers)" if len(bad) > 4 else ""
    head = (f"{spec.model_name} ({arch}, {dtype.removeprefix('torch.')}, {device}): {what} refused — the exactness "
            f"check did not pass on {len(bad)} of the {len(want)} layer(s) it needs: {lines}{more}")
    reason = _OPT_OUT.get(model)
    if reason is not None:
        warnings.warn(f"UNCHECKED ({reason}): {head}", UncheckedWarning, stacklevel=3)
        return
    raise UncheckedModelError(
        f"{head}. Its numbers would not be the model's. See `posgen-tl check --model …` for the full table; to "
        "compute anyway, load with posgen_tl.load_model(..., unchecked=True) (CLI: --unchecked) — every output "
        "is then stamped UNCHECKED"
    )
