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
from typing import Sequence

__all__ = ["main", "build_parser"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
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
    from posgen_tl.report.params import PARSERS  # noqa: PLC0415 — one parser of "0,3,5-7" lists (also --param layers=)

    try:
        return PARSERS["ints"](text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must look like '0,3,5-7', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="posgen-tl", description="Position generalisation in RoPE LLMs, through TransformerLens hooks.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    c = sub.add_parser("check", help="print the RoPE spec and an exactness table; non-zero exit if a check fails")
    c.add_argument("--model", default="smollm2-135m", help="zoo name (smollm2-135m, gemma3-270m), HF folder or hub name")
    c.add_argument("--seq-len", type=_positive_int, default=64)
    c.add_argument("--n-seq", type=_positive_int, default=2)
    c.add_argument("--layers", type=_layers, default=None, help="e.g. 0,5,10-12 (default: all)")
    c.add_argument("--backend", choices=("bridge", "hooked"), default="bridge",
                   help="TransformerBridge (default) or HookedTransformer (TransformerLens 3.x only)")
    r = sub.add_parser("report", help="run the whole analysis and write an HTML report")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--corpus", default=None, help="UTF-8 text file (default: the stdlib's pydoc topics)")
    r.add_argument("--seq-len", type=_positive_int, default=None)
    r.add_argument("--n-seq", type=_positive_int, default=None)
    r.add_argument("--out", default="posgen_report")
    r.add_argument("--quick", action="store_true", help="a ≤ 2 minute smoke run with small sizes")
    r.add_argument("--no-twin", action="store_true", help="skip the random-init twin (not recommended)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a study parameter of any stage, e.g. layers=10-19 (repeatable; 'posgen-tl study list' names them)")
    s = sub.add_parser("study", help="run one experiment (the report stage of that name) into --out",
                       description="Run one registered study; 'posgen-tl study list' names them.")
    s.add_argument("name", help="study name, or 'list'")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--corpus", default=None, help="UTF-8 text file or folder (default: the stdlib's pydoc topics)")
    s.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence (default 256; 96 with --quick)")
    s.add_argument("--n-seq", type=_positive_int, default=None, help="sequences (default 8; 2 with --quick)")
    s.add_argument("--out", default=None, help="output folder (default: study_<name>)")
    s.add_argument("--quick", action="store_true", help="small sizes and every 5th layer (a smoke run)")
    s.add_argument("--no-twin", action="store_true", help="skip the random-init twin (not recommended)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of this study, e.g. --param layers=10-19 --param n_ref=8 (repeatable; "
                        "'posgen-tl study list' names each study's parameters)")
    return p


def _cmd_check(args: argparse.Namespace) -> int:
    import pandas as pd  # noqa: PLC0415

    from posgen_tl.hooks.capture import model_dtype, probe_hooks  # noqa: PLC0415
    from posgen_tl.io.corpus import corpus_tokens  # noqa: PLC0415
    from posgen_tl.experiments.exactness import MIN_COMPARED_ENTRIES, exactness_table, tolerances  # noqa: PLC0415
    from posgen_tl.io.models import load_model  # noqa: PLC0415

    from posgen_tl import compat  # noqa: PLC0415

    t0 = time.time()
    model = load_model(args.model, verbose=True, backend=args.backend)
    t_load = time.time() - t0
    spec, info = probe_hooks(model)
    print(f"model: {spec.model_name}   loaded in {t_load:.1f} s   "
          f"({type(model).__name__}, transformer-lens {compat.tl_version()})")
    print(
        f"RoPE: type={spec.rope_type}  source={spec.source}  layers={spec.n_layers}  heads={spec.n_heads}  "
        f"kv_heads={spec.n_kv_heads}  d_head={spec.d_head}  n_ctx={spec.n_ctx}  qk_norm={spec.qk_norm}"
    )
    print(
        f"hooks: pre-rotation q/k from {info.q_hook}/{info.k_hook}; hook_rot_q/k "
        f"{'fire' if info.rot_fires else 'do NOT fire (rotation computed from the spec)'}; "
        f"model rotation table: {info.table_source}; hook_attn_scores: {info.scores_kind}"
    )
    desc = pd.DataFrame(spec.describe())
    groups = desc.groupby(["kind", "rotary_dim", "theta_slowest", "score_scale", "sliding_window"], dropna=False)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(groups["layer"].apply(lambda s: ",".join(map(str, s))).reset_index().rename(columns={"layer": "layers"}).to_string(index=False))
    seq_len = args.seq_len
    windows = sorted({lr.sliding_window for lr in spec.layers if lr.sliding_window})
    if windows and seq_len <= windows[-1]:  # the window must mask something for the mask to be checked
        longer = min(windows[-1] + 8, spec.n_ctx or windows[-1] + 8)
        if longer > seq_len:
            print(f"seq-len {seq_len} -> {longer}: the sliding window{'s' if len(windows) > 1 else ''} "
                  f"({', '.join(map(str, windows))} tokens) must mask keys for the mask to be checked")
            seq_len = longer
    tokens = corpus_tokens(model, None, seq_len=seq_len, n_seq=args.n_seq)
    table = exactness_table(model, tokens, args.layers)
    cols = ["layer", "kind", "rot_check", "rot_q_max_err", "rot_k_max_err", "scores_kind", "score_max_err",
            "score_rel_err", "mask_mismatch", "pattern_max_err", "n_compared", "status"]
    cols = [c for c in cols if c in table.columns]
    with pd.option_context("display.width", 220, "display.max_rows", 200, "display.float_format", "{:.3g}".format):
        print(table[cols].to_string(index=False))
    ok = bool(len(table)) and bool(table["passed"].all())
    bad = table[~table["passed"].astype(bool)]
    for _, row in bad.iterrows():
        status = row.get("status", "failed")
        status = "failed" if status == "passed" else status
        print(f"layer {row['layer']}: {status}: {row.get('reason') or 'marked as not passed'}")
    tol = tolerances(model_dtype(model))
    verdict = "PASS" if ok else (
        f"FAIL ({int((bad.get('status', pd.Series(dtype=str)) == 'not checked').sum())} layer(s) not checked, "
        f"{len(bad) - int((bad.get('status', pd.Series(dtype=str)) == 'not checked').sum())} failed)"
    )
    print(
        f"exactness ({args.n_seq}×{seq_len} tokens of pydoc prose; a layer passes after comparing ≥ "
        f"{MIN_COMPARED_ENTRIES} unmasked score entries and its rotation against the model's own; tolerances: "
        f"rotation {tol['rot']:g}, scores {tol['score']:g} relative to max |value|, pattern {tol['pattern']:g}): {verdict}"
    )
    return 0 if ok else 1


def _cmd_report(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")  # the report writes PNGs; only the CLI picks a backend, never an import
    from posgen_tl.report.params import check_params  # noqa: PLC0415
    from posgen_tl.report.run import ReportConfig, run_report  # noqa: PLC0415
    from posgen_tl.report.stages import STAGES  # noqa: PLC0415

    try:
        cfg = ReportConfig.from_args(args)
        check_params(cfg.params, [name for name, _, _ in STAGES])
    except ValueError as e:
        print(f"posgen-tl: error: {e}", file=sys.stderr)
        return 2
    return run_report(cfg)


def _cmd_study(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from posgen_tl.studies import STUDIES, run_study  # noqa: PLC0415

    if args.name == "list":
        from posgen_tl.report.params import describe_params  # noqa: PLC0415

        for name, st in STUDIES.items():
            needs = f" (runs {', '.join(st.needs)} first)" if st.needs else ""
            print(f"{name:15s} {st.about}{needs}")
            print(describe_params(name))
        return 0
    if args.name not in STUDIES:
        print(f"posgen-tl: error: unknown study {args.name!r}; one of: {', '.join(STUDIES)} (or 'list')", file=sys.stderr)
        return 2
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")  # a study writes PNGs; only the CLI picks a backend
    from posgen_tl.report.context import ReportConfig  # noqa: PLC0415

    from posgen_tl.report.params import check_params  # noqa: PLC0415

    args.out = args.out or f"study_{args.name}"
    try:
        cfg = ReportConfig.from_args(args)
        check_params(cfg.params, [args.name, *STUDIES[args.name].needs])
    except ValueError as e:
        print(f"posgen-tl: error: {e}", file=sys.stderr)
        return 2
    cmd = "posgen-tl " + " ".join(argv if argv is not None else sys.argv[1:])
    run_study(args.name, cfg, command=cmd)
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
    except (ValueError, TypeError, RuntimeError, OSError, ImportError) as e:
        print(f"posgen-tl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
