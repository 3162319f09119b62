"""Study parameters: ``posgen-tl study NAME --param KEY=VALUE`` (also ``report``).

The sizes every stage shares (``--n-seq``, ``--seq-len``, ``--quick``…) live in
:class:`~posgen_tl.report.context.ReportConfig`; what only one recipe knows (the edited layers of
the causal test, its controls, the swap fractions, the gaps of the length probe…) is a *study
parameter*, declared here once per stage with its parser and meaning. A stage reads them with
:func:`stage_params` (parsed values of the keys that were given; the stage keeps its own default
for the others), so the README's large runs and the report's quick ones are the same code with
different parameters.

Values are text on the command line:

* ``ints`` — ``10-19`` or ``0,5,10-12``; ``floats`` — ``0,0.02,0.05``; ``names`` — ``C1,C2``;
* ``int`` (positive) / ``count`` (any integer) / ``float``; ``bool`` — ``true/false/yes/no/1/0``;
  ``text`` — taken as given (e.g. a file path);
* ``pairs`` — ``d3:all,d3:20–29`` (``source:group`` of the sufficiency test).

An unknown key or a value that does not parse is an error naming the key, the stage and what
it accepts — never a silently ignored option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["Param", "STAGE_PARAMS", "parse_param_args", "check_params", "stage_params", "describe_params"]


def _ints(s: str) -> list[int]:
    out: list[int] = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        a, sep, b = part.partition("-")
        if sep and a and b:
            lo, hi = int(a), int(b)
            if hi < lo:
                raise ValueError(f"range {part!r} runs backwards")
            out += list(range(lo, hi + 1))
        else:
            out.append(int(part))
    if not out:
        raise ValueError("empty list")
    return out


def _floats(s: str) -> list[float]:
    out = [float(x) for x in s.split(",") if x.strip()]
    if not out:
        raise ValueError("empty list")
    return out


def _names(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
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


def _pairs(s: str) -> list[tuple[str, str]]:
    out = []
    for part in _names(s):
        a, sep, b = part.partition(":")
        if not (sep and a and b):
            raise ValueError(f"{part!r} is not 'source:group'")
        out.append((a, b))
    return out


def _pos_int(s: str) -> int:
    v = int(s)
    if v <= 0:
        raise ValueError(f"{v} is not positive")
    return v


PARSERS: dict[str, Callable[[str], Any]] = {
    "ints": _ints, "floats": _floats, "names": _names, "int": _pos_int, "float": float, "bool": _bool, "pairs": _pairs,
    "text": str, "count": int,
}


@dataclass(frozen=True)
class Param:
    """One study parameter: its value ``kind`` (a key of :data:`PARSERS`) and what it means."""

    kind: str
    help: str

    def parse(self, text: str) -> Any:
        return PARSERS[self.kind](text)


_N_REF = Param("int", "windows of the disjoint reference documents for the global k̄")
_LAYERS = Param("ints", "layers analysed (default: all; every 5th with --quick)")
_BATCH = Param("int", "sequences per forward batch")

#: stage → {key: Param}; the report's stages plus anything a registered study declares
STAGE_PARAMS: dict[str, dict[str, Param]] = {
    "exactness": {},
    "decomposition": {"n_ref": _N_REF, "layers": _LAYERS, "batch_size": _BATCH,
                      "bound_rows": Param("int", "query rows on which the D3 bound is checked (float64)")},
    "pattern": {"n_ref": _N_REF, "layers": _LAYERS, "batch_size": _BATCH},
    "tolerance": {
        "n_ref": _N_REF,
        "layers": Param("ints", "layers whose keys the causal test edits (default: the middle third)"),
        "controls": Param("names", "controls of METHOD §5 to run, from C1,C2,C3,C4 (default all; C1 with --quick)"),
        "fracs": Param("floats", "swap fractions p (must include 0)"),
        "seeds": Param("ints", "swap seeds, averaged inside each sequence"),
        "twin_seeds": Param("ints", "swap seeds for the random twin's T1/T2 curves"),
        "alpha": Param("float", "strength of 'destroy' (the controls' own α is matched to its damage)"),
        "match_subset": Param("int", "sequences used to match each control's damage"),
        "match_steps": Param("int", "damage evaluations per control when matching"),
        "target_len": Param("int", "tokens at the end whose NLL is measured (never perturbed)"),
        "batch_size": _BATCH,
        "t12": Param("bool", "run the T1/T2 curves (trained + twin, TOST)"),
        "causal": Param("bool", "run the causal test with its controls"),
    },
    "heads": {
        "n_ref": _N_REF, "layers": _LAYERS,
        "n_prompts": Param("int", "prompts (one window per document; default 8, 2 with --quick)"),
        "n_perm": Param("int", "region permutations per prompt"),
        "region_len": Param("int", "tokens of the permuted region (default min(64, seq_len / 4))"),
        "n_query": Param("int", "query rows after the region (default = region_len)"),
        "block": Param("int", "permute blocks of this many tokens (1 = single tokens)"),
        "min_score": Param("float", "a score must also exceed this to count"),
        "batch_size": _BATCH,
    },
    "length": {
        "n_ref": _N_REF,
        "gaps": Param("floats", "gaps G in units of the model's n_ctx"),
        "prefix_len": Param("int", "prefix tokens (default seq_len / 2)"),
        "suffix_len": Param("int", "suffix tokens (default seq_len / 2)"),
        "skip": Param("int", "first suffix tokens left out of the NLL"),
        "batch_size": _BATCH,
        "gap": Param("bool", "run the gap probe"),
        "delta0": Param("count", "reference offset Δ0 of the disentangled logits f(q, C) + g_Δ0"),
        "window": Param("bool", "run window removal on sliding-window models"),
        "window_seq_len": Param("int", "tokens per sequence of the window-removal run"),
        "window_n_seq": Param("int", "sequences of the window-removal run"),
        "bucket": Param("int", "position bucket of the window-removal NLL"),
        "max_per_doc": Param("int", "window removal: most windows taken from one long document"),
    },
    "gap_attention": {
        "n_ref": _N_REF,
        "gap": Param("float", "the gap G in units of the model's n_ctx"),
        "prefix_len": Param("int", "prefix tokens (default seq_len / 2)"),
        "suffix_len": Param("int", "suffix tokens (default seq_len / 2)"),
        "skip": Param("int", "first suffix query rows left out"),
        "classes": Param("text", "per-head §6 taxonomy table (heads.csv / heads_<model>.csv) for the head classes; "
                                 "default: the D3 f_share proxy"),
    },
    "sufficiency": {
        "n_ref": _N_REF,
        "target_len": Param("int", "tokens at the end whose NLL is measured"),
        "tolerance": Param("pairs", "source:group pairs whose T1 tolerance slope is measured, e.g. d3:all"),
        "fracs": Param("floats", "swap fractions of the tolerance slopes (must include 0)"),
        "gamma": Param("float", "per-row quantile of the 'd3_quantile' source"),
        "delta0": Param("count", "reference offset Δ0 of g_Δ0"),
        "batch_size": _BATCH,
    },
}


def parse_param_args(items: Sequence[str] | None) -> dict[str, str]:
    """``["layers=10-19", "n_ref=8"]`` → ``{"layers": "10-19", "n_ref": "8"}`` (text; parsed per stage).

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


def check_params(params: Mapping[str, str], stages: Iterable[str]) -> None:
    """Every key must belong to one of ``stages`` and parse there.

    Raises:
        ValueError: naming the unknown key (and the keys the stages accept) or the bad value."""
    stages = list(stages)
    known: dict[str, list[str]] = {}
    for st in stages:
        for k in STAGE_PARAMS.get(st, {}):
            known.setdefault(k, []).append(st)
    for k, v in params.items():
        if k not in known:
            acc = ", ".join(sorted(known)) or "none"
            raise ValueError(f"unknown parameter {k!r} for {'/'.join(stages)}; accepted: {acc}")
        for st in known[k]:
            try:
                STAGE_PARAMS[st][k].parse(v)
            except (ValueError, TypeError) as e:
                raise ValueError(f"parameter {k}={v!r} ({st}): {e}; expected {STAGE_PARAMS[st][k].kind}") from e


def stage_params(params: Mapping[str, str], stage: str) -> dict[str, Any]:
    """Parsed values of the given keys that ``stage`` declares (others are left to the stage's
    defaults). Returns ``{key: value}``."""
    decl = STAGE_PARAMS.get(stage, {})
    return {k: decl[k].parse(v) for k, v in params.items() if k in decl}


def describe_params(stage: str) -> str:
    """One line per parameter of ``stage``: ``key (kind): help``."""
    decl = STAGE_PARAMS.get(stage, {})
    return "\n".join(f"  --param {k}=…  ({p.kind}) {p.help}" for k, p in decl.items()) or "  (no parameters)"
