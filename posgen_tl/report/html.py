"""A self-contained, one-page HTML report: figures embedded as base64 PNG, tables inline.

Readable offline: no scripts, no external CSS or fonts.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

__all__ = ["Section", "figure_to_png", "render_html"]

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.7em;border-bottom:2px solid #444;padding-bottom:.2em}
h2{font-size:1.3em;margin-top:2em;border-bottom:1px solid #bbb}
table{border-collapse:collapse;font-size:.85em;margin:.8em 0}
td,th{border:1px solid #ccc;padding:.2em .5em;text-align:right}
th{background:#f0f0f0}
figure{margin:1em 0}
figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.85em;color:#555}
.verdict{background:#fff7e0;border-left:4px solid #e0a000;padding:.5em 1em}
.meta{font-size:.85em;color:#555}
code{background:#f4f4f4;padding:0 .2em}
"""


def figure_to_png(fig: Any, dpi: int = 100) -> bytes:
    """PNG bytes of a matplotlib figure (closed afterwards to free memory)."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


@dataclass
class Section:
    """One report section: a title, paragraphs (plain text), tables, figures (PNG bytes + caption)."""

    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[tuple[bytes, str]] = field(default_factory=list)
    verdict: str | None = None


def _table(caption: str, df: pd.DataFrame) -> str:
    body = df.to_html(index=False, float_format=lambda x: f"{x:.4g}", border=0, na_rep="–")
    return f"<p><b>{html.escape(caption)}</b></p>{body}"


def render_html(title: str, meta: dict[str, Any], sections: list[Section]) -> str:
    """The whole page as a string."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    parts.append("<p class='meta'>" + " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items()) + "</p>")
    parts.append("<ul>" + "".join(f"<li><a href='#s{i}'>{html.escape(s.title)}</a></li>" for i, s in enumerate(sections)) + "</ul>")
    for i, s in enumerate(sections):
        parts.append(f"<h2 id='s{i}'>{html.escape(s.title)}</h2>")
        if s.verdict:
            parts.append(f"<div class='verdict'>{html.escape(s.verdict)}</div>")
        for p in s.paragraphs:
            parts.append(f"<p>{html.escape(p)}</p>")
        for cap, df in s.tables:
            parts.append(_table(cap, df))
        for png, cap in s.figures:
            b64 = base64.b64encode(png).decode("ascii")
            parts.append(f"<figure><img alt='{html.escape(cap)}' src='data:image/png;base64,{b64}'/>"
                         f"<figcaption>{html.escape(cap)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)
