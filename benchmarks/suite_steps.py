"""The suite's worker side: the model, the tokens and every measured step (:class:`Bench`), and the peak-memory
counters — what benchmarks/suite.py runs in its subprocesses."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

FRACS, TARGET_LEN = (0.0, 0.1, 0.2), 64


# ============================================================================ worker side


def status_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim``: otherwise memory freed by the setup
    — k̄ pass, fit operators — stays resident and hides the step's own peak), then reset VmHWM."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def batch_size_for(seq_len: int) -> int:
    return max(1, min(4, 2048 // seq_len))


class Bench:
    """The model, the tokens and every step of the suite as a zero-argument callable."""

    def __init__(self, model_name: str | object, n_seq: int, seq_len: int, batch_size: int | None = None,
                 device: str = "cpu") -> None:
        """``model_name``: a zoo name or folder (loaded here), or a model object already loaded (tests)."""
        import torch

        from posgen_tl.hooks.capture import probe_hooks
        from posgen_tl.io.corpus import corpus_tokens
        from posgen_tl.io.models import load_model

        self.torch = torch
        self.device = device
        if isinstance(model_name, str) and model_name.startswith("random:"):  # a random-init model of a real shape
            from random_shapes import build

            self.model = build(model_name, device=device)
        else:
            self.model = load_model(model_name, device=device) if isinstance(model_name, str) else model_name
        self.spec, self.info = probe_hooks(self.model)
        self.n_ref = max(1, n_seq // 2)
        # the tokens live where the model does: a CUDA timing never includes a host-to-device copy
        toks = corpus_tokens(self.model, None, seq_len=seq_len, n_seq=n_seq + self.n_ref).to(device)
        self.tokens, self.ref = toks[:n_seq], toks[n_seq:]
        self.bs = batch_size or batch_size_for(seq_len)
        self.n_seq, self.seq_len = n_seq, seq_len
        self._kbar = None
        self._km = None
        self._base = None
        with torch.no_grad():
            self.model(toks[:1, :16])  # warm-up: hook probe done, allocator primed

    def sync(self) -> None:
        """Wait for the device's queued work (CUDA runs asynchronously: a timer read without it measures
        only the launches); a no-op on the CPU."""
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    # ------------------------------------------------------------ shared inputs (not timed)

    def kbar(self):
        if self._kbar is None:
            from posgen_tl.experiments.decomposition import reference_key_means

            self._kbar = reference_key_means(self.model, self.ref, sink=1, batch_size=self.bs, progress=False)
        return self._kbar

    def causal_inputs(self):
        if self._km is None:
            from posgen_tl.engine.swaps import nll_on_target
            from posgen_tl.hooks.edits import key_means

            n = self.tokens.shape[1]
            self._km = key_means(self.model, self.tokens[:, : n - TARGET_LEN])
            self._base = nll_on_target(self.model, self.tokens, target_len=TARGET_LEN, batch_size=self.bs)
        return self._km, self._base

    def intervention(self):
        from posgen_tl.hooks.edits import Intervention
        from posgen_tl.maths.groups import layer_groups

        nb, n = self.spec.layer(0).n_bands, self.spec.n_layers
        q = max(1, nb // 4)
        return Intervention("destroy", bands=list(range(q)), layers=layer_groups(n)["middle"], alpha=0.5,
                            label="destroy fast-band key offset")

    def geometry(self) -> None:
        from posgen_tl.maths import moments as _moments

        _moments._GEOMS.clear()
        windows = {self.spec.layer(i).sliding_window for i in range(self.spec.n_layers)}
        for s in (0, 1):
            for w in windows:
                _moments.geometry(self.seq_len, s, w)

    # ------------------------------------------------------------ steps

    def forward(self) -> None:
        """The plain forward, on the CPU with large blocks kept in glibc's heap as every pass of the package runs
        (``posgen_tl.hooks.heap.large_blocks_kept``: with glibc's defaults a CPU forward page-faults each big tensor
        afresh; ``benchmarks/bench_heap.py`` measures that apart) — the ratios compare like with like."""
        import contextlib

        from posgen_tl.hooks.heap import large_blocks_kept

        with self.torch.no_grad(), large_blocks_kept() if self.device == "cpu" else contextlib.nullcontext():
            for i in range(0, self.n_seq, self.bs):
                out = self.model(self.tokens[i : i + self.bs])
                del out

    def capture(self) -> None:
        """The pass the analyses stream from, as the feature statistics run it (a chunked forward where
        :func:`auto_chunk` says so; the decomposition chunks only beyond 2 048 tokens)."""
        from posgen_tl.hooks.chunked import auto_chunk
        from posgen_tl.hooks.stream import stream_qk

        stream_qk(self.model, self.tokens, lambda c: None, batch_size=self.bs, progress=False,
                  chunk=auto_chunk(self.model, self.tokens.shape[1]), stack=0)  # stacked where the analyses stack

    def kbar_pass(self) -> None:
        from posgen_tl.experiments.decomposition import reference_key_means

        reference_key_means(self.model, self.ref, sink=1, batch_size=self.bs, progress=False)

    def decomposition(self):
        from posgen_tl.experiments.decomposition import decompose_model

        return decompose_model(self.model, self.tokens, reference=self.ref, k_mean=self.kbar(), batch_size=self.bs,
                               progress=False)

    def pattern(self):
        from posgen_tl.experiments.pattern import feature_pattern

        return feature_pattern(self.model, self.tokens, batch_size=self.bs, progress=False)

    def tolerance_curve(self) -> None:
        from posgen_tl.engine.swaps import transposition_curve

        transposition_curve(self.model, self.tokens, fracs=FRACS, seeds=(0,), target_len=TARGET_LEN,
                            modes=("T1",), batch_size=self.bs, progress=False)

    def target_nll(self) -> None:
        """The unedited target-span NLL as the tolerance and causal passes compute it (a chunked forward beyond 2 048
        tokens): the base for their passes where a whole forward does not fit in memory."""
        from posgen_tl.engine.swaps import nll_on_target

        nll_on_target(self.model, self.tokens, target_len=TARGET_LEN, batch_size=self.bs)

    def causal_condition(self) -> None:
        """One condition of the causal study (:func:`posgen_tl.engine.conditions.condition_rows`): the clean
        pass under the intervention and one pass per swap fraction > 0."""
        from posgen_tl.engine.conditions import Condition, condition_rows
        from posgen_tl.io.sampling import Windows

        km, _ = self.causal_inputs()
        n = self.n_seq
        win = Windows(self.tokens, self.torch.arange(n), self.torch.zeros(n, dtype=self.torch.long),
                      [f"row{i}" for i in range(n)])
        cond = Condition("destroy", self.intervention())
        for s in range(0, n, self.bs):
            condition_rows(self.model, win.subset(range(s, min(s + self.bs, n))), cond, k_means=km,
                           target_len=TARGET_LEN, fracs=FRACS, seeds=(0,))

    def sufficiency(self) -> None:
        raise NotImplementedError  # replaced in steps() when posgen_tl.experiments.sufficiency exists

    # ------------------------------------------------------------ naive: run_with_cache, then the same analysis

    def _cached_captures(self):
        """Every layer's capture read from ONE ``run_with_cache`` of all sequences (the naive route), through the
        package's public reader :func:`posgen_tl.hooks.stream.capture_from_cache`."""
        from posgen_tl.hooks.stream import capture_from_cache

        info, spec, torch = self.info, self.spec, self.torch
        need = [info.q_hook, info.k_hook] + (["hook_rot_q", "hook_rot_k"] if info.rot_fires else [])
        names = {info.name(layer, h) for layer in range(spec.n_layers) for h in need}
        with torch.no_grad():
            _, cache = self.model.run_with_cache(self.tokens, names_filter=lambda nm: nm in names)
        caps = [capture_from_cache(self.model, cache, layer) for layer in range(spec.n_layers)]
        del cache
        return caps

    @contextlib.contextmanager
    def _replay(self, module):
        """``module.stream_qk`` (the streaming pass the analysis calls) replaced by the cached captures."""
        caps = self._cached_captures()
        orig = module.stream_qk

        def replay(model, tokens, fn, layers=None, **kw):
            for c in caps:
                if layers is None or c.layer in set(layers):
                    fn(c)

        module.stream_qk = replay
        try:
            yield
        finally:
            module.stream_qk = orig

    def naive_decomposition(self):
        from posgen_tl.engine import decompose_scores
        from posgen_tl.experiments import decomposition as dec

        km = self.kbar()
        with self._replay(decompose_scores):
            return dec.decompose_model(self.model, self.tokens, reference=self.ref, k_mean=km, batch_size=self.n_seq,
                                       progress=False)

    def naive_pattern(self):
        from posgen_tl.experiments import pattern as pat

        with self._replay(pat):
            return pat.feature_pattern(self.model, self.tokens, batch_size=self.n_seq, progress=False)

    def steps(self) -> dict[str, tuple[Callable[[], object], int]]:
        """``{name: (callable, forwards it is compared with)}``."""
        out = {
            "forward": (self.forward, 1), "capture": (self.capture, 1), "kbar_pass": (self.kbar_pass, 1),
            "decomposition": (self.decomposition, 1), "pattern": (self.pattern, 1),
            "tolerance_curve": (self.tolerance_curve, len(FRACS)),
            "causal_condition": (self.causal_condition, len(FRACS)), "target_nll": (self.target_nll, 1),
            "naive_decomposition": (self.naive_decomposition, 1), "naive_pattern": (self.naive_pattern, 1),
        }
        suff = sufficiency_step(self)
        if suff is not None:
            out["sufficiency"] = suff
        return out


def sufficiency_step(b: Bench):
    """One sufficiency condition (docs/method.md §5): the logits of the middle third of the layers
    SUBSTITUTED by ``f + g`` (global k̄) and the clean target NLL read — one forward. ``None`` when
    ``posgen_tl.experiments.sufficiency`` is not installed (older versions)."""
    import importlib.util

    if importlib.util.find_spec("posgen_tl.experiments.sufficiency") is None:
        return None
    from posgen_tl.engine.swaps import nll_on_target
    from posgen_tl.experiments.sufficiency import sufficiency_hooks_for

    n = b.spec.n_layers
    layers = list(range(n // 3, (2 * n) // 3))

    def run() -> None:
        hooks = sufficiency_hooks_for(b.model, "d3", layers, b.kbar())
        nll_on_target(b.model, b.tokens, target_len=TARGET_LEN, fwd_hooks=hooks, batch_size=b.bs)

    return (run, 1)


