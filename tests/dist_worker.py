"""Worker run by ``torchrun`` in tests/test_distributed.py (not a test module itself).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_worker.py MODE OUT

MODE: ``ok`` (decomposition, pattern, tolerance rows of the tiny model, sharded), ``fail``
(rank 1 raises inside its decomposition forward), ``one_doc`` (every window from one document).
Every rank writes ``OUT/rank{r}.json`` with its outcome; rank 0 alone writes ``OUT/tables.pkl``
(only when every stage succeeded everywhere).
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

SEQ_LEN, TARGET = 32, 8
DOC_IDS = [0, 0, 1, 2, 2, 2, 3, 4, 5, 5]
FRACS, SEEDS = (0.0, 0.1, 0.2), (0, 1)


def build():
    """The tiny model and the token windows, identical in every process (seeded)."""
    import tiny_models as tm

    from posgen_tl.io.sampling import Windows

    torch.manual_seed(0)
    model = tm.hf_llama(n_layers=2)[0]
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(3, 90, (len(DOC_IDS), SEQ_LEN), generator=g)
    ref_toks = torch.randint(3, 90, (3, SEQ_LEN), generator=g)
    n = len(DOC_IDS)
    names = [f"d{i}" for i in range(9)]  # documents 6–8 are the reference (disjoint from the analysed 0–5)
    win = Windows(toks, torch.tensor(DOC_IDS), torch.arange(n) * SEQ_LEN, names)
    ref = Windows(ref_toks, torch.tensor([6, 7, 8]), torch.zeros(3, dtype=torch.long), names)
    return model, win, ref


def intervention():
    from posgen_tl.hooks.edits import Intervention

    return Intervention("destroy", bands=[0, 1], layers=[1], alpha=0.5, label="destroy fast")


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    from posgen_tl import distributed as D

    d = D.setup("gloo", timeout_s=120)
    model, win, ref = build()
    if mode == "one_doc":
        win = type(win)(win.tokens, torch.zeros(len(win), dtype=torch.long), win.starts, win.doc_names)
    hooks = []
    if mode == "fail" and d.rank == 1:
        def boom(x, hook):
            raise RuntimeError("injected failure in blocks.1")
        hooks = [("blocks.1.attn.hook_k", boom)]
    outcome = {"rank": d.rank, "world_size": d.world_size, "ok": True, "error": None, "message": ""}
    try:
        dec = D.decompose_distributed(model, win, ref, batch_size=4, extra_hooks=hooks)
        pat = D.pattern_distributed(model, win, ref, batch_size=4)
        tol = D.tolerance_distributed(model, win, [intervention()], fracs=FRACS, seeds=SEEDS, target_len=TARGET,
                                      batch_size=4)
        if d.is_main:
            with open(out / "tables.pkl", "wb") as fh:
                pickle.dump({"decomposition": dec, "bands": pat.bands, "heads": pat.heads, "tolerance": tol}, fh)
    except (D.DistributedRunError, D.ShardError) as e:
        outcome.update(ok=False, error=type(e).__name__, message=str(e))
    (out / f"rank{d.rank}.json").write_text(json.dumps(outcome))
    D.teardown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # A C++ abort anywhere in this rank (e.g. "terminate called without an active exception") prints the
    # Python stack of every thread to stderr, which tests/integration/test_distributed.py shows on failure.
    faulthandler.enable(all_threads=True)
    rc = main()
    # Every outcome is written and the process group is destroyed: leave without the interpreter's
    # finalisation, during which torch's c10d/gloo C++ threads have been seen (in CI, ~1 launch in 20)
    # to abort with "terminate called without an active exception" after all work had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
