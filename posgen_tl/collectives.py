"""The torch.distributed plumbing under :mod:`posgen_tl.distributed`: this process' place in the run
(:class:`Dist`, :func:`setup`, :func:`teardown`), whole documents dealt to ranks (:func:`shard_documents`), one
verdict on failure for every rank (:func:`guarded`, :class:`DistributedRunError`), and merged accumulators, means
and rows (:func:`all_reduce_states`, :func:`merge_means`, :func:`gather_frame`).

Without a process group (plain ``python``), every helper degrades to the single-process call (world size 1).
:mod:`posgen_tl.distributed` re-exports every name.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd
import torch
import torch.distributed as tdist
from jaxtyping import Float, Int
from torch import Tensor

from posgen_tl.io.sampling import Windows

__all__ = [
    "Dist",
    "DistributedRunError",
    "ShardError",
    "setup",
    "teardown",
    "current",
    "shard_documents",
    "guarded",
    "all_reduce_states",
    "merge_means",
    "gather_frame",
]

T = TypeVar("T")


class DistributedRunError(RuntimeError):
    """A rank failed (or a collective broke): raised on EVERY rank; no merged result exists."""


class ShardError(ValueError):
    """The documents cannot be sharded over the ranks (e.g. more ranks than documents)."""


@dataclass(frozen=True)
class Dist:
    """This process' place in the run: ``rank`` in ``[0, world_size)``; ``world_size`` 1 = no group."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that writes files."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """True when a process group with more than one rank is running."""
        return self.world_size > 1


def current() -> Dist:
    """The running process group's ``(rank, world_size)``, or ``Dist(0, 1)`` without one."""
    if tdist.is_available() and tdist.is_initialized():
        return Dist(tdist.get_rank(), tdist.get_world_size())
    return Dist()


def setup(backend: str = "gloo", *, timeout_s: float = 600.0) -> Dist:
    """Join the process group described by the environment (``torchrun`` sets ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); without those, a single process.

    ``gloo`` works on CPU (and with CUDA tensors moved to CPU for the collectives, which is what
    this module does: every merged object is small). ``timeout_s`` bounds how long a rank waits
    for a peer that died. Returns :class:`Dist`.
    """
    if tdist.is_available() and tdist.is_initialized():
        return current()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    if not tdist.is_available():
        raise DistributedRunError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    tdist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return current()


def teardown() -> None:
    """Leave the process group (if one is running), after a barrier: no rank closes its connections
    while a peer is still inside a collective. A failing barrier (a peer already gone) does not stop
    the group from being destroyed."""
    if tdist.is_available() and tdist.is_initialized():
        try:
            if tdist.get_world_size() > 1:
                tdist.barrier()
        finally:
            tdist.destroy_process_group()


# ----------------------------------------------------------------------------- sharding


def shard_documents(
    doc_ids: Int[Tensor, "batch"] | Windows, world_size: int, rank: int
) -> Int[Tensor, "local"]:
    """Indices of the windows that ``rank`` analyses: whole documents, balanced by window count.

    Documents are sorted by (window count descending, id) and each goes to the rank holding the
    fewest windows so far (lowest rank on ties) — deterministic, so every rank computes the same
    assignment without communicating. Returns a sorted ``[local]`` int64 index into the windows.

    Raises:
        ShardError: ``world_size`` larger than the number of distinct documents (a rank would
            have nothing to analyse), or a bad ``rank``.
    """
    ids = doc_ids.doc_ids if isinstance(doc_ids, Windows) else torch.as_tensor(doc_ids)
    if not 0 <= rank < world_size:
        raise ShardError(f"rank {rank} is outside [0, {world_size})")
    docs, counts = ids.unique(return_counts=True)
    if world_size > len(docs):
        raise ShardError(
            f"{world_size} ranks but only {len(docs)} documents among {len(ids)} windows: documents are not "
            f"split across ranks, so use at most {len(docs)} ranks (or more documents)"
        )
    order = sorted(zip(counts.tolist(), docs.tolist()), key=lambda t: (-t[0], t[1]))
    load = [0] * world_size
    mine: list[int] = []
    for count, doc in order:
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += count
        if r == rank:
            mine.append(doc)
    keep = torch.isin(ids, torch.tensor(mine, dtype=ids.dtype))
    return keep.nonzero().flatten()


def shard_rows(n: int, world_size: int, rank: int) -> Int[Tensor, "local"]:
    """Contiguous near-equal row split (for reference sets, whose documents do not matter)."""
    bounds = [round(i * n / world_size) for i in range(world_size + 1)]
    return torch.arange(bounds[rank], bounds[rank + 1])


# ----------------------------------------------------------------------------- failure handling


def guarded(fn: Callable[..., T], *args: Any, what: str = "work", **kw: Any) -> T:
    """Run ``fn(*args, **kw)`` on this rank, then agree with every rank on whether all succeeded.

    Returns ``fn``'s result when every rank succeeded. If ANY rank raised, every rank raises
    :class:`DistributedRunError` naming the failed rank(s) and their error (on the failing rank
    chained to the original exception). With one process, ``fn``'s exception propagates as is.
    ``fn`` must not itself call collectives (the status exchange is the synchronisation point).
    """
    d = current()
    if not d.active:
        return fn(*args, **kw)
    err: BaseException | None = None
    result: Any = None
    try:
        result = fn(*args, **kw)
        status = (d.rank, True, "")
    except Exception as e:  # noqa: BLE001 — reported to every rank below
        err = e
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        status = (d.rank, False, tb)
    statuses = gather_objects(status, what=what)
    failed = [s for s in statuses if not s[1]]
    if failed:
        msg = "; ".join(f"rank {r}: {m}" for r, _, m in failed)
        raise DistributedRunError(
            f"{what} failed on {len(failed)} of {d.world_size} rank(s) — {msg}. No results were merged or written."
        ) from err
    return result


def gather_objects(obj: Any, *, what: str) -> list[Any]:
    d = current()
    out: list[Any] = [None] * d.world_size
    try:
        tdist.all_gather_object(out, obj)
    except Exception as e:  # noqa: BLE001 — a dead peer surfaces here (connection closed / timeout)
        raise DistributedRunError(
            f"rank {d.rank}: exchanging results of {what} failed ({type(e).__name__}: {str(e)[:200]}); "
            "another rank probably died. No results were merged or written."
        ) from e
    return out


# ----------------------------------------------------------------------------- merging


def all_reduce_states(states: dict[Any, dict[str, Any]], *, what: str = "accumulators") -> dict[Any, dict[str, Any]]:
    """Sum tensor entries of (nested) ``BandStats.state_dict()`` maps across ranks.

    ``states``: ``{key: {"q": state_dict, "k": state_dict}}`` or ``{key: state_dict}`` — any
    nesting of dicts whose tensor leaves are sums (``n``, ``sum_x``, …); non-tensor leaves
    (config) must agree across ranks and are kept. Returns a new structure on CPU, equal on
    every rank; the input is not modified. One process: returned as is.
    """
    if not current().active:
        return states
    flat: list[tuple[tuple, Tensor]] = []

    def walk(node: Any, path: tuple) -> None:
        for k in sorted(node, key=str):
            v = node[k]
            if isinstance(v, dict):
                walk(v, path + (k,))
            elif isinstance(v, Tensor):
                flat.append((path + (k,), v))

    walk(states, ())
    reduced: dict[tuple, Tensor] = {}
    try:
        for path, t in flat:  # complex sums go as (re, im) pairs: gloo reduces real dtypes
            x = t.detach().cpu().clone()
            buf = torch.view_as_real(x).contiguous() if x.is_complex() else x
            tdist.all_reduce(buf, op=tdist.ReduceOp.SUM)
            reduced[path] = torch.view_as_complex(buf) if x.is_complex() else buf
    except Exception as e:  # noqa: BLE001
        raise DistributedRunError(f"all-reduce of {what} failed ({type(e).__name__}: {str(e)[:200]})") from e

    def rebuild(node: Any, path: tuple) -> Any:
        out = {}
        for k, v in node.items():
            if isinstance(v, dict):
                out[k] = rebuild(v, path + (k,))
            elif isinstance(v, Tensor):
                out[k] = reduced[path + (k,)]
            else:
                out[k] = v
        return out

    return rebuild(states, ())


def merge_means(
    means: dict[int, Float[Tensor, ...]], n_tokens: int, *, what: str = "means"
) -> dict[int, Float[Tensor, ...]]:
    """Global mean from per-rank means over ``n_tokens`` tokens each: ``Σ_r n_r·m_r / Σ_r n_r``.

    ``means`` ``{layer: tensor}`` (a rank with ``n_tokens = 0`` passes zeros of the right shapes).
    Returns float64 CPU tensors, equal on every rank. One process: the input cast to float64 CPU.
    """
    if not current().active:
        return {k: v.detach().double().cpu() for k, v in means.items()}
    states: dict[Any, dict[str, Tensor]] = {k: {"s": v.detach().double().cpu() * n_tokens} for k, v in means.items()}
    states["__n__"] = {"n": torch.tensor(float(n_tokens), dtype=torch.float64)}
    red = all_reduce_states(states, what=what)
    total = float(red.pop("__n__")["n"])
    if total <= 0:
        raise DistributedRunError(f"{what}: no tokens on any rank")
    return {k: v["s"] / total for k, v in red.items()}


def gather_frame(df: pd.DataFrame, index: Int[Tensor, "local"] | None = None, *, column: str = "seq",
                 what: str = "rows") -> pd.DataFrame:
    """Concatenate every rank's ``df`` (rank order) on every rank.

    With ``index`` (this rank's global window indices, from :func:`shard_documents`), the local
    ``column`` values ``0..local−1`` are first replaced by the global ones. Returns the
    concatenated frame (index reset). One process: ``df`` with the column remapped.
    """
    df = df.copy()
    if index is not None and column in df.columns and len(df):
        df[column] = index.numpy()[df[column].to_numpy().astype(int)]
    if not current().active:
        return df.reset_index(drop=True)
    parts = gather_objects(df, what=what)
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True) if parts else df.iloc[0:0]
