"""The only code that knows TransformerLens hook names: ``capture`` reads q/k, ``edits`` changes keys,
``positions`` changes position ids, ``logits`` substitutes attention logits, ``patching`` patches runs."""

from posgen_tl._lazy import lazy_modules

__getattr__, __dir__ = lazy_modules(__name__, __path__)
