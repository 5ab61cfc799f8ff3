"""A self-contained HTML page: the summary box, the assumptions, then sections with a
reading, embedded figures and tables.

No network is needed to view it: figures are PNGs embedded as ``data:`` URIs and the
style sheet is inline. It reads on a phone: a viewport meta tag, figures that stack
full width below 700 px and open at full size when clicked or tapped (one overlay, a few
lines of inline script; the page stays whole without it), tables that scroll sideways
with a shadow at the edge that hides more columns instead of being cut, wide tables of
one or two rows turned into a column each, and numbers that never break across lines.
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
h1 { font-size: 1.6em; overflow-wrap: anywhere; }
h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
.subtitle { color: #555; overflow-wrap: anywhere; }
.summary { border: 2px solid #4a7ab5; border-radius: 6px; padding: .4em 1.2em;
           background: #f5f8fc; }
.summary h2 { border: 0; margin-top: .4em; }
.summary dt { font-weight: bold; margin-top: .5em; }
.summary dd { margin-left: 0; }
p.reading { background: #f5f7fa; border-left: 4px solid #4a7ab5; padding: .6em 1em; }
p.error { background: #fdf0f0; border-left: 4px solid #b54a4a; padding: .6em 1em; }
.figures { display: flex; flex-wrap: wrap; gap: 1em; }
.figures a { flex: 0 1 auto; min-width: 0; max-width: 100%; cursor: zoom-in; }
.figures img { max-width: 100%; height: auto; margin: .5em 0 0; display: block; }
.figures .hint { font-size: .8em; color: #666; }
#zoom { display: none; position: fixed; inset: 0; background: rgba(255,255,255,.97);
        overflow: auto; z-index: 10; cursor: zoom-out; }
#zoom.open { display: block; }
#zoom img { display: block; margin: 0 auto; max-width: none; }
.scroll { overflow-x: auto; max-width: 100%;
  background: linear-gradient(to right, #fff 30%, rgba(255,255,255,0)),
    linear-gradient(to right, rgba(255,255,255,0), #fff 70%) 100% 0,
    radial-gradient(farthest-side at 0 50%, rgba(0,0,0,.25), rgba(0,0,0,0)),
    radial-gradient(farthest-side at 100% 50%, rgba(0,0,0,.25), rgba(0,0,0,0)) 100% 0;
  background-repeat: no-repeat; background-size: 40px 100%, 40px 100%, 14px 100%, 14px 100%;
  background-attachment: local, local, scroll, scroll; }
.scroll.plain { background: none; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0 1em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: right; }
td { white-space: nowrap; font-variant-numeric: tabular-nums; }
th { background: rgba(80,80,220,.09); vertical-align: bottom; }
td:first-child, th:first-child { text-align: left; }
table.facts td { white-space: normal; text-align: left; overflow-wrap: break-word; }
table.facts td:first-child { white-space: nowrap; font-weight: bold; }
table.facts .word { white-space: nowrap; }
table.facts .path { overflow-wrap: anywhere; }
nav { display: flex; flex-wrap: wrap; gap: .2em 1em; margin: 1em 0; }
nav a { white-space: nowrap; }
@media (max-width: 700px) {
  body { margin: 1em auto; padding: 0 .6em; } h1 { font-size: 1.3em; }
  table.facts td { display: block; border: 0; padding: .1em .3em; }
  table.facts tr { display: block; border-bottom: 1px solid #ddd; padding: .3em 0; }
}
"""


#: The full-size overlay: a click on a figure shows it at its own pixel size (scrolling
#: where it is larger than the window); a click on the overlay closes it.
ZOOM = """<div id="zoom" title="close"><img alt="figure at full size"></div>
<script>
const zoom = document.getElementById("zoom");
document.querySelectorAll(".figures a").forEach((link) => link.addEventListener("click",
  (event) => { event.preventDefault(); zoom.firstChild.src = link.querySelector("img").src;
               zoom.classList.add("open"); }));
zoom.addEventListener("click", () => zoom.classList.remove("open"));
</script>"""


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


#: A table of at most this many rows and more than WIDE columns reads as one column
#: per row (the columns become rows): 16 columns of one row do not fit a page.
SHORT, WIDE = 2, 8


def _stand_up(df: pd.DataFrame) -> pd.DataFrame:
    """A short, wide table transposed: its columns as rows, one column per row."""
    first = df.columns[0]
    rest = df.drop(columns=[first])
    # headers may repeat (a capture folder named "run" in the column "run"): a list, not
    # a dict of columns, keeps every one
    header = [str(first), *(format_cell(v) for v in df[first])]
    rows = [[str(c), *(format_cell(v) for v in rest[c])] for c in rest.columns]
    return pd.DataFrame(rows, columns=header)


def table_html(df: pd.DataFrame, max_rows: int = 40, css_class: str = "") -> str:
    """A table in a sideways-scrolling box; cells formatted as in the terminal; a short,
    wide table stood up (:func:`_stand_up`)."""
    if len(df) <= SHORT and len(df.columns) > WIDE:
        df = _stand_up(df)
    shown = df.head(max_rows)
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in shown.columns)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(format_cell(v))}</td>" for v in row) + "</tr>"
        for row in shown.itertuples(index=False)
    )
    more = f"<p>… {len(df) - max_rows} more rows</p>" if len(df) > max_rows else ""
    attr = f' class="{css_class}"' if css_class else ""
    return (
        f'<div class="scroll"><table{attr}><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table></div>{more}"
    )


def command_html(text: str) -> str:
    """A command line as code that wraps only between its words and after a comma, never
    inside one such as ``--error-budget`` (at 390 px a browser broke it at its hyphen);
    a path may break anywhere."""
    words: list[str] = []
    option = False  # the last word is an option still without its value
    for word in text.split(" "):
        if "/" in word:
            words.append(f'<span class="path">{html.escape(word)}</span>')
        elif "," in word:
            items = [f'<span class="word">{html.escape(item)}</span>' for item in word.split(",")]
            words.append(",<wbr>".join(items))
        elif option and not word.startswith("--"):
            # an option and its short value stay on one line: --latency 5us
            words[-1] = words[-1].removesuffix("</span>") + f" {html.escape(word)}</span>"
            option = False
            continue
        else:
            words.append(f'<span class="word">{html.escape(word)}</span>')
        option = word.startswith("--")
    return "<code>" + " ".join(words) + "</code>"


def _is_command(text: str) -> bool:
    """A gradstat command line with options (not ``gradstat 0.1.0, torch ...``)."""
    return text.startswith("gradstat ") and " --" in text


def _facts(df: pd.DataFrame) -> str:
    """A two-column label/value table without a header row; a value that is a gradstat
    command reads as code (:func:`command_html`)."""
    rows = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>"
        + (command_html(str(v)) if _is_command(str(v)) else html.escape(str(v)))
        + "</td></tr>"
        for k, v in df.itertuples(index=False)
    )
    return f'<div class="scroll plain"><table class="facts"><tbody>{rows}</tbody></table></div>'


def _summary(summary: list[tuple[str, list[str]]], provenance: pd.DataFrame | None) -> str:
    items = "".join(
        f"<dt>{html.escape(title)}</dt><dd>{html.escape(' '.join(lines))}</dd>"
        for title, lines in summary
    )
    parts = ['<section id="summary" class="summary"><h2>Summary</h2>', f"<dl>{items}</dl>"]
    if provenance is not None:
        parts.append(f"<h3>Assumptions and provenance</h3>{_facts(provenance)}")
    parts.append("</section>")
    return "".join(parts)


def render(
    title: str,
    subtitle: str,
    sections: list[Section],
    *,
    summary: list[tuple[str, list[str]]] | None = None,
    provenance: pd.DataFrame | None = None,
    dpi: int = 110,
) -> str:
    """The whole page: title, the summary box with the assumptions, then the sections."""
    nav = "".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f'<h1>{html.escape(title)}</h1><p class="subtitle">{html.escape(subtitle)}</p>',
    ]
    if summary is not None:
        parts.append(_summary(summary, provenance))
    parts.append(f"<nav>{nav}</nav>")
    for section in sections:
        parts.append(f'<section id="{section.key}"><h2>{html.escape(section.title)}</h2>')
        if section.error is not None:
            parts.append(f'<p class="error">Not available: {html.escape(section.error)}</p>')
        else:
            parts.append(f'<p class="reading">{html.escape(section.reading)}</p>')
            if section.figures:
                images = "".join(
                    f'<a href="#zoom" title="full size"><img alt="{html.escape(section.title)}" '
                    f'src="{figure_png(fig, dpi)}"><span class="hint">click or tap for full '
                    "size</span></a>"
                    for fig in section.figures
                )
                parts.append(f'<div class="figures">{images}</div>')
            for caption, df in section.tables:
                if list(df.columns) == ["", "value"]:
                    parts.append(f"<h3>{html.escape(caption)}</h3>{_facts(df)}")
                else:
                    parts.append(f"<h3>{html.escape(caption)}</h3>{table_html(df)}")
        parts.append("</section>")
    parts.append(ZOOM)
    parts.append("</body></html>")
    return "\n".join(parts)
