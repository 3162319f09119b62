"""Run the architecture matrix in THIS environment and write the support table.

    python docs/gen_architectures.py --out docs/architectures.md --json docs/architectures.json

Runs every cell of ``tests/arch_matrix.py`` for the installed TransformerLens (4.x: the
bridge; 3.x: the bridge and the HookedTransformer), merges those columns into the existing JSON (the
other environment's columns are kept) and renders the markdown table from the merged JSON. Run it
once under each TransformerLens environment (``.venv`` and ``.venv-tl3``). Exits 1 if a cell is
neither exact nor a named refusal (nothing is written then).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
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
    p.add_argument("--out", required=True, help="markdown table to write, e.g. docs/architectures.md")
    p.add_argument("--json", required=True, help="JSON of every cell (merged across environments)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # tiny models: one thread is faster than two on a shared machine
    import arch_matrix as am

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="posgen-arch-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cells = am.run_matrix(Path(tmp), progress=True)
    bad = [c for c in cells if not c.ok]
    if bad:
        for c in bad:
            print(f"NOT OK: {c.arch} {c.backend} {c.dtype}: {c.status}", file=sys.stderr)
        return 1
    data = am.merge(am.load_json(Path(args.json)), cells)
    Path(args.json).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    Path(args.out).write_text(am.render_markdown(data))
    print(f"{len(cells)} cells in {time.time() - t0:.0f} s → {args.out}, {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
