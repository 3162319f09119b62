"""Machinery several experiments share — the swap/NLL engine (:mod:`~posgen_tl.engine.swaps`), the causal
conditions and their passes (:mod:`~posgen_tl.engine.conditions`), the dose–response passes
(:mod:`~posgen_tl.engine.dose`), the causal test's pilot on reference documents (:mod:`~posgen_tl.engine.pilot`), the
decomposition's scoring pass (:mod:`~posgen_tl.engine.decompose_scores`, also run sharded by :mod:`posgen_tl.distributed`)
and its logit maps' products and moments (:mod:`~posgen_tl.engine.decompose_maps`).
Nothing here is an experiment: experiments import the engine, never each other.
"""
