"""The part every thin wrapper in scripts/ shares: build one ``posgen-tl study …`` command line,
print it (so it can be copied), and run it through the CLI in this process."""

from __future__ import annotations

import shlex
from typing import Any, Mapping


def study_command(study: str, options: Mapping[str, Any], params: Mapping[str, Any]) -> list[str]:
    """``["study", study, "--opt", value, …, "--param", "key=value", …]``; options and params
    whose value is None are left out (the study's default applies)."""
    argv = ["study", study]
    for k, v in options.items():
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    for k, v in params.items():
        if v is not None:
            argv += ["--param", f"{k}={v}"]
    return argv


def print_and_run(cmd: list[str], print_only: bool) -> int:
    """Print ``posgen-tl <cmd>``; unless ``print_only``, run it and return the CLI's exit status."""
    print("posgen-tl " + shlex.join(cmd), flush=True)
    if print_only:
        return 0
    from posgen_tl.cli import main as cli  # noqa: PLC0415

    return cli(cmd)
