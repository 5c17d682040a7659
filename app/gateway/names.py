"""Names people give things (teams, keys, uploaded files): printable text only.

Control characters (a CR turned a team named "\\r=1+1" into a live formula in the usage CSV) and the
Unicode bidirectional controls (U+202E shows "evil\\u202etxt.exe" as "evilexe.txt") have no business in a
name and are refused; everything else Unicode allows, accents and scripts included, is kept."""

from __future__ import annotations

import unicodedata

BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def unsafe_character(text: str) -> str | None:
    """The first control or bidi-control character in `text`, if any."""
    for char in text:
        if char in BIDI_CONTROLS or unicodedata.category(char) == "Cc":
            return char
    return None


def check_name(text: str) -> str:
    """For pydantic: refuse a name with a control or bidi-control character."""
    found = unsafe_character(text)
    if found is not None:
        raise ValueError(f"a name may not contain control characters (found U+{ord(found):04X})")
    return text


def without_unsafe_characters(text: str) -> str:
    """`text` with its control and bidi-control characters dropped (a file name from a client's upload)."""
    return "".join(char for char in text if char not in BIDI_CONTROLS and unicodedata.category(char) != "Cc")
