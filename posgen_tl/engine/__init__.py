"""Machinery several experiments share — the swap/NLL engine (:mod:`~posgen_tl.engine.swaps`), the causal
conditions and their passes (:mod:`~posgen_tl.engine.conditions`), the dose–response passes
(:mod:`~posgen_tl.engine.dose`), the causal test's pilot on reference documents (:mod:`~posgen_tl.engine.pilot`).
Nothing here is an experiment: experiments import the engine, never each other.
"""
