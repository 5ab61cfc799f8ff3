"""A self-contained HTML page: sections with a reading, embedded figures and tables.

No network is needed to view it: figures are PNGs embedded as ``data:`` URIs and the
style sheet is inline.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from gradstat.formatting import format_cell

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
p.reading { background: #f5f7fa; border-left: 4px solid #4a7ab5; padding: .6em 1em; }
p.error { background: #fdf0f0; border-left: 4px solid #b54a4a; padding: .6em 1em; }
img { max-width: 100%; display: block; margin: 1em 0; }
table { border-collapse: collapse; font-size: .85em; margin: 1em 0; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
th { background: #eef; } td:first-child, th:first-child { text-align: left; }
nav a { margin-right: 1em; }
"""


@dataclass
class Section:
    """One part of the report; ``error`` replaces the content when it could not be made."""

    key: str
    title: str
    reading: str = ""
    figures: list[Figure] = field(default_factory=list)
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    error: str | None = None


def figure_png(fig: Figure, dpi: int = 110) -> str:
    """The figure as a base64 PNG ``data:`` URI (the figure is closed)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def table_html(df: pd.DataFrame, max_rows: int = 40) -> str:
    shown = df.head(max_rows)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in shown.columns)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_cell(v))}</td>" for v in row) + "</tr>"
        for row in shown.itertuples(index=False)
    )
    more = f"<p>… {len(df) - max_rows} more rows</p>" if len(df) > max_rows else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{more}"


def render(title: str, subtitle: str, sections: list[Section], dpi: int = 110) -> str:
    """The whole page."""
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p><nav>{nav}</nav>",
    ]
    for section in sections:
        parts.append(f'<section id="{section.key}"><h2>{html.escape(section.title)}</h2>')
        if section.error is not None:
            parts.append(f'<p class="error">Not available: {html.escape(section.error)}</p>')
        else:
            parts.append(f'<p class="reading">{html.escape(section.reading)}</p>')
            for fig in section.figures:
                parts.append(
                    f'<img alt="{html.escape(section.title)}" src="{figure_png(fig, dpi)}">'
                )
            for caption, df in section.tables:
                parts.append(f"<h3>{html.escape(caption)}</h3>{table_html(df)}")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)
