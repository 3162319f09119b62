"""Statistics for verdicts (docs/method.md §8): sign-flip tests, bootstrap and t intervals, Holm, TOST, power;
per-document tolerance curves (AUC, slope) and the version-2 causal verdict.

Everything is re-exported here (``pg.stats.sign_flip``, ``pg.stats.causal_verdict``); the code lives
in :mod:`posgen_tl.stats.inference` (tests and intervals, the legacy ``verdict_table``),
:mod:`posgen_tl.stats.curves` (per-document curves and summaries) and
:mod:`posgen_tl.stats.verdicts` (contrast tables, damage matching, the claim's family, the verdict).
"""

from posgen_tl.stats import curves, inference, verdicts
from posgen_tl.stats.curves import *  # noqa: F401,F403
from posgen_tl.stats.inference import *  # noqa: F401,F403
from posgen_tl.stats.verdicts import *  # noqa: F401,F403

__all__ = [*inference.__all__, *curves.__all__, *verdicts.__all__]
