"""The ``posgen-tl`` command.

    posgen-tl check  --model smollm2-135m        RoPE spec + exactness table; exit 1 if a check fails
    posgen-tl report --model smollm2-135m ...    the whole analysis → HTML report, results.json, CSVs
    posgen-tl study NAME --model … --out DIR      one experiment → CSVs, PNGs, NAME.md, NAME.json
    posgen-tl study list                         the registered studies

Bad arguments print one line saying what to change (exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from posgen_tl.io.defaults import DEFAULT_MODEL

__all__ = ["main", "build_parser", "study_config"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.print_usage(sys.stderr)
        self.exit(2, f"posgen-tl: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _layers(text: str) -> list[int]:
    from posgen_tl.experiments.base import PARSERS  # noqa: PLC0415 — one parser of "0,3,5-7" lists (also --layers)

    try:
        return list(PARSERS["ints"](text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must look like '0,3,5-7', got {text!r}") from None


_DTYPES = ("float32", "bfloat16", "float16")


def _add_model_flags(p: argparse.ArgumentParser, *, unchecked: bool = True) -> None:
    """The model and where it runs — the same flags on check, report and every study (``--unchecked``
    not on check: the check itself is never gated)."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"zoo name (smollm2-135m, gemma3-270m), a local Hugging Face folder or a hub name "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="torch device of the whole model, e.g. cuda, cuda:1 (default: cpu)")
    p.add_argument("--dtype", choices=_DTYPES, default="float32",
                   help="parameter dtype (default: float32; the analyses compute in float32/64 either way)")
    if not unchecked:
        return
    p.add_argument("--unchecked", action="store_true",
                   help="run on layers whose exactness check did not pass; every output is stamped UNCHECKED "
                        "(default: refuse them, naming the failed check)")


def model_load_options(args: argparse.Namespace) -> dict[str, Any]:
    """``load_model`` keyword arguments from the parsed model flags (device, dtype, unchecked)."""
    import torch  # noqa: PLC0415

    return {"device": args.device, "dtype": getattr(torch, args.dtype), "unchecked": bool(getattr(args, "unchecked", False))}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="posgen-tl", description="Position generalisation in RoPE LLMs, through TransformerLens hooks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("check", help="print the RoPE spec and an exactness table; non-zero exit if a check fails",
                       description="Is every layer of the model read exactly? Prints the model's RoPE spec, then one "
                                   "row per layer comparing our rotation, logits, mask and pattern with the model's own "
                                   "hooks; exit 0 only if every layer passed (1: a layer failed or was not checked; "
                                   "2: bad arguments, e.g. a layer outside the model).")
    _add_model_flags(c, unchecked=False)
    c.add_argument("--seq-len", type=_positive_int, default=64,
                   help="tokens per compared sequence (default 64; raised past the longest sliding window)")
    c.add_argument("--n-seq", type=_positive_int, default=2, help="sequences of built-in prose compared (default 2)")
    c.add_argument("--layers", type=_layers, default=None,
                   help="layers to check, e.g. 0,5,10-12 (default: all; an index outside the model is an error)")
    c.add_argument("--backend", choices=("bridge", "hooked"), default="bridge",
                   help="TransformerBridge (default) or HookedTransformer (TransformerLens 3.x only)")
    r = sub.add_parser("report", help="run every experiment and write an HTML report",
                       description="Run every experiment into one HTML page (resumable).")
    _add_model_flags(r)
    r.add_argument("--out", default="posgen_report", help="output folder (default: posgen_report)")
    _add_run_flags(r)
    r.add_argument("--param", action="append", default=[], metavar="[EXPERIMENT.]KEY=VALUE",
                   help="an option of one experiment (causal.layers=10-19) or of every experiment that has it "
                        "(n_ref=8); repeatable — 'posgen-tl study list' names them")
    r.add_argument("--render-only", action="store_true",
                   help="write OUT/report.html again from a finished report's saved results with this version's "
                        "pages (no model is loaded, nothing is recomputed)")
    s = sub.add_parser("study", help="run one experiment into --out ('posgen-tl study list' names them)",
                       description="Run one experiment; its options are generated from its Config.")
    ss = s.add_subparsers(dest="name", required=True, parser_class=_Parser, metavar="NAME")
    ss.add_parser("list", help="every experiment with its options, defaults and presets")
    from posgen_tl.experiments import registry  # noqa: PLC0415 — light: no model, no torch

    for name in registry.names():
        mod = registry.experiment(name)
        e = ss.add_parser(name, help=mod.ABOUT, description=f"{mod.ABOUT}. Options (defaults; presets):\n"
                          + mod.Config.describe(), formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_model_flags(e)
        resumes = (" An interrupted run continues from OUT/.partial when started again with the same options "
                   "(removed once the study is written)." if registry.resumable(name) else
                   " An interrupted run starts again from the beginning (this experiment keeps no checkpoint).")
        e.add_argument("--out", default=None, help=f"output folder (default: study_{name}).{resumes}")
        e.add_argument("--preset", choices=registry.presets(), default=None,
                       help="sizes: quick (smoke run), default, full (the powered sizes; default: default)")
        e.add_argument("--quick", action="store_true", help="the 'quick' preset (a smoke run)")
        e.add_argument("--full", action="store_true", help="the 'full' preset (the powered sizes)")
        for o in mod.Config.options():
            e.add_argument(f"--{o.name.replace('_', '-')}", dest=f"opt_{o.name}", default=None, metavar=o.kind.upper(),
                           help=f"{o.help} (default {o.default!r})")
    return p


def _cmd_check(args: argparse.Namespace) -> int:
    import pandas as pd  # noqa: PLC0415

    from posgen_tl import compat  # noqa: PLC0415
    from posgen_tl.experiments import exactness  # noqa: PLC0415
    from posgen_tl.hooks.capture import probe_hooks  # noqa: PLC0415
    from posgen_tl.io.models import load_model  # noqa: PLC0415

    t0 = time.time()
    model = load_model(args.model, verbose=True, backend=args.backend, **model_load_options(args))
    t_load = time.time() - t0
    spec, info = probe_hooks(model)
    print(f"model: {spec.model_name}   loaded in {t_load:.1f} s   "
          f"({type(model).__name__}, transformer-lens {compat.tl_version()}, {args.dtype} on {args.device})")
    layers = spec.layer_indices(args.layers)  # an index outside the model: a named error (exit 2), never wrapped
    print(
        f"RoPE: type={spec.rope_type}  source={spec.source}  layers={spec.n_layers}  heads={spec.n_heads}  "
        f"kv_heads={spec.n_kv_heads}  d_head={spec.d_head}  n_ctx={spec.n_ctx}  qk_norm={spec.qk_norm}"
    )
    from posgen_tl.io.mend import MENDED  # noqa: PLC0415

    for line in MENDED.get(model, []):
        print(f"mended for this transformers/TransformerLens pair: {line}")
    print(
        f"hooks: pre-rotation q/k from {info.q_hook}/{info.k_hook}; hook_rot_q/k "
        f"{'fire' if info.rot_fires else 'do NOT fire (rotation computed from the spec)'}; "
        f"model rotation table: {info.table_source}; hook_attn_scores: {info.scores_kind}"
    )
    desc = pd.DataFrame(spec.describe())
    groups = desc.groupby(["kind", "rotary_dim", "theta_slowest", "score_scale", "sliding_window"], dropna=False)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(groups["layer"].apply(lambda s: ",".join(map(str, s))).reset_index().rename(columns={"layer": "layers"}).to_string(index=False))
    result = exactness.run(model, exactness.Config(n_seq=args.n_seq, seq_len=args.seq_len, layers=tuple(layers)))
    print(exactness.text(result))
    ok, _ = exactness.verdict(result.table)
    return 0 if ok else 1


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The report's size flags (each sets that option of every experiment) and its preset."""
    p.add_argument("--preset", choices=("default", "quick", "full"), default=None,
                   help="the experiments' sizes: quick (smoke run), default, full (the powered sizes; default: "
                        "default)")
    p.add_argument("--quick", action="store_true", help="the 'quick' preset: a smoke run with small sizes")
    p.add_argument("--full", action="store_true", help="the 'full' preset: the powered sizes of the docs' results")
    p.add_argument("--corpus", default=None, help="UTF-8 text file or folder (default: the stdlib's pydoc topics)")
    p.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence (every experiment)")
    p.add_argument("--n-seq", type=_positive_int, default=None, help="sequences (every experiment)")
    p.add_argument("--no-twin", action="store_true", help="skip the random-init twin (not recommended)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the window sampling and every random draw (default: each experiment's, 0)")


def _preset(args: argparse.Namespace) -> str:
    chosen = [p for p, on in (("quick", args.quick), ("full", args.full)) if on]
    if args.preset:
        chosen.append(args.preset)
    if len(set(chosen)) > 1:
        raise ValueError(f"choose one preset, not {' and '.join(sorted(set(chosen)))}")
    return chosen[0] if chosen else "default"


def _cmd_report(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")  # the report writes PNGs; only the CLI picks a backend, never an import
    from posgen_tl.experiments.base import parse_assignments  # noqa: PLC0415
    from posgen_tl.report.run import ReportSettings, rerender, run_report  # noqa: PLC0415

    if args.render_only:
        try:
            print(f"[posgen-tl] wrote {rerender(args.out)}")
        except FileNotFoundError as e:
            print(f"posgen-tl: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        settings = ReportSettings(
            model=args.model, out=args.out, preset=_preset(args), params=parse_assignments(args.param),
            load=model_load_options(args),
            sizes=dict(n_seq=args.n_seq, seq_len=args.seq_len, seed=args.seed, corpus=args.corpus,
                       twin=False if args.no_twin else None))
        settings.configs()  # a bad option is a one-line error before anything loads
        check_run_inputs(args.out, args.corpus)  # and so is an unwritable folder or an unusable corpus
    except ValueError as e:
        print(f"posgen-tl: error: {e}", file=sys.stderr)
        return 2
    return run_report(settings)


def check_run_inputs(out: str | None, corpus: str | None) -> None:
    """What ``study`` and ``report`` check before a model loads: the output folder (or, if it does not exist yet,
    the folder it will be made in) can be written — a probe file written and removed, nothing created — and
    ``--corpus`` is an existing UTF-8 text file or a folder of .txt/.md/.rst files with text in it.

    Raises:
        ValueError: naming the folder or corpus and what is wrong with it."""
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from posgen_tl.io.corpus import CorpusError, named_documents  # noqa: PLC0415

    if corpus is not None:
        path = Path(corpus)
        if not path.exists():
            raise ValueError(f"--corpus {corpus}: no such file or folder")
        try:
            named_documents(str(path))
        except CorpusError as e:
            raise ValueError(f"--corpus {corpus}: {e}") from e
    if out is not None:
        folder = Path(out).absolute()
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--out {out}: exists and is not a folder")
        probe = next(p for p in (folder, *folder.parents) if p.exists())  # the folder, or where it will be made
        if not probe.is_dir():
            raise ValueError(f"--out {out}: {probe} is not a folder")
        try:  # a probe file, removed at once: nothing is created before the run starts
            with tempfile.NamedTemporaryFile(dir=probe, prefix=".posgen-write-probe-"):
                pass
        except OSError as e:
            raise ValueError(f"--out {out}: cannot write in {probe} ({e.strerror or e})") from e


def study_config(args: argparse.Namespace) -> tuple[Any, str, dict[str, str]]:
    """``(Config, preset, option text)`` of a parsed ``posgen-tl study NAME …`` command line — what
    the study runs (:func:`posgen_tl.experiments.registry.make_config`).

    Raises:
        ValueError: two presets, an unparsable option value (naming it)."""
    from posgen_tl.experiments import registry  # noqa: PLC0415

    params = {k[4:]: v for k, v in vars(args).items() if k.startswith("opt_") and v is not None}
    preset = _preset(args)
    return registry.make_config(args.name, preset, params), preset, params


def _cmd_study(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from posgen_tl.experiments import registry  # noqa: PLC0415

    if args.name == "list":
        for name in registry.names():
            mod = registry.experiment(name)
            needs = f" (runs {', '.join(mod.NEEDS)} first)" if mod.NEEDS else ""
            print(f"{name:15s} {mod.ABOUT}{needs}")
            print(mod.Config.describe())
        return 0
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")  # a study writes PNGs; only the CLI picks a backend
    out = args.out or f"study_{args.name}"
    try:
        cfg, preset, params = study_config(args)
        check_run_inputs(out, cfg.corpus)  # before the model loads: seconds, not a minute, to say so
    except ValueError as e:
        print(f"posgen-tl: error: {e}", file=sys.stderr)
        return 2
    cmd = "posgen-tl " + " ".join(argv if argv is not None else sys.argv[1:])
    registry.run_study(args.name, cfg, out, model=args.model, preset=preset, params=params, command=cmd,
                       load=model_load_options(args))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            return _cmd_check(args)
        if args.command == "study":
            return _cmd_study(args, argv)
        return _cmd_report(args)
    except KeyboardInterrupt:
        print("posgen-tl: interrupted", file=sys.stderr)
        return 130
    except _refusals() as e:  # a named refusal or a bad input: one clear line
        print(f"posgen-tl: error: {e}", file=sys.stderr)
        return 2
    except Exception:  # anything else is a bug: its traceback, then a line that says so
        traceback.print_exc()
        print("posgen-tl: internal error (a bug in posgen_tl or a library it calls): the traceback above says where; "
              "please report it with the command", file=sys.stderr)
        return 3


def _refusals() -> tuple[type[BaseException], ...]:
    """The exceptions the CLI prints as one line: bad options and inputs (ValueError, the corpus', RoPE and shard
    errors), files (OSError), and the library's named refusals (capture, gate, model loading, versions)."""
    from posgen_tl.compat import TransformerLensVersionError  # noqa: PLC0415
    from posgen_tl.distributed import DistributedRunError  # noqa: PLC0415
    from posgen_tl.hooks.capture import CaptureError  # noqa: PLC0415
    from posgen_tl.io.models import ModelLoadError  # noqa: PLC0415

    return (ValueError, OSError, CaptureError, ModelLoadError, TransformerLensVersionError, DistributedRunError)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
