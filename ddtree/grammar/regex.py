"""A request's regex -> the regex xgrammar reads the way Python's `re` does.

xgrammar's regex reader takes every hex digit after `\\x` and `\\u` (`\\x41B` is U+041B `Л`, not
`AB`; `[\\u00e9\\u00e8a-z]` reads U+0E8A and refuses the range), has no octal escapes and
matches unknown escapes (`\\e`, `\\Q`) as the letter. So every escape that stands for one
character (`\\xHH`, `\\uHHHH`, `\\UHHHHHHHH`, `\\N{name}`, octal, `\\a`, `\\b` in a class, an
escaped punctuation mark) is rewritten as that character, written the one way xgrammar reads
unambiguously; escapes xgrammar cannot honour (backreferences, `\\b` / `\\B` / `\\A` / `\\Z`
anchors) and escapes Python's `re` refuses (an unknown letter) are refused by name.

Semantics are Python's `re` with `re.ASCII | re.DOTALL`: `\\d \\w \\s` are the ASCII classes and
`.` matches a newline, as xgrammar matches them (a grammar constrains a whole output, there are no
lines to stop at).
"""

from __future__ import annotations

import unicodedata


class RegexError(ValueError):
    """The pattern has what xgrammar cannot match as Python's `re` does (the message names it)."""


# escapes that mean a class or a control character xgrammar reads as Python does: kept as written
_KEPT = set("dDsSwWnrtfv")
_SIMPLE = {"a": "\a", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_META = set(".^$*+?{}[]()|\\/-")  # escaped wherever they stand: harmless when not special
_CLASS_META = set("]\\^-[")
_CONTROL = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\f": "\\f", "\v": "\\v"}
_ANCHORS = {
    "b": "a word boundary",
    "B": "a non-boundary",
    "A": "a start anchor",
    "Z": "an end anchor",
}
_OCT = "01234567"
_HEX = "0123456789abcdefABCDEF"


def _char(c: str, in_class: bool) -> str:
    """One literal character as xgrammar reads it."""
    if c == "\0":
        raise RegexError("a NUL character (\\0, \\x00) cannot be matched")
    if c in _CONTROL:
        return _CONTROL[c]
    if c in (_CLASS_META if in_class else _META):
        return "\\" + c
    return c


def _hex(p: str, i: int, n: int, what: str) -> tuple[str, int]:
    digits = p[i : i + n]
    if len(digits) != n or any(d not in _HEX for d in digits):
        raise RegexError(f"{what} needs {n} hex digits (at position {i - 2})")
    code = int(digits, 16)
    if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
        raise RegexError(f"{what}{digits} is not a Unicode character")
    return chr(code), i + n


def _octal(p: str, i: int, in_class: bool) -> tuple[str, int]:
    """A digit escape at p[i], as Python reads it: in a class, octal (up to three digits);
    outside, \\0 plus up to two octal digits or three octal digits is octal, else a group
    reference."""
    j = i + 1
    k = j
    if in_class or p[j] == "0":
        while k < len(p) and k < j + 3 and p[k] in _OCT:
            k += 1
    elif len(p[j : j + 3]) == 3 and all(d in _OCT for d in p[j : j + 3]):
        k = j + 3
    if k == j and in_class:
        raise RegexError(f"\\{p[j]} is not a regex escape")
    if k == j:
        raise RegexError(f"\\{p[j]} (a backreference) is not supported in a grammar regex")
    code = int(p[j:k], 8)
    if code > 0o377:
        raise RegexError(f"octal escape \\{p[j:k]} is above \\377")
    return _char(chr(code), in_class), k


def _escape(p: str, i: int, in_class: bool) -> tuple[str, int]:
    """The escape at p[i] == '\\\\' -> (xgrammar text, index after it)."""
    if i + 1 >= len(p):
        raise RegexError("the pattern ends with a lone backslash")
    e = p[i + 1]
    j = i + 2
    if e in _KEPT:
        return "\\" + e, j
    if e in _SIMPLE:
        return _char(_SIMPLE[e], in_class), j
    if e == "b" and in_class:  # backspace in a class, as in Python
        return _char("\b", in_class), j
    if e in _ANCHORS:
        raise RegexError(f"\\{e} ({_ANCHORS[e]}) is not supported in a grammar regex")
    if e == "x":
        c, j = _hex(p, j, 2, "\\x")
        return _char(c, in_class), j
    if e == "u":
        c, j = _hex(p, j, 4, "\\u")
        return _char(c, in_class), j
    if e == "U":
        c, j = _hex(p, j, 8, "\\U")
        return _char(c, in_class), j
    if e == "N":
        end = p.find("}", j)
        if not p.startswith("{", j) or end < 0:
            raise RegexError(f"\\N needs a character name in braces (at position {i})")
        try:
            c = unicodedata.lookup(p[j + 1 : end])
        except KeyError as err:
            raise RegexError(f"\\N{{{p[j + 1 : end]}}} names no character") from err
        return _char(c, in_class), end + 1
    if e.isdigit():
        return _octal(p, i, in_class)
    if e.isascii() and e.isalpha():
        raise RegexError(f"\\{e} is not a regex escape")
    return _char(e, in_class), j


def _class(body: list[str], negated: bool) -> str:
    """A class from its items. xgrammar reads `[\\^` as a negated class: a literal `^` (or a
    range from it) that opens a class moves to its end, and `[\\^]` is written `\\^`."""
    if not negated and body and body[0] == "\\^":
        if body == ["\\^"]:
            return "\\^"
        if len(body) >= 3 and body[1] == "-":  # `^-x`: `^` and `_-x` (`_` follows `^`)
            body = ["_", *body[1:], "\\^"] if body[2] != "\\^" else [*body[3:], "\\^"]
        else:
            body = [*body[1:], "\\^"]
    return ("[^" if negated else "[") + "".join(body) + "]"


def translate(pattern: str) -> str:
    """pattern (Python `re` syntax) -> the same language in xgrammar's regex dialect;
    RegexError names what cannot be translated."""
    out: list[str] = []
    body: list[str] = []  # the open class's items (`-` between a range's ends)
    i, n = 0, len(pattern)
    in_class = negated = False
    class_start = 0  # index just past `[` or `[^`: a `]` there is a literal
    while i < n:
        c = pattern[i]
        if c == "\\":
            text, i = _escape(pattern, i, in_class)
            (body if in_class else out).append(text)
            continue
        if in_class:
            if c == "]" and i != class_start:
                in_class = False
                out.append(_class(body, negated))
            elif c == "-" and i != class_start and i + 1 < n and pattern[i + 1] != "]":
                body.append(c)  # a range
            else:
                body.append(_char(c, True))
            i += 1
            continue
        if c == "[":
            in_class, body = True, []
            i += 1
            negated = i < n and pattern[i] == "^"
            i += negated
            class_start = i
            continue
        out.append(_char(c, False) if c in _CONTROL or c == "\0" else c)
        i += 1
    if in_class:
        raise RegexError("a character class is not closed with ]")
    return "".join(out)
