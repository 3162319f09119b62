"""Statistics for verdicts (docs/method.md §8): sign-flip tests, bootstrap and t intervals, Holm, TOST, power;
per-document tolerance curves (AUC, slope) and the causal verdict (dose–response at common damage).

Everything is re-exported here (``pg.stats.sign_flip``, ``pg.stats.dose_verdict``); the code lives
in :mod:`posgen_tl.stats.inference` (tests and intervals),
:mod:`posgen_tl.stats.curves` (per-document curves and summaries),
:mod:`posgen_tl.stats.verdicts` (contrast tables, interaction and equivalence, family adjustment) and
:mod:`posgen_tl.stats.dose` (the causal verdict).
"""

from posgen_tl.stats import curves, dose, inference, verdicts
from posgen_tl.stats.curves import *  # noqa: F401,F403
from posgen_tl.stats.dose import *  # noqa: F401,F403
from posgen_tl.stats.inference import *  # noqa: F401,F403
from posgen_tl.stats.verdicts import *  # noqa: F401,F403

__all__ = [*inference.__all__, *curves.__all__, *verdicts.__all__, *dose.__all__]
