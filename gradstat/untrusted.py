"""Text that came from a file (layer names, capture attributes, paths) shown safely.

A capture is data that anyone may have written. Printed raw, a layer name holding an
escape sequence rewrites the terminal (``ESC]0;`` sets its title, ``ESC[2J`` clears it)
or hides text, and a CSV cell that starts with ``=`` is a formula a spreadsheet runs
(``=HYPERLINK(...)``; OWASP, "CSV Injection"). So:

* :func:`printable` shows every control character (C0, DEL, C1) and every Unicode
  bidirectional override as its escape, ``\\x1b``, ``\\n``, ``\\u202e``: what is shown is
  what the file holds, and the terminal only prints it;
* :func:`safe_cell` makes a CSV text cell that a spreadsheet would read as a formula
  (first character ``=``, ``+``, ``-``, ``@``, tab or carriage return) inert with a
  leading ``'``, as OWASP recommends, and shows control characters other than tab and
  newline escaped: the csv module quotes a cell only for the line terminator pandas
  gives it (``\n``), so a bare carriage return would split the row (read back, the
  table is silently wrong); numbers are left as they are.

No third-party import: the command line's error path uses it.
"""

from __future__ import annotations

import re

#: C0 controls, DEL, C1 controls, and the bidirectional embeddings, overrides and isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: First characters that make a spreadsheet read a cell as a formula.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``text`` with each control character as its escape (``\\x1b``, ``\\n``, ...)."""
    return _CONTROL.sub(_escape, str(text))


#: What a CSV cell keeps of the control characters: tab, and newline (quoted by csv).
_CELL_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def safe_cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as text and any CSV reader reads back whole: in a
    string, control characters but tab and newline escaped, and a leading ``'`` where
    it would start a formula; anything else (numbers) is returned as it is."""
    if not isinstance(value, str):
        return value
    text = _CELL_CONTROL.sub(_escape, value)
    return "'" + text if text.startswith(FORMULA_START) else text
