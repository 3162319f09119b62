"""A stand-in for glibc's ``mallopt`` / ``malloc_trim`` that records its calls (posgen_tl.hooks.heap's tests), and the
calls a heap context makes when it sets glibc's thresholds (:data:`KEEP`) and when it restores them and trims
(:data:`BACK`)."""

from __future__ import annotations

from posgen_tl.hooks import heap


class FakeLibc:
    def __init__(self, accept: bool = True) -> None:
        self.calls: list[tuple] = []
        self.accept = accept

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1 if self.accept else 0

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("trim", pad))
        return 1


KEEP = [("mallopt", heap.M_MMAP_THRESHOLD, heap.KEEP_MMAP), ("mallopt", heap.M_TRIM_THRESHOLD, heap.KEEP_TRIM)]
BACK = [("mallopt", heap.M_MMAP_THRESHOLD, heap.GLIBC_MMAP_MAX), ("mallopt", heap.M_TRIM_THRESHOLD, heap.GLIBC_TRIM_MAX),
        ("trim", 0)]
