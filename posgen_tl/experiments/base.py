"""What every experiment shares: its ``Config`` (options written once), the run context, and the
parsing of option values from the command line.

An experiment's configuration is ONE frozen dataclass that subclasses :class:`Config`. Each
field is declared with :func:`option` — its default, its kind (how text parses into it), its help
text and its named preset values — and nothing else anywhere restates them: the library call
(``run(model, cfg)``), ``posgen-tl study NAME --key value``, the report stage and the notebooks
all build the same dataclass (:meth:`Config.preset`, :meth:`Config.from_text`)::

    @dataclass(frozen=True)
    class Config(base.Config):
        n_ref: int = option(4, "windows of the disjoint reference documents for the global k̄", "int",
                            quick=2, full=8)

Option kinds (text on the command line → value):

* ``int`` (positive) / ``count`` (any integer) / ``float`` / ``bool`` (true/false/yes/no/1/0) / ``text``;
* ``ints`` — ``10-19`` or ``0,5,10-12``; ``floats`` — ``0,0.02,0.05``; ``names`` — ``C1,C2``;
* ``layers`` — ``all``, ``every5`` (every 5th layer and the last; ``everyN`` likewise), a layer group (``early``,
  ``middle``, ``late``: :mod:`posgen_tl.maths.groups`) or a list as for ``ints``;
* ``pairs`` — ``d3:all,d3:20-29`` (``source:group`` pairs).

An unknown key, or a value that does not parse, is an error naming the key, the experiment and
what it accepts — never a silently ignored option.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

__all__ = ["Config", "Option", "option", "config_of", "Result", "run_or_skip", "shares_heap", "save_tables", "load_tables",
           "n_ref_option", "layers_option", "batch_option", "auto_batch", "PARSERS", "PRESETS", "parse_value", "resolve_layers",
           "parse_assignments"]

PRESETS = ("default", "quick", "full")
_UNSET: Any = object()
C = TypeVar("C", bound="Config")


# ----------------------------------------------------------------------------- parsing option values


def _ints(s: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        a, sep, b = part.replace("–", "-").partition("-")
        if sep and a and b:
            lo, hi = int(a), int(b)
            if hi < lo:
                raise ValueError(f"range {part!r} runs backwards")
            out += list(range(lo, hi + 1))
        else:
            out.append(int(part))
    if not out:
        raise ValueError("empty list")
    return tuple(out)


def _floats(s: str) -> tuple[float, ...]:
    out = tuple(float(x) for x in s.split(",") if x.strip())
    if not out:
        raise ValueError("empty list")
    return out


def _names(s: str) -> tuple[str, ...]:
    out = tuple(x.strip() for x in s.split(",") if x.strip())
    if not out:
        raise ValueError("empty list")
    return out


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{s!r} is not a boolean (true/false)")


def _pairs(s: str) -> tuple[tuple[str, str], ...]:
    out = []
    for part in _names(s):
        a, sep, b = part.partition(":")
        if not (sep and a and b):
            raise ValueError(f"{part!r} is not 'source:group'")
        out.append((a, b.replace("-", "–")))
    return tuple(out)


def _pos_int(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise ValueError(f"{v} is not positive")
    return v


_LAYER_WORDS = ("all", "early", "middle", "late")  # and everyN (:func:`_every`)


def _every(v: str) -> int | None:
    """``N`` of a layer word ``everyN`` (N ≥ 1), else None."""
    return int(v[5:]) if v.startswith("every") and v[5:].isdigit() and int(v[5:]) >= 1 else None


def _layers(s: str) -> str | tuple[int, ...]:
    v = s.strip().lower()
    return v if v in _LAYER_WORDS or _every(v) else _ints(s)


def _text_or_none(s: str) -> str | None:
    return None if s.strip().lower() in ("", "none", "default") else s


PARSERS: dict[str, Callable[[str], Any]] = {
    "ints": _ints, "floats": _floats, "names": _names, "int": _pos_int, "float": float, "bool": _bool,
    "pairs": _pairs, "text": _text_or_none, "count": int, "layers": _layers,
}


def parse_value(kind: str, text: str) -> Any:
    """``text`` parsed as an option of ``kind`` (a key of :data:`PARSERS`)."""
    return PARSERS[kind](text)


def gate(model: Any, cfg: Any, what: str) -> None:
    """The study's gate (:func:`posgen_tl.hooks.gate.require_exact`) on the layers ``cfg.layers`` selects
    (every layer where the Config has no ``layers``): raises ``UncheckedModelError`` before any work
    if one of them has not passed the exactness check for this model, dtype and device."""
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415
    from posgen_tl.hooks.gate import require_exact  # noqa: PLC0415

    value = getattr(cfg, "layers", None)
    layers = None if value is None else resolve_layers(value, probe_hooks(model)[0].n_layers)
    require_exact(model, layers, what)


def resolve_layers(value: str | Sequence[int] | None, n_layers: int) -> list[int]:
    """The layer indices a ``layers`` option means for an ``n_layers`` model: ``"all"``/``None`` →
    all, ``"every5"`` → every 5th and the last (``"everyN"``: every N-th and the last), ``"early"``/``"middle"``/``"late"`` → that group of
    :func:`posgen_tl.maths.groups.layer_groups`, a list → itself (checked against ``n_layers``)."""
    from posgen_tl.maths.groups import layer_groups  # noqa: PLC0415

    if value is None or value == "all":
        return list(range(n_layers))
    if isinstance(value, str) and (step := _every(value)):
        return sorted(set(range(0, n_layers, step)) | {n_layers - 1})
    if isinstance(value, str):
        groups = layer_groups(n_layers)
        if value not in groups:
            raise ValueError(f"layers={value!r}: expected all, everyN (e.g. every5), early, middle, late or a list like "
                             "10-19")
        return groups[value]
    out = sorted({int(x) for x in value})
    bad = [x for x in out if not 0 <= x < n_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist in a {n_layers}-layer model")
    return out


def parse_assignments(items: Sequence[str] | None) -> dict[str, str]:
    """``["layers=10-19", "n_ref=8"]`` → ``{"layers": "10-19", "n_ref": "8"}`` (text, parsed per experiment).

    Raises:
        ValueError: an item without ``=`` or a key given twice."""
    out: dict[str, str] = {}
    for it in items or ():
        key, sep, val = it.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key or not val.strip():
            raise ValueError(f"--param {it!r}: expected KEY=VALUE")
        if key in out:
            raise ValueError(f"--param {key} given twice")
        out[key] = val.strip()
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------- options and configs


@dataclass(frozen=True)
class Option:
    """One option of an experiment's Config: its name, kind, default, help and preset values."""

    name: str
    kind: str
    default: Any
    help: str
    presets: Mapping[str, Any]

    def value_in(self, preset: str) -> Any:
        """The value under ``preset`` (the default where the preset does not set it)."""
        return self.presets.get(preset, self.default)


def option(default: Any, help: str, kind: str, *, quick: Any = _UNSET, full: Any = _UNSET) -> Any:
    """A Config field: ``default`` and the values of the ``quick`` and ``full`` presets, the
    ``kind`` its command-line text parses as (a key of :data:`PARSERS`) and its ``help``."""
    if kind not in PARSERS:
        raise ValueError(f"unknown option kind {kind!r}; one of {', '.join(PARSERS)}")
    presets = {k: v for k, v in (("quick", quick), ("full", full)) if v is not _UNSET}
    return field(default=default, metadata={"kind": kind, "help": help, "presets": presets})


def n_ref_option(default: int = 4, *, quick: int = 2, full: int = 8) -> Any:
    """The ``n_ref`` option of the experiments that need a global k̄: windows of the reference documents."""
    return option(default, "windows of the disjoint reference documents for the global k̄", "int", quick=quick, full=full)


def layers_option(what: str, *, quick: Any = "every5") -> Any:
    """The ``layers`` option (``all`` by default, every 5th layer in the quick preset): ``what`` they are."""
    return option("all", f"layers {what}", "layers", quick=quick)


def batch_option(default: int, what: str = "sequences", *, auto: bool = False) -> Any:
    """The ``batch_size`` option: ``what`` per forward batch; with ``auto`` (a run that resolves it with
    :func:`auto_batch`) 0 is allowed too: as many as fit half the free memory."""
    if auto:
        return option(default, f"{what} per forward batch; 0 = as many as fit half the free memory", "count")
    return option(default, f"{what} per forward batch", "int")


def auto_batch(cfg: Any, model: Any, n: int, n_seq: int, **kw: Any) -> int:
    """``cfg.batch_size``, or where it is 0 the sequences one forward takes
    (:func:`posgen_tl.hooks.memory.batch_that_fits` of ``n_seq`` sequences of ``n`` tokens, ``kw`` passed on; a
    negative one is refused when the Config is made)."""
    from posgen_tl.hooks.memory import batch_that_fits  # noqa: PLC0415

    return int(cfg.batch_size) or batch_that_fits(model, n, n_seq, **kw)


@dataclass(frozen=True)
class Config:
    """The sizes every experiment shares; an experiment's own Config adds its options.

    Build one with ``Config()`` (defaults), :meth:`preset` (``"quick"``, ``"full"``),
    :meth:`from_text` (command-line text) or :meth:`replace` (checked keyword changes).
    """

    n_seq: int = option(12, "analysed sequences (windows of distinct documents first)", "int", quick=2, full=32)
    seq_len: int = option(128, "tokens per sequence", "int", quick=64, full=256)
    seed: int = option(0, "seed of the document split, the windows, the swaps and the random twin", "count")
    corpus: str | None = option(None, "UTF-8 text file or folder of .txt/.md files (default: the stdlib's pydoc "
                                      "topics, 79 documents)", "text")
    twin: bool = option(True, "run the random-init twin beside the trained model where the experiment has one", "bool")

    #: the experiment's name (``posgen-tl study NAME``); set by each subclass
    NAME: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if (b := int(getattr(self, "batch_size", 0))) < 0:
            raise ValueError(f"{self.NAME}: batch_size={b}; sequences per batch, or 0 (as many as fit)")
        self.check()

    def check(self) -> None:
        """Raise ValueError naming the option when the values cannot give a valid run (an experiment
        overrides it). Called on every construction, so each door (Python, ``study``, ``report``) fails
        before a model loads."""

    @classmethod
    def options(cls) -> list[Option]:
        """Every option of this Config, in declaration order."""
        return [Option(f.name, f.metadata["kind"], f.default, f.metadata["help"], f.metadata["presets"])
                for f in dataclasses.fields(cls) if "kind" in f.metadata]

    @classmethod
    def preset(cls: type[C], name: str = "default", **overrides: Any) -> C:
        """The Config of preset ``name`` (``default``, ``quick``, ``full``) with ``overrides`` applied."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; one of {', '.join(PRESETS)}")
        base = cls(**{o.name: o.value_in(name) for o in cls.options()})
        return base.replace(**overrides) if overrides else base

    @classmethod
    def from_text(cls: type[C], params: Mapping[str, str], preset: str = "default", *, strict: bool = True,
                  **values: Any) -> C:
        """A Config from command-line text ``params`` (``{"layers": "10-19"}``), on top of ``preset``
        and of already-typed ``values`` (``None`` values are ignored).

        Raises:
            ValueError: with ``strict``, a key this experiment does not declare (the message lists the
                accepted keys); a value that does not parse (the message names key, experiment and kind).
        """
        opts = {o.name: o for o in cls.options()}
        typed = {k: v for k, v in values.items() if v is not None}
        for key, text in params.items():
            if key not in opts:
                if strict:
                    raise ValueError(f"unknown parameter {key!r} for {cls.NAME or cls.__name__}; accepted: "
                                     f"{', '.join(opts)}")
                continue
            try:
                typed[key] = parse_value(opts[key].kind, text)
            except (ValueError, TypeError) as e:
                raise ValueError(f"parameter {key}={text!r} ({cls.NAME}): {e}; expected {opts[key].kind}") from e
        return cls.preset(preset, **typed)

    def replace(self: C, **changes: Any) -> C:
        """A copy with ``changes``; an unknown key is a ValueError naming it and the accepted keys."""
        names = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(changes) - names)
        if bad:
            raise ValueError(f"{type(self).NAME or type(self).__name__} has no option {', '.join(bad)}; accepted: "
                             f"{', '.join(sorted(names))}")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """``{option: value}`` (JSON-friendly: tuples become lists)."""
        def plain(v: Any) -> Any:
            return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def describe(cls) -> str:
        """One line per option: ``--key VALUE (kind; default …; quick …; full …) help``."""
        lines = []
        for o in cls.options():
            pre = "".join(f"; {k} {_show(v)}" for k, v in o.presets.items())
            lines.append(f"  --{o.name.replace('_', '-')} ({o.kind}; default {_show(o.default)}{pre})  {o.help}")
        return "\n".join(lines)


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(_show(x) if not isinstance(x, tuple) else ":".join(map(str, x)) for x in v) or "()"
    return str(v)


def config_of(cls: type[C], cfg: C | None, overrides: Mapping[str, Any]) -> C:
    """``cfg`` (default ``cls()``) with keyword ``overrides`` — the one way a library call turns
    ``run(model, cfg, **overrides)`` into a Config. Raises TypeError for a Config of another experiment."""
    if cfg is None:
        cfg = cls()
    elif not isinstance(cfg, cls):
        raise TypeError(f"expected a {cls.__module__}.{cls.__qualname__}, got {type(cfg).__module__}.{type(cfg).__qualname__}")
    return cfg.replace(**overrides) if overrides else cfg


@dataclass(frozen=True)
class Result:
    """What an experiment's ``run`` returns: its ``tables`` (tidy DataFrames by name — everything its figures
    and its section need), its ``config`` (the Config's options as a dict, overrides included) and ``meta``
    (model, documents, wall time, commit, …). A stage that could not run is a Result too: no tables and
    ``meta["skipped"]`` saying why (:attr:`skipped`). Each experiment subclasses it to document its tables."""

    tables: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    #: other names a table answers to as an attribute (``result.rows`` for ``tables["curves"]``), per experiment
    ALIASES: ClassVar[dict[str, str]] = {}

    def __getitem__(self, name: str) -> Any:
        return self.tables[name]

    def __getattr__(self, name: str) -> Any:
        """A table as an attribute: ``result.summary`` is ``result.tables["summary"]`` (or the table
        :attr:`ALIASES` names). Raises AttributeError, naming the tables there are, for any other name."""
        if name.startswith("__") or name in ("tables", "config", "meta"):
            raise AttributeError(name)
        tables = self.__dict__.get("tables") or {}
        key = type(self).ALIASES.get(name, name)
        if key in tables:
            return tables[key]
        raise AttributeError(f"{type(self).__qualname__} has no table or attribute {name!r}; its tables: "
                             f"{sorted(tables)}")

    @property
    def skipped(self) -> str | None:
        """Why the stage did not run (``None`` when it ran)."""
        return self.meta.get("skipped")


R = TypeVar("R", bound=Result)


def run_or_skip(run: Callable[..., R], result: type[R], what: str, model: Any, cfg: Any, **kw: Any) -> R:
    """``run(model, cfg, **kw)``, or a ``result`` with no tables whose ``meta`` holds ``skipped`` ("<what> skipped:
    <reason>") and a ``hint`` (:data:`posgen_tl.report.html.SKIP_HINTS`) when

    * the corpus cannot give the windows the experiment needs (a :class:`~posgen_tl.io.corpus.CorpusError`:
      e.g. one document, so no disjoint reference documents), or
    * the model cannot be analysed this way (a :class:`~posgen_tl.hooks.capture.CaptureError` or
      :class:`~posgen_tl.maths.rope.RopeError`, the library's named refusals: e.g. ``hook_attn_scores``
      that are not pre-softmax logits, so no logit substitution; dynamic RoPE past its switch length).

    Any other error (a bad option, a bug) propagates: a stage is never reported as skipped for a
    reason that is not one of these two."""
    from posgen_tl.hooks.capture import CaptureError  # noqa: PLC0415
    from posgen_tl.io.corpus import CorpusError  # noqa: PLC0415
    from posgen_tl.maths.rope import RopeError  # noqa: PLC0415
    from posgen_tl.report.html import SKIP_HINTS  # noqa: PLC0415

    try:
        return run(model, cfg, **kw)
    except (CorpusError, CaptureError, RopeError) as e:
        kind = "corpus" if isinstance(e, CorpusError) else "model"
        return result({}, cfg.as_dict(), {"skipped": f"{what} skipped: {e}", "hint": SKIP_HINTS[kind]})


F = TypeVar("F", bound=Callable[..., Any])


def shares_heap(run: F) -> F:
    """Decorator of an experiment's ``run(model, …)``: on the CPU the whole run executes in
    :func:`posgen_tl.hooks.heap.passes_share_heap` — its passes (hundreds of forwards at a report's sizes) keep the
    host heap between them instead of each handing it back to the system and page-faulting it in again; the heap is
    trimmed when the resident memory grew past a margin, and once at the run's end. On other devices ``run`` as it
    is. The numbers do not change (where memory comes from is all it sets)."""

    @functools.wraps(run)
    def wrapped(model: Any, *args: Any, **kw: Any) -> Any:
        from posgen_tl.hooks.capture import model_device  # noqa: PLC0415
        from posgen_tl.hooks.heap import passes_share_heap  # noqa: PLC0415

        cpu = model_device(model).type == "cpu"
        with passes_share_heap() if cpu else contextlib.nullcontext():
            return run(model, *args, **kw)

    return wrapped  # type: ignore[return-value]


def twin_of(model: Any, twin: Any, seed: int) -> Any:
    """The random-init twin a ``run`` uses: ``twin`` itself (a model), ``twin(seed)`` (a callable that gives the
    report's shared twin of that seed, :meth:`posgen_tl.report.context.Context.twin`; a callable without parameters
    is called as ``twin()``), or a fresh :func:`posgen_tl.io.models.random_twin` of ``model`` when ``None`` or
    ``True`` (``False`` is the caller's business: no twin runs)."""
    import inspect  # noqa: PLC0415

    import torch  # noqa: PLC0415

    if twin is None or twin is True:
        from posgen_tl.io.models import random_twin  # noqa: PLC0415

        return random_twin(model, seed)
    if isinstance(twin, torch.nn.Module) or not callable(twin):
        return twin
    return twin(seed) if inspect.signature(twin).parameters else twin()


def means_fingerprint(k_means: Mapping[int, Any] | None) -> str | None:
    """SHA-1 of given per-layer k̄ (layer order, float64 bytes), so that a checkpoint tells two sets of given means
    apart; ``None`` for none."""
    return None if k_means is None else _digest((str(layer), k_means[layer]) for layer in sorted(k_means))


def _digest(items: Any, per_tensor: int | None = None) -> str:
    """SHA-1 of ``(name, tensor)`` pairs: each name, then the tensor's first ``per_tensor`` values (all: None) as
    float64 bytes."""
    import hashlib  # noqa: PLC0415

    h = hashlib.sha1()
    for name, t in items:
        h.update(name.encode())
        h.update(t.detach().reshape(-1)[:per_tensor].double().cpu().numpy().tobytes())
    return h.hexdigest()


def model_digest(model: Any, per_tensor: int = 256) -> str:
    """A cheap SHA-1 of a model's weights — the first ``per_tensor`` values of every parameter, in order — so that a
    checkpoint tells two models of one name apart (e.g. two random twins of different seeds)."""
    return _digest(model.named_parameters(), per_tensor)


def pieces(checkpoint: Any, what: str, cfg: Config, model: Any, windows: Any, *,
           statistics: Sequence[str] = (), **extra: Any) -> Any:
    """The :class:`posgen_tl.io.checkpoint.Pieces` of one run: kept in ``checkpoint`` (a folder; ``None`` keeps
    nothing) under the design's fingerprint — the config without the ``statistics``-only options, the model's name
    and dtype, the analysed ``windows`` and any ``extra`` (e.g. the reference windows). ``what`` names the
    experiment in a refusal.

    Raises:
        ValueError: the folder keeps pieces of another design."""
    from posgen_tl.engine.swaps import windows_fingerprint  # noqa: PLC0415
    from posgen_tl.hooks.capture import model_dtype, probe_hooks  # noqa: PLC0415
    from posgen_tl.io.checkpoint import Pieces  # noqa: PLC0415

    if checkpoint is None:
        return Pieces(None, {}, what)
    design = {k: v for k, v in cfg.as_dict().items() if k not in statistics}
    fp = dict(format=1, config=design, model=probe_hooks(model)[0].model_name, dtype=str(model_dtype(model)),
              weights=model_digest(model), windows=windows_fingerprint(windows), docs=windows.doc_ids.tolist(),
              starts=windows.starts.tolist(), **extra)
    return Pieces(checkpoint, fp, what)


def model_folder(checkpoint: Any, label: str) -> Any:
    """The sub-folder of ``checkpoint`` that keeps one of a run's models' pieces (``label``: ``"trained"`` or
    ``"random"``); ``None`` without a checkpoint."""
    from pathlib import Path  # noqa: PLC0415

    return None if checkpoint is None else Path(checkpoint) / label


def model_pieces(checkpoint: Any, label: str, what: str, cfg: Config, model: Any, windows: Any, **extra: Any) -> Any:
    """:func:`pieces` of one of a run's models (``label``: ``"trained"`` or ``"random"``), kept in
    :func:`model_folder` under that model's own fingerprint (so another twin is another design)."""
    return pieces(model_folder(checkpoint, label), what, cfg, model, windows, **extra)


def kept_tables(kept: Any, label: str, names: Sequence[str], compute: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
    """The tables ``names`` of ONE computation, each kept in ``kept`` (:class:`~posgen_tl.io.checkpoint.Pieces`) as
    ``<label>_<name>``: ``compute()`` (a mapping holding each name's DataFrame, and maybe more) runs at most once, and
    only when one of them is not kept. Float columns are float64, so a table read back from a checkpoint equals the
    computed one exactly. Returns ``{name: DataFrame}``."""
    import numpy as np  # noqa: PLC0415

    memo: dict[str, Any] = {}

    def one(name: str) -> Any:
        if not memo:
            got = compute()
            for k in names:
                df = got[k]
                floats = [c for c in df.columns if df[c].dtype.kind == "f"]
                memo[k] = df.astype({c: np.float64 for c in floats})
        return memo[name]

    return {n: kept.rows(f"{label}_{n}", lambda n=n: one(n)) for n in names}


# ----------------------------------------------------------------------------- a Result's files


def save_tables(name: str, tables: Mapping[str, Any], config: Mapping[str, Any], meta: Mapping[str, Any],
                folder: Any, files: Mapping[str, str] | None = None) -> list[Any]:
    """Write a Result into ``folder``: each table as a CSV (``files[table]`` where given, else
    ``<name>_<table>.csv``) and ``<name>_result.json`` (config, meta, the table names and their files).
    Returns the written paths."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths, names = [], {}
    for table, df in tables.items():
        names[table] = (files or {}).get(table, f"{name}_{table}.csv")
        p = out / names[table]
        df.to_csv(p, index=False)
        paths.append(p)
    p = out / f"{name}_result.json"
    p.write_text(json.dumps(dict(config=dict(config), meta=dict(meta), tables=list(tables), files=names), indent=1,
                            default=lambda x: x.item() if hasattr(x, "item") else str(x)))
    return [*paths, p]


def load_tables(name: str, folder: Any, files: Mapping[str, str] | None = None,
                legacy_meta: str | Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(tables, config, meta)`` that :func:`save_tables` wrote into ``folder`` (floats read back exactly).

    A folder written before the experiment had a Result (no ``<name>_result.json``) is read from its table
    ``files`` (those present), its meta from ``legacy_meta`` (one JSON file; or ``{key: file}``, giving
    ``meta[key]`` per file present, a ``skipped`` record lifted to the top) and its config from the study's
    ``<name>.json``.

    Raises:
        FileNotFoundError: neither a ``<name>_result.json`` nor any of ``files`` there."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    import pandas as pd  # noqa: PLC0415

    d = Path(folder)
    f = d / f"{name}_result.json"
    if f.exists():
        info = json.loads(f.read_text())
        where = info.get("files") or {t: f"{name}_{t}.csv" for t in info["tables"]}
        tables = {t: pd.read_csv(d / where[t], float_precision="round_trip") for t in info["tables"]}
        return tables, info["config"], info["meta"]
    present = {t: d / fn for t, fn in (files or {}).items() if (d / fn).exists()}
    metas = {"": legacy_meta} if isinstance(legacy_meta, str) else dict(legacy_meta or {})
    found = {k: json.loads((d / fn).read_text()) for k, fn in metas.items() if (d / fn).exists()}
    if not present and not found:
        raise FileNotFoundError(f"no {name} result in {d} (neither {f.name} nor {', '.join((files or {}).values())})")
    tables = {t: pd.read_csv(p, float_precision="round_trip") for t, p in present.items()}
    meta: dict[str, Any] = dict(found.get("", {})) if "" in metas else dict(found)
    for sub in list(found.values()) if "" not in metas else []:
        for key in ("skipped", "hint"):
            if key in sub:
                meta[key] = sub[key]
    study = d / f"{name}.json"
    config = json.loads(study.read_text()).get("config", {}) if study.exists() else {}
    return tables, config, meta
