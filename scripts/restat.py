"""Recompute a study's statistics from its kept per-document rows, with today's code (no model, no forward).

    python scripts/restat.py patching results/smollm2-135m/pydoc/patching [--kept-batches 2]

Rewrites the folder's tables, figures, ``<study>.md`` and ``<study>.json``; the run's command, commit and wall time
stay, and the JSON records this command and its commit under ``restat``. ``--kept-batches``: how many batches a
resumed run had kept from an interrupted earlier one, where the run itself did not record it (its page then says
so). Only studies whose module has ``restat`` (today: patching) can be recomputed.
"""

from __future__ import annotations

import argparse
import shlex
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study", help="the study's name (e.g. patching)")
    p.add_argument("folder", help="the study's output folder")
    p.add_argument("--kept-batches", type=int, default=None,
                   help="batches a resumed run kept from an earlier one (default: as the run recorded)")
    a = p.parse_args(argv)
    from posgen_tl.experiments import registry

    opts = {} if a.kept_batches is None else {"kept_batches": a.kept_batches}
    cmd = shlex.join(["python", "scripts/restat.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"wrote {registry.restat_study(a.study, a.folder, command=cmd, **opts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
