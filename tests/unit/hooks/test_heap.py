"""The host heap during a streamed pass (posgen_tl.hooks.heap): big blocks kept in glibc's heap for the pass only."""

from __future__ import annotations

import contextlib
import platform
import sys

import pytest
import tiny_models as tm
import torch

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


def test_large_blocks_are_kept_for_the_outermost_pass_only_and_glibc_s_maxima_come_back_even_on_errors(monkeypatch):
    lib = FakeLibc()
    monkeypatch.setattr(heap, "_LIBC", lib)
    keep = [("mallopt", heap.M_MMAP_THRESHOLD, heap.KEEP_MMAP), ("mallopt", heap.M_TRIM_THRESHOLD, heap.KEEP_TRIM)]
    back = [("mallopt", heap.M_MMAP_THRESHOLD, heap.GLIBC_MMAP_MAX), ("mallopt", heap.M_TRIM_THRESHOLD,
                                                                      heap.GLIBC_TRIM_MAX), ("trim", 0)]
    with heap.large_blocks_kept() as ok:
        assert ok and lib.calls == keep
        with heap.large_blocks_kept() as inner:  # a pass inside a pass: nothing set or restored by the inner one
            assert inner
        assert lib.calls == keep
    assert lib.calls == keep + back
    lib.calls.clear()
    with pytest.raises(KeyboardInterrupt), heap.large_blocks_kept():
        raise KeyboardInterrupt
    assert lib.calls == keep + back and heap._DEPTH == [0]


def test_a_libc_that_refuses_the_setting_or_no_glibc_at_all_is_reported_and_harmless(monkeypatch):
    monkeypatch.setattr(heap, "_LIBC", FakeLibc(accept=False))
    with heap.large_blocks_kept() as ok:
        assert ok is False
    monkeypatch.setattr(heap, "_LIBC", False)  # macOS, Windows, musl
    with heap.large_blocks_kept() as ok:
        assert ok is False
    assert heap.release_freed_memory() is False


@pytest.mark.skipif(not (sys.platform == "linux" and platform.libc_ver()[0] == "glibc"), reason="glibc only")
def test_a_stream_on_the_cpu_runs_with_large_blocks_kept_and_gives_the_same_captures(monkeypatch):
    """stream_qk wraps its batches in large_blocks_kept on the CPU (the real glibc takes the setting) and hands out
    the same q/k as a forward under glibc's defaults would."""
    from posgen_tl.hooks import stream

    model = tm.native(n_layers=2)
    toks = torch.randint(3, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    seen: list[bool] = []
    real = heap.large_blocks_kept

    @contextlib.contextmanager
    def spy():
        with real() as ok:
            seen.append(ok)
            yield ok

    monkeypatch.setattr(stream, "large_blocks_kept", spy)
    got: dict[int, torch.Tensor] = {}
    stream.stream_qk(model, toks, lambda c: got.__setitem__(c.layer, c.rot_k.clone()), progress=False)
    assert seen and all(seen)  # (the gate's exactness pass streams too)
    monkeypatch.setattr(stream, "large_blocks_kept", contextlib.nullcontext)
    want: dict[int, torch.Tensor] = {}
    stream.stream_qk(model, toks, lambda c: want.__setitem__(c.layer, c.rot_k.clone()), progress=False)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
