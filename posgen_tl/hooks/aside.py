"""A caller's hooks set aside: the model's hook points without the temporary forward hooks a caller added, for a
block (:func:`others_hooks_set_aside`) — for the probes whose answer is cached per model
(:func:`posgen_tl.hooks.capture.probe_hooks`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["others_hooks_set_aside"]


@contextlib.contextmanager
def others_hooks_set_aside(model: Any) -> Iterator[int]:
    """The model's hook points without the temporary forward hooks already on them, for the block, restored as they
    were on every exit path: TransformerLens's non-permanent hooks (``model.hooks(...)``, ``run_with_hooks``,
    ``add_hook``) — a user's, an enclosing pass's. Permanent hooks stay: they are part of the model as loaded (a
    half-precision OLMo bridge casts its rotated q/k with them, and its forward fails without them). So do hooks
    registered on a hook point by other means than ``add_hook``. Yields how many hooks were set aside. What the
    hooks fire and hold is then the model's, not the edit of whoever called first (a hook planting a NaN in the
    scores would otherwise leave every later call without the scores' check)."""
    aside: list[tuple[Any, Any]] = []
    count = 0
    for hp in {id(h): h for h in (getattr(model, "hook_dict", None) or {}).values()}.values():  # aliases once
        hooks = getattr(hp, "_forward_hooks", None) or {}
        temporary = {h.hook.id for h in getattr(hp, "fwd_hooks", ()) if not h.is_permanent}.intersection(hooks)
        if temporary:
            aside.append((hp, hooks))
            hp._forward_hooks = type(hooks)((k, v) for k, v in hooks.items() if k not in temporary)
            count += len(temporary)
    try:
        yield count
    finally:
        for hp, hooks in aside:
            hp._forward_hooks = hooks
