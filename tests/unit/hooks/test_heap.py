"""The host heap during a streamed pass (posgen_tl.hooks.heap): big blocks kept in glibc's heap for the pass only."""

from __future__ import annotations

import contextlib
import platform
import sys

import pytest
import tiny_models as tm
import torch
from fake_libc import BACK, KEEP, FakeLibc

from posgen_tl.hooks import heap


def test_large_blocks_are_kept_for_the_outermost_pass_only_and_glibc_s_maxima_come_back_even_on_errors(monkeypatch):
    lib = FakeLibc()
    monkeypatch.setattr(heap, "_LIBC", lib)
    keep, back = KEEP, BACK
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


def test_passes_inside_a_run_keep_the_heap_between_them_unless_it_grew_past_the_margin(monkeypatch):
    """In passes_share_heap the settings are made once; a pass's end (a nested large_blocks_kept) asks the run's
    BatchTrim — the first end sets the level, a later end trims only past the margin — and the run's end restores
    glibc's maxima and trims, also on an error. Outside a run a pass's end still restores and trims."""
    lib = FakeLibc()
    monkeypatch.setattr(heap, "_LIBC", lib)
    gib = 2**30
    sizes = iter([1 * gib, 1 * gib + 100 * 2**20, 2 * gib])
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(sizes))
    keep, back = KEEP, BACK
    with heap.passes_share_heap() as ok:
        assert ok and lib.calls == keep
        for _ in range(2):  # the first end sets the level, the second stays within the margin
            with heap.large_blocks_kept():
                pass
        assert lib.calls == keep  # no trim, no setting touched between the passes
        with heap.large_blocks_kept():  # this pass grew the process by 1 GiB: its end trims
            pass
        assert lib.calls == keep + [("trim", 0)]
    assert lib.calls == keep + [("trim", 0)] + back and heap._BETWEEN == [None] and heap._DEPTH == [0]
    lib.calls.clear()
    with heap.large_blocks_kept():  # a pass on its own: as before
        pass
    assert lib.calls == keep + back
    lib.calls.clear()
    with pytest.raises(KeyboardInterrupt), heap.passes_share_heap():
        raise KeyboardInterrupt
    assert lib.calls == keep + back and heap._BETWEEN == [None] and heap._DEPTH == [0]


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


def test_batch_trim_trims_only_once_resident_memory_grew_past_the_first_batch_by_the_margin(monkeypatch):
    """The first batch's end sets the level; a later batch trims only above it by TRIM_GROWTH (at least
    TRIM_MIN_GROWTH; with ``growth=0`` by TRIM_MIN_GROWTH alone); without a readable resident size every batch
    trims."""
    lib = FakeLibc()
    monkeypatch.setattr(heap, "_LIBC", lib)
    gib = 2**30
    sizes = iter([1 * gib, 1 * gib + 200 * 2**20, int(1.25 * gib), int(1.25 * gib) + 1, 1 * gib])
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(sizes))
    trim = heap.BatchTrim()
    assert [trim() for _ in range(5)] == [False, False, False, True, False]
    assert lib.calls == [("trim", 0)]
    small = iter([100 * 2**20, 100 * 2**20 + 127 * 2**20, 100 * 2**20 + 129 * 2**20])  # 25 % < 128 MiB: the floor
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(small))
    trim = heap.BatchTrim()
    assert [trim() for _ in range(3)] == [False, False, True]
    big = iter([4 * gib, 4 * gib + 127 * 2**20, 4 * gib + 129 * 2**20])  # growth=0 (a chunked pass's layers): 128 MiB
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(big))
    trim = heap.BatchTrim(growth=0.0)
    assert [trim() for _ in range(3)] == [False, False, True]
    monkeypatch.setattr(heap, "resident_bytes", lambda: None)
    trim = heap.BatchTrim()
    assert [trim() for _ in range(2)] == [True, True]
    monkeypatch.setattr(heap, "_LIBC", False)  # no glibc: nothing to trim, whatever the sizes
    assert heap.BatchTrim()() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
def test_resident_bytes_reads_this_process_s_resident_memory():
    """Within the same page size and order as what the kernel reports in /proc/self/status (VmRSS, kB)."""
    got = heap.resident_bytes()
    with open("/proc/self/status") as f:
        vm_rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert got is not None and abs(got - vm_rss) <= 0.05 * vm_rss + 16 * 2**20
