"""Runners: pure maths applied to a model through :mod:`posgen_tl.capture`, results as DataFrames."""
