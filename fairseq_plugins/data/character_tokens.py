"""How text is written as the tokens of a character- or byte-level language model.

fairseq's dictionaries split a line on white space, so a character cannot be its own token
string when it is a space or a newline. Every symbol is therefore written as a decimal number:
``bytes``, the UTF-8 bytes of the text (enwik8's convention: ``10`` is the newline byte);
``characters``, the Unicode code points (``10`` is the newline, ``32`` the space). The newline
is an ordinary symbol, so a model predicts line breaks like any other character; fairseq's
``</s>`` marks only the end of a document.
"""

from typing import Iterable

import numpy as np

UNITS = ("characters", "bytes")
NEWLINE = 10  # the newline's symbol in both units
REPLACEMENT = "\ufffd"  # what a token that is no symbol (fairseq's <unk>) decodes to


def check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r}: choose from {', '.join(UNITS)}")


def symbols(text, unit: str) -> np.ndarray:
    """The symbols of ``text`` (a str, or bytes for the ``bytes`` unit) as one integer array."""
    check_unit(unit)
    if unit == "bytes":
        return np.frombuffer(text if isinstance(text, bytes) else text.encode("utf-8"), dtype=np.uint8)
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4")


def encode(text, unit: str) -> str:
    """``text`` (a str, or bytes for ``bytes``) as the space-separated tokens of a data-bin of
    ``unit`` (a prompt)."""
    return " ".join(map(str, symbols(text, unit).tolist()))


def _values(tokens: Iterable[str]):
    for token in tokens:
        yield int(token) if token.isdigit() else None


def decode(tokens: str, unit: str) -> str:
    """Space-separated tokens back to text; a token that is not a symbol (``<unk>``) and, for
    bytes, an incomplete UTF-8 sequence become U+FFFD."""
    check_unit(unit)
    values = list(_values(tokens.split()))
    if unit == "characters":
        return "".join(chr(v) if v is not None and v < 0x110000 else REPLACEMENT for v in values)
    pieces, run = [], bytearray()
    for v in values:
        if v is not None and v < 256:
            run.append(v)
        else:
            pieces += [run.decode("utf-8", errors="replace"), REPLACEMENT]
            run = bytearray()
    return "".join(pieces) + run.decode("utf-8", errors="replace")
