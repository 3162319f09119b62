"""Whether a CPU matrix product is carried out in its operands' precision: the exact 0/1 products some analyses use
in place of gathers and masked sums (:mod:`posgen_tl.maths.taxonomy`, :mod:`posgen_tl.engine.decompose_bound`) are
exact only then."""

from __future__ import annotations

import torch

__all__ = ["full_precision_products"]


def full_precision_products(dtype: torch.dtype) -> bool:
    """Whether a CPU matrix product of ``dtype`` is carried out in that dtype: float64 always; float32 unless the user
    allowed reduced precision, by either of PyTorch's settings (``torch.set_float32_matmul_precision`` or the
    per-backend ``torch.backends.*.fp32_precision``) — an unreadable setting counts as reduced. (A half-precision
    product accumulates in float32 on the CPU and rounds once: it follows the float32 setting.)"""
    if dtype == torch.float64:
        return True
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # the per-backend settings are in use (torch.backends.*.fp32_precision)
        mkl = getattr(getattr(getattr(torch.backends, "mkldnn", None), "matmul", None), "fp32_precision", None)
        return mkl in ("ieee", "none")
