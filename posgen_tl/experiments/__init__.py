"""One module per experiment; each owns its ``Config`` dataclass (fields, defaults and help written once),
its ``run`` and its summary. The library call, ``posgen-tl study NAME``, the report stage and the
notebooks all run that config (:mod:`posgen_tl.experiments.registry`)."""

from posgen_tl._lazy import lazy_modules

__getattr__, __dir__ = lazy_modules(__name__, __path__)
