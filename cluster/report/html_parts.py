"""The report's HTML pieces: sections, notes, tables, inlined PNGs, and how values are written."""

from __future__ import annotations

import base64
import html
import io
import re
import unicodedata
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib loads only where a figure is drawn: the sweep's summary lines use this module
    from matplotlib.figure import Figure

CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:3px 8px;
text-align:left;vertical-align:top;white-space:pre-wrap}th{background:#eee}
td{font-variant-numeric:tabular-nums}.note{background:#fff4d6;border-left:4px solid #e0a800;padding:6px 10px}
dt{font-weight:bold;float:left;clear:left;width:9em}dd{margin-left:10em}img{max-width:100%}
td.best{font-weight:bold;background:#e6f4e6}td.differs{background:#fde2e2}
nav{clear:both;padding:1em 0}nav a{margin-right:1em}
#browser .controls{margin:.5em 0;display:flex;gap:1em;flex-wrap:wrap;align-items:center}
#browser td.text{max-width:36em;font-family:ui-monospace,monospace;font-size:12px}
#browser tr.disagree td:first-child{border-left:4px solid #c0392b}"""


# what a model's output or a row's text may hold that a browser draws as a box or not at all: control characters
# (the text's tabs and line ends kept), surrogates, private-use and unassigned code points, and the bidirectional
# controls that reorder what is shown around them
_SUSPECT = re.compile(r"[^\t\n\r\x20-\x7e]")
_UNSEEN = {"Cc", "Cs", "Co", "Cn"}
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _escape_one(match: re.Match) -> str:
    ch = match.group()
    if ch not in _BIDI and unicodedata.category(ch) not in _UNSEEN:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def visible(text: str | None) -> str | None:
    """`text` with its unprintable characters written as Python writes them in a string (`\\x00`, `\\x1b`,
    `\\u202e`), so that a completion's NUL or escape sequence shows as what it is, not as a box or nothing.
    Tabs, line ends and every printable character (any script, emoji) are kept as they are."""
    return text if text is None else _SUSPECT.sub(_escape_one, text)


def document(title: str, body: str, refresh_s: int | None = None) -> str:
    """A whole page: `refresh_s` makes the browser reload it (the pool's live pages, while a sweep runs)."""
    meta = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else ""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{meta}<title>{html.escape(title)}"
            f"</title><style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def section(title: str, section_id: str | None, body: str) -> str:
    attr = f' id="{section_id}"' if section_id else ""
    return f"<section{attr}><h2>{html.escape(title)}</h2>\n{body}</section>"


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def table(headers: list[str], rows: list[list], table_id: str | None = None,
          classes: list[list[str]] | None = None) -> str:
    """A table of escaped values; `classes[i][j]`, where given, is the class of row i's cell j."""
    attr = f' id="{table_id}"' if table_id else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cells = []
        for j, v in enumerate(row):
            cls = classes[i][j] if classes and classes[i][j] else ""
            cells.append(f'<td class="{cls}">' if cls else "<td>")
            cells.append(f"{html.escape(fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>\n")
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>\n{''.join(body)}</tbody></table>"


def png(fig: "Figure", alt: str) -> str:
    # figures are built with Figure, not pyplot: no global figure state, and Agg renders the PNG
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, datetime):
        return v.strftime("%Y-%m-%d %H:%M:%S")
    return str(v)


def score_text(score: float | None, stderr: float | None) -> str:
    if score is None:
        return "—"
    return f"{score:.3f}" if stderr is None else f"{score:.3f} ± {stderr:.3f}"


def percent(rate: float | None) -> str:
    return "—" if rate is None else f"{100 * rate:.1f}%"


def metrics_text(metrics: list | None) -> str:
    """A summary row's other metrics (acc_norm, pass@k) as `name value ± stderr`, comma-separated."""
    return ", ".join(f"{m['name']} {score_text(m['value'], m['stderr'])}" for m in metrics or ())
