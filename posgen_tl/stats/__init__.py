"""Statistics for verdicts (METHOD §8): sign-flip tests, bootstrap and t intervals, Holm, TOST, power.

Everything is re-exported here (``pg.stats.sign_flip_test``); the code lives in
:mod:`posgen_tl.stats.inference`.
"""

from posgen_tl.stats.inference import *  # noqa: F401,F403
from posgen_tl.stats.inference import __all__  # noqa: F401
