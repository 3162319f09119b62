"""Run the architecture matrix in THIS environment and write the support table.

    python docs/gen_architectures.py --out docs/architectures.md --json docs/architectures.json --readme README.md
    python docs/gen_architectures.py --json docs/architectures.json --readme README.md --render-only

Runs every cell of ``tests/arch_matrix.py`` for the installed TransformerLens (4.x: the
bridge; 3.x: the bridge and the HookedTransformer), merges those columns into the existing JSON (the
other environment's columns are kept) and renders the markdown table from the merged JSON, and the
README's claim of what is supported between its ``architectures`` markers. Run it once under each
TransformerLens environment (``.venv`` and ``.venv-tl3``). Exits 1 if a cell is neither exact nor a
named refusal (nothing is written then). ``--render-only`` re-renders the table and the README claim
from the committed JSON without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/architectures.md", help="markdown table to write")
    p.add_argument("--json", required=True, help="JSON of every cell (merged across environments)")
    p.add_argument("--readme", default=None, help="README whose architectures block gets the claim")
    p.add_argument("--render-only", action="store_true", help="only re-render from the committed JSON")
    p.add_argument("--fresh", action="store_true",
                   help="a JSON of this environment's cells only (not merged), written even when a cell is not OK "
                        "(exit 1 then): the newest-release check, scripts/check_newest.sh")
    args = p.parse_args(argv)
    if args.render_only:
        import arch_matrix as am

        _render(am, am.load_json(Path(args.json)), args)
        return 0
    import torch

    torch.set_num_threads(1)  # tiny models: one thread is faster than two on a shared machine
    import arch_matrix as am

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="posgen-arch-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cells = am.run_matrix(Path(tmp), progress=True)
    bad = [c for c in cells if not c.ok]
    for c in bad:
        print(f"NOT OK: {c.arch} {c.backend} {c.dtype}: {c.status}", file=sys.stderr)
    if args.fresh:
        data = am.merge(None, cells)
        data["checked"] = time.strftime("%Y-%m-%d")
        data["not_ok"] = [f"{c.arch} {c.backend} {c.dtype}: {c.status}" for c in bad]
        Path(args.json).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
        print(f"{len(cells)} cells in {time.time() - t0:.0f} s, {len(bad)} not OK → {args.json}")
        return 1 if bad else 0
    if bad:
        return 1
    data = am.merge(am.load_json(Path(args.json)), cells)
    Path(args.json).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    _render(am, data, args)
    print(f"{len(cells)} cells in {time.time() - t0:.0f} s → {args.out}, {args.json}")
    return 0


def _render(am, data: dict, args: argparse.Namespace) -> None:
    """The markdown table, and the README claim between ``<!-- architectures:start/end -->``."""
    Path(args.out).write_text(am.render_markdown(data))
    if args.readme:
        from posgen_tl.report.pages import fill_block  # noqa: PLC0415

        path = Path(args.readme)
        path.write_text(fill_block(path.read_text(), "architectures", textwrap.fill(am.readme_claim(data), 118, break_on_hyphens=False, break_long_words=False)))


if __name__ == "__main__":
    sys.exit(main())
