"""Grammars that derive no finite string: refused (a 400 naming the rule) instead of run.

xgrammar compiles `root ::= root` and `root ::= "a" root` without complaint. The first allows no
token at all (every logit masked: the sampler draws token 0, the grammar refuses it); the second
allows "a" forever and never a stop token (the output runs to max_tokens). Neither can produce an
output that matches. A rule is *productive* when one of its alternatives is made only of productive
parts (a literal, a non-empty character class, a productive rule, a repetition that may be empty),
computed to a fixpoint; the grammar is refused when its root is not productive:

    root ::= "a" root                 root: not productive (its one alternative needs root)
    root ::= "a" root | "b"           productive ("b")
    root ::= x "!"   x ::= x "a"      x, root: not productive

JSON schemas too (their grammar, as xgrammar converts them): a required string whose pattern matches
nothing, a required property whose schema is the whole schema again ({"$ref": "#"}).

The check reads xgrammar's own normalized print of the grammar (`str(xgr.Grammar)`), whose shape
is regular: one rule per line, `name ::= ((a b) | (c))`, repetitions as helper rules or `x{m, n}`,
a lookahead as a trailing `(=(...))`. Regexes go through the same print (`Grammar.from_regex`): an
empty character class like `[^\\s\\S]` prints as a negated class covering every code point, so the
regex matches nothing.
"""

from __future__ import annotations

import functools
import logging
import re

logger = logging.getLogger(__name__)
_ESCAPES = {"0": 0, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27, "a": 7}
_MAX_CODE_POINT = 0x10FFFF
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_REPEAT = re.compile(r"\{\s*(-?\d+)\s*(?:,\s*(-?\d+)\s*)?\}")


def _escape(text: str, i: int) -> tuple[int, int]:
    """The code point of the escape at text[i] == '\\' and the index after it: '\\x41' -> (65, i + 4)."""
    c = text[i + 1]
    for prefix, width in (("x", 2), ("u", 4), ("U", 8)):
        if c == prefix:
            return int(text[i + 2:i + 2 + width], 16), i + 2 + width
    return _ESCAPES.get(c, ord(c)), i + 2


def class_is_empty(body: str) -> bool:
    """body: a character class without its brackets ('^a-z', '\\0-\\U0010ffff'). Empty when it lists
    nothing, or is negated and its ranges cover every code point."""
    negated = body.startswith("^")
    i = 1 if negated else 0
    ranges: list[tuple[int, int]] = []
    while i < len(body):
        lo, i = _escape(body, i) if body[i] == "\\" else (ord(body[i]), i + 1)
        hi = lo
        if i + 1 < len(body) and body[i] == "-":
            hi, i = _escape(body, i + 1) if body[i + 1] == "\\" else (ord(body[i + 1]), i + 2)
        ranges.append((lo, hi))
    if not negated:
        return not ranges
    covered = 0  # every code point below this is in some range
    for lo, hi in sorted(ranges):
        if lo > covered:
            return False
        covered = max(covered, hi + 1)
    return covered > _MAX_CODE_POINT


def _tokens(line: str) -> list[tuple[str, object]]:
    """One rule body of xgrammar's print -> tokens: ('lit',), ('class', empty), ('ref', name), ('(',),
    (')',), ('|',), ('look',), ('rep', min), ('call',) for a builtin such as TagDispatch(...)."""
    out: list[tuple[str, object]] = []
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c.isspace():
            i += 1
        elif c == '"':
            i += 1
            while line[i] != '"':
                i += 2 if line[i] == "\\" else 1
            i += 1
            out.append(("lit", None))
        elif c == "[":
            j = i + 1
            while line[j] != "]":
                j += 2 if line[j] == "\\" else 1
            out.append(("class", class_is_empty(line[i + 1:j])))
            i = j + 1
        elif line.startswith("(=", i):
            out.append(("look", None))
            i += 2
        elif c in "()|":
            out.append((c, None))
            i += 1
        elif c in "*?":
            out.append(("rep", 0))
            i += 1
        elif c == "+":
            out.append(("rep", 1))
            i += 1
        elif c == "{" and (m := _REPEAT.match(line, i)):
            out.append(("rep", max(int(m.group(1)), 0)))
            i = m.end()
        elif m := _NAME.match(line, i):
            i = m.end()
            if i < n and line[i] == "(":  # a builtin call: its arguments are not rule structure
                depth, i = 1, i + 1
                while depth and i < n:
                    if line[i] == '"':
                        i += 1
                        while line[i] != '"':
                            i += 2 if line[i] == "\\" else 1
                    depth += {"(": 1, ")": -1}.get(line[i], 0)
                    i += 1
                out.append(("call", None))
            else:
                out.append(("ref", m.group(0)))
        else:
            raise ValueError(f"unexpected {c!r} at {i} in {line!r}")
    return out


class _Rule:
    """A rule body as nested tuples: ('alt', [seq]), ('seq', [node]), ('rep', node, min), ('ref', name),
    ('lit',), ('class', empty)."""

    def __init__(self, tokens: list[tuple[str, object]]) -> None:
        self.tokens, self.pos = tokens, 0
        self.node = self._alt()  # a trailing lookahead is left unread: it consumes nothing

    def _peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def _alt(self):
        seqs = [self._seq()]
        while self._peek() == "|":
            self.pos += 1
            seqs.append(self._seq())
        return ("alt", seqs)

    def _seq(self):
        items = []
        while self._peek() not in (None, ")", "|", "look"):
            items.append(self._postfix())
        return ("seq", items)

    def _postfix(self):
        node = self._atom()
        while self._peek() == "rep":
            node = ("rep", node, self.tokens[self.pos][1])
            self.pos += 1
        return node

    def _atom(self):
        kind, value = self.tokens[self.pos]
        self.pos += 1
        if kind == "(":
            node = self._alt()
            self.pos += 1  # ')'
            return node
        if kind == "ref":
            return ("ref", value)
        if kind == "class":
            return ("class", value)
        return ("lit",)  # a literal, or a builtin call (taken as productive)


def _productive(node, good: set[str]) -> bool:
    kind = node[0]
    if kind == "alt":
        return any(_productive(s, good) for s in node[1])
    if kind == "seq":
        return all(_productive(s, good) for s in node[1])
    if kind == "rep":
        return node[2] == 0 or _productive(node[1], good)
    if kind == "ref":
        return node[1] in good
    if kind == "class":
        return not node[1]
    return True


def _refs(node, out: set[str]) -> set[str]:
    if node[0] in ("alt", "seq"):
        for s in node[1]:
            _refs(s, out)
    elif node[0] == "rep":
        _refs(node[1], out)
    elif node[0] == "ref":
        out.add(node[1])
    return out


def unproductive_rules(printed: str, root: str = "root") -> list[str]:
    """xgrammar's print of a grammar -> the rules reachable from `root` that derive no finite string
    (empty: the grammar is fine). Order: root first, then by name."""
    rules: dict[str, object] = {}
    for line in printed.splitlines():
        if " ::= " in line:
            name, body = line.split(" ::= ", 1)
            rules[name.strip()] = _Rule(_tokens(body)).node
    good: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, node in rules.items():
            if name not in good and _productive(node, good):
                good.add(name)
                changed = True
    if root in good or root not in rules:
        return []
    seen, todo = {root}, [root]
    while todo:
        for ref in _refs(rules[todo.pop()], set()):
            if ref in rules and ref not in seen:
                seen.add(ref)
                todo.append(ref)
    bad = sorted(seen - good - {root})
    return [root, *bad]


@functools.lru_cache(maxsize=256)
def check_productive(kind: str, source: str, any_whitespace: bool = True, max_whitespace: int | None = None) -> None:
    """ValueError when the grammar (kind 'grammar': EBNF), regex ('regex') or JSON schema ('json', its
    text; the whitespace settings as compiled) derives no finite string, naming the rules of a grammar
    (those the user wrote; xgrammar's helper rules are left out)."""
    import xgrammar as xgr

    try:
        if kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(source)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(source)
        else:
            grammar = xgr.Grammar.from_json_schema(source, any_whitespace=any_whitespace, strict_mode=True,
                                                   max_whitespace_cnt=max_whitespace)
        bad = unproductive_rules(str(grammar))
    except Exception:  # noqa: BLE001 - it compiled already; a print this reader does not know runs as compiled
        logger.warning("structured outputs: the productivity check could not read the %s's grammar", kind,
                       exc_info=True)
        return
    if not bad:
        return
    if kind == "json":
        raise ValueError("structured_outputs.json cannot be matched: the schema admits no finite JSON value "
                         "(e.g. a string pattern that matches nothing, or a required property whose schema refers "
                         "back to itself), so no output can match it.")
    if kind == "regex":
        raise ValueError("structured_outputs.regex matches no string (an empty character class such as "
                         "[^\\s\\S] on every path), so no output can match it.")
    written = [r for r in bad if re.search(rf"(^|\n)\s*{re.escape(r)}\s*::=", source)] or bad[:1]
    names = ", ".join(repr(r) for r in written)
    raise ValueError(
        f"structured_outputs.grammar cannot be matched: {'rule' if len(written) == 1 else 'rules'} {names} "
        f"derive{'s' if len(written) == 1 else ''} no finite string: "
        "every alternative refers back to an unproductive rule (or an empty character class), so no output "
        "can end; give the rule an alternative that ends, e.g. root ::= \"a\" root | \"a\".")
