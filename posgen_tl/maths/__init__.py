"""Pure tensor maths — never a model: ``rope``, ``decompose``, ``band_stats``, ``taxonomy``, ``perturb``,
``groups``, ``approx_logits``, ``moments``. Testable in milliseconds."""

from posgen_tl._lazy import lazy_modules

__getattr__, __dir__ = lazy_modules(__name__, __path__)
