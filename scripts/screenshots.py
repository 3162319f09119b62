"""Screenshots of what a reader sees: the causal results page of the documentation site and the example HTML
report, as headless Chromium draws them at 1280 px, into ``docs/img/``.

    python scripts/screenshots.py            # build the docs site, take both screenshots, record their sources
    python scripts/screenshots.py --check    # exit 1 when a screenshot is older than the page it shows

Each screenshot is recorded in ``docs/img/screenshots.json`` with the SHA-1 of the source it was taken from
(``docs/results/causal.md``, ``docs/example/report.html``), so a test finds a screenshot that no longer shows its
page. Run it after ``python -m posgen_tl.report.pages`` has regenerated the pages. Needs ``chromium`` and the
docs extras (``mkdocs``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
RECORD = IMG / "screenshots.json"
WIDTH = 1280

#: screenshot file → (the source whose content it shows, the page inside the built site or the docs tree, height)
SHOTS = {
    "causal_page.png": ("docs/results/causal.md", "site:results/causal/index.html", 1500),
    "report.png": ("docs/example/report.html", "docs:example/report.html", 1500),
}


def source_hashes() -> dict[str, str]:
    """``{screenshot: sha1 of its source}`` as the sources are now."""
    return {name: hashlib.sha1((ROOT / src).read_bytes()).hexdigest() for name, (src, _, _) in SHOTS.items()}


def stale() -> list[str]:
    """The screenshots that are missing or were taken from another version of their source."""
    rec = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    now = source_hashes()
    return [n for n in SHOTS if not (IMG / n).exists() or rec.get(n, {}).get("source_sha1") != now[n]]


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("chromium is not installed (scripts/setup.sh installs Debian's package where it can)")
    return exe


def _site(tmp: Path) -> Path:
    """The documentation site built into ``tmp/site`` (mkdocs, strict)."""
    exe = Path(sys.executable).parent / "mkdocs"
    out = tmp / "site"
    subprocess.run([str(exe) if exe.exists() else "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                   cwd=ROOT, check=True)
    return out


def shoot(page: Path, out: Path, height: int, tmp: Path) -> None:
    """``page`` as headless Chromium draws it in a ``WIDTH`` × ``height`` window, saved as PNG ``out``."""
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp / 'prof'}", f"--window-size={WIDTH},{height}",
                    "--virtual-time-budget=15000", f"--screenshot={out}", page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=180)
    if not out.exists() or out.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"Chromium wrote no PNG for {page}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report screenshots older than their page (exit 1)")
    args = ap.parse_args(argv)
    if args.check:
        old = stale()
        for n in old:
            print(f"docs/img/{n} does not show the current {SHOTS[n][0]}: run python scripts/screenshots.py")
        return 1 if old else 0
    IMG.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        site = _site(tmp) if any(p.startswith("site:") for _, p, _ in SHOTS.values()) else None
        for name, (_, where, height) in SHOTS.items():
            kind, rel = where.split(":", 1)
            page = (site if kind == "site" else ROOT / "docs") / rel  # type: ignore[operator]
            shoot(page, IMG / name, height, tmp)
            print(f"wrote docs/img/{name}")
    now = source_hashes()
    RECORD.write_text(json.dumps({n: {"source": SHOTS[n][0], "source_sha1": now[n], "width": WIDTH,
                                      "height": SHOTS[n][2]} for n in SHOTS}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
