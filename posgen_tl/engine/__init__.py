"""Machinery several experiments share — the swap/NLL engine (:mod:`~posgen_tl.engine.swaps`), the causal
conditions and their passes (:mod:`~posgen_tl.engine.conditions`), the dose–response passes
(:mod:`~posgen_tl.engine.dose`). Nothing here is an experiment: experiments import the engine, never each other.
"""
