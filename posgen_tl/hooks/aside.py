"""Hooks set aside: the model's hook points without the forward hooks already on them, for a block
(:func:`others_hooks_set_aside`) — for the probes whose answer is cached per model
(:func:`posgen_tl.hooks.capture.probe_hooks`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["others_hooks_set_aside"]


@contextlib.contextmanager
def others_hooks_set_aside(model: Any) -> Iterator[int]:
    """The model's hook points without the forward hooks already on them — a user's (``model.hooks(...)``,
    ``add_hook``, permanent ones), an enclosing pass's — for the block, restored as they were on every exit path.
    Yields how many hook points had some. What the hooks fire and hold is then the model's, not the edit of whoever
    called first (a hook planting a NaN in the scores would otherwise leave every later call without the scores'
    check)."""
    seen: set[int] = set()
    aside: list[tuple[Any, Any, Any]] = []
    for hp in (getattr(model, "hook_dict", None) or {}).values():
        if id(hp) in seen or not (getattr(hp, "_forward_hooks", None) or getattr(hp, "_forward_pre_hooks", None)):
            continue
        seen.add(id(hp))
        aside.append((hp, hp._forward_hooks, hp._forward_pre_hooks))
        hp._forward_hooks, hp._forward_pre_hooks = type(hp._forward_hooks)(), type(hp._forward_pre_hooks)()
    try:
        yield len(aside)
    finally:
        for hp, fwd, pre in aside:
            hp._forward_hooks, hp._forward_pre_hooks = fwd, pre
