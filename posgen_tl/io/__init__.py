"""Models, text and the RoPE spec: what goes into an analysis (``models``, ``corpus``, ``sampling``, ``spec``)."""

from posgen_tl._lazy import lazy_modules

__getattr__, __dir__ = lazy_modules(__name__, __path__)
