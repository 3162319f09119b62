"""Layout of a page as headless Chromium lays it out: what a reader sees at a given window width.

:func:`layout` copies the page beside itself (so its relative CSS and images still load) with a script that measures,
after load, every table a reader can see (not inside a closed ``<details>``) and where the answer sentence sits, and
writes the measurements into the DOM; Chromium's ``--dump-dom`` returns them.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium")

_SCRIPT = """
<script>
window.addEventListener('load', function () {
  var root = document.querySelector('article') || document.body;
  var r = root.getBoundingClientRect();
  var visible = Array.prototype.filter.call(root.querySelectorAll('table'), function (t) {
    return t.offsetParent !== null && !t.closest('details:not([open])'); });
  var answer = null;
  Array.prototype.forEach.call(root.querySelectorAll('strong, b, h2'), function (s) {
    if (answer === null && /^(Answer\\.|Findings)$/.test(s.textContent.trim())) {
      answer = s.getBoundingClientRect().top + window.scrollY; }
  });
  var out = {viewport: document.documentElement.clientWidth, page_scroll_width: document.documentElement.scrollWidth,
             content_left: r.left, content_right: r.right, answer_top: answer,
             tables: visible.map(function (t) {
               var b = t.getBoundingClientRect();
               var wrap = t.closest('.md-typeset__scrollwrap, .tablewrap');
               var box = (wrap || root).getBoundingClientRect();
               return {left: b.left, right: b.left + t.scrollWidth, box_right: box.right, scroll_width: t.scrollWidth,
                       wrap_scroll: wrap ? wrap.scrollWidth : 0, wrap_client: wrap ? wrap.clientWidth : 0,
                       client_width: t.clientWidth, top: b.top + window.scrollY,
                       head: (t.rows.length ? t.rows[0].textContent.trim().slice(0, 80) : '')};
             })};
  var pre = document.createElement('pre'); pre.id = 'posgen-layout'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def layout(page: Path, tmp: Path, width: int = 1280) -> dict:
    """Measurements of ``page`` (an HTML file) laid out by headless Chromium in a ``width``-pixel window.

    Returns:
        ``{"viewport", "page_scroll_width", "content_left", "content_right", "answer_top", "tables": [{"left",
        "right" (left + the table's full scroll width), "box_right" (the right edge of the box the table may fill:
        mkdocs-material's scroll wrapper, else the content column), "scroll_width", "client_width", "wrap_scroll" /
        "wrap_client" (the scroll and visible widths of the box that scrolls a wide table sideways, 0 without one),
        "top", "head"}]}`` in CSS
        pixels; ``answer_top`` is the top of the first "Answer." (or, in the report, "Findings") label, None if
        there is none.
    """
    probe = page.with_name(f"_posgen_layout_{page.name}")
    text = page.read_text()
    probe.write_text(text.replace("</body>", _SCRIPT + "</body>") if "</body>" in text else text + _SCRIPT)
    try:
        r = subprocess.run(
            [CHROMIUM or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp / 'prof'}", f"--window-size={width},1000", "--virtual-time-budget=15000",
             "--dump-dom", probe.resolve().as_uri()],
            capture_output=True, text=True, timeout=180)  # fmt: skip
    finally:
        probe.unlink()
    m = re.search(r'<pre id="posgen-layout">(.*?)</pre>', r.stdout, flags=re.S)
    assert m, f"Chromium returned no measurements (exit {r.returncode}): {r.stderr[-500:]}"
    return json.loads(html.unescape(m.group(1)))


def layout_problems(m: dict) -> list[str]:
    """What a reader would see go wrong in :func:`layout`'s measurements: a visible table wider than the content
    column (cut off, or in a box that scrolls sideways), a page wider than the window, the answer below the first
    table."""
    out = []
    if m["page_scroll_width"] > m["viewport"] + 1:
        out.append(f"the page is {m['page_scroll_width']} px wide in a {m['viewport']} px window")
    for t in m["tables"]:
        if t["right"] > t["box_right"] + 1 or t["scroll_width"] > t["client_width"] + 1 \
                or t["wrap_scroll"] > t["wrap_client"] + 1:
            out.append(f"table '{t['head']}' needs {t['scroll_width']} px, the column has "
                       f"{min(t['box_right'] - t['left'], t['client_width']):.0f}")
    if m["tables"]:
        if m["answer_top"] is None:
            out.append("no answer sentence")
        elif m["answer_top"] > min(t["top"] for t in m["tables"]):
            out.append("the answer sentence is below the first table")
    return out
