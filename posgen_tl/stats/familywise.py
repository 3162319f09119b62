"""Family-wise error control: the max-T sign-flip test over many tests that share their documents, and the
adjustment of a causal run's entries for the claim they belong to (:func:`claim_adjust`).

A patching map holds hundreds of heads measured on the same documents; testing each head alone and reading off
the significant ones would find some by chance. The max-T procedure (Westfall & Young's single-step maxT with
sign-flips as the null's symmetry) flips the sign of every document's row at once — the heads of a document
keep their dependence — and compares each head's |t| with the distribution of the LARGEST |t| over all heads:
``p_fwe[j] = P(max_k |T*_k| ≥ |t_j|)``. Any set of heads with ``p_fwe ≤ α`` contains a false one with
probability ≤ α (strong control under subset pivotality, which sign-symmetric per-document effects give).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from posgen_tl.stats.inference import holm

__all__ = ["maxt_signflip", "claim_adjust"]

_ENUMERATE_UP_TO = 16  # 2^16 sign vectors: enumerate exactly


def _t(sums: np.ndarray, sumsq: np.ndarray, n: int) -> np.ndarray:
    """One-sample t of each column from its sum and sum of squares (0 where the spread is 0)."""
    mean = sums / n
    var = np.maximum(sumsq - n * mean**2, 0.0) / (n - 1)
    sd = np.sqrt(var)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(sd > 1e-12 * np.maximum(1.0, np.abs(mean)), mean / (sd / np.sqrt(n)), 0.0)
    return t


def maxt_signflip(x: Any, *, n_perm: int = 20_000, seed: int = 0, chunk: int = 2_000) -> dict[str, Any]:
    """Family-wise p-values of ``H0_j: the per-document effects of test j are symmetric about 0``.

    Args:
        x: ``[n_docs, n_tests]`` per-document effects (one row per document, NaN-free).
        n_perm: random sign vectors when ``2^n_docs`` exceeds both it and ``2^16``; otherwise every sign
            vector is enumerated (exact).

    Returns:
        dict ``t`` (``[n_tests]`` one-sample t, 0 where a test's documents agree exactly), ``p_fwe``
        (``[n_tests]``, max-T adjusted, ≥ 1/(number of sign vectors)), ``p_kind`` (``"exact sign-flip max-T
        (2^n)"`` or ``"Monte Carlo sign-flip max-T (N draws, floor 1/(N+1))"``), ``n_docs``.

    Raises:
        ValueError: fewer than 3 documents, a non-2-D or non-finite ``x``.
    """
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"x must be [n_docs, n_tests], got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("x holds NaN or inf: drop the documents or tests first")
    n, m = a.shape
    if n < 3:
        raise ValueError(f"{n} documents: a sign-flip test needs at least 3")
    sumsq = (a**2).sum(0)
    t_obs = _t(a.sum(0), sumsq, n)
    exact = 2**n <= max(n_perm, 2**_ENUMERATE_UP_TO)  # every sign vector, when they are no more than the draws
    exceed = np.zeros(m)
    total = 0
    rng = np.random.default_rng(seed)

    def signs() -> Any:
        if exact:
            allv = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
            for s in range(0, len(allv), chunk):
                yield allv[s : s + chunk]
        else:
            left = n_perm
            while left > 0:
                k = min(chunk, left)
                yield rng.choice((-1.0, 1.0), size=(k, n))
                left -= k

    for s in signs():
        mx = np.abs(_t(s @ a, sumsq[None, :], n)).max(1)  # [k] the largest |t| of each sign vector
        exceed += (mx[:, None] >= np.abs(t_obs)[None, :] - 1e-12).sum(0)
        total += len(s)
    if exact:
        p = exceed / total  # the identity is among the vectors: p ≥ 1 / 2^n
        kind = f"exact sign-flip max-T (2^{n})"
    else:
        p = (exceed + 1) / (total + 1)
        kind = f"Monte Carlo sign-flip max-T ({total} draws, floor {1 / (total + 1):.1e})"
    return dict(t=t_obs, p_fwe=np.minimum(p, 1.0), p_kind=kind, n_docs=n)


def claim_adjust(p: Sequence[float], m: int) -> tuple[np.ndarray, str]:
    """Adjust one run's entry p-values ``p`` for a declared claim of ``m`` ≥ len(p) entries: Holm when the run
    holds the whole claim (a not-testable entry's NaN stays NaN and still counts in the family), else the
    Bonferroni bound ``min(1, m·p)`` (the other entries' p are not known to this run).

    Returns ``(adjusted, method text)``. Raises ValueError when ``m`` < len(p)."""
    x = np.asarray(p, dtype=float)
    if m < len(x):
        raise ValueError(f"the declared family ({m}) is smaller than this run's {len(x)} entries")
    if m > len(x):
        return np.minimum(1.0, x * m), f"Bonferroni bound over the declared claim of {m} entries"
    return holm(x, m=m), f"Holm over the {m} entries of this run"
