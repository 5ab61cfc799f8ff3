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
  leading ``'``, as OWASP recommends; numbers are left as they are.

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


def safe_cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as text: a string starting a formula gets a
    leading ``'``; anything else (numbers, other text) is returned as it is."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value
