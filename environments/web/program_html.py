"""WebArena's ``program_html`` checks without ``eval``: the locator forms the 812 tasks use, parsed into data.

A locator is parsed into terms, joined by ``+``; each term is a chain from ``document`` through
``querySelector(s)``, ``querySelectorAll(s)[i]``, ``firstElementChild``, ``lastElementChild`` or ``lastChild``
to a value (``outerText``, ``innerText``, ``textContent``, ``value``, ``selectedIndex``,
``checked.toString()``, ``getAttribute(a)``); a term may be optional with a default,
``(chain?.outerText || 'x')``; a term may be a string literal, or list attributes, ``[...chain.querySelectorAll(s)].map(elem =>
elem.getAttribute(a) || elem.getAttribute(b)).join(' ')``. The parsed terms run in one fixed JavaScript
function (:data:`INTERPRETER`), with selectors and names passed as arguments, never as code. The
``func:`` forms are implemented explicitly in ``site_functions.py``. Any other form is a
:class:`LocatorError` naming it.
"""

from __future__ import annotations

import re
from typing import Any

_STRING = r"""(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")"""
_STEP = re.compile(r"\.querySelector\(\s*" + _STRING + r"\s*\)|\.querySelectorAll\(\s*" + _STRING
                   + r"\s*\)\s*\[\s*(\d+)\s*\]|\.(firstElementChild|lastElementChild|lastChild)")
_VALUE = re.compile(r"(\?)?\.(?:(outerText|innerText|textContent|value|selectedIndex)|(checked)\.toString\(\)|"
                    r"getAttribute\(\s*" + _STRING + r"\s*\))")
_MAP = re.compile(r"\[\.\.\.(document.*?)\.querySelectorAll\(\s*" + _STRING + r"\s*\)\]\.map\(\s*(\w+)\s*=>\s*(.*?)\)"
                  r"\.join\(\s*" + _STRING + r"\s*\)$", re.DOTALL)
_ATTR_OF = re.compile(r"(\w+)\.getAttribute\(\s*" + _STRING + r"\s*\)")


class LocatorError(ValueError):
    """A locator form this reimplementation does not handle."""


def _unquote(groups: tuple) -> str:
    raw = next(g for g in groups if g is not None)
    return re.sub(r"\\(.)", r"\1", raw)


def _split_plus(text: str) -> list[str]:
    """Splits on top-level ``+`` (outside strings and brackets)."""
    parts, depth, quote, start = [], 0, "", 0
    for index, char in enumerate(text):
        if quote:
            if char == quote and text[index - 1] != "\\":
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "+" and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part.strip() for part in parts]


def _chain(text: str, where: str) -> tuple[list[dict[str, Any]], str]:
    """Parses ``document.<steps>``; returns the steps and the unparsed rest."""
    if not text.startswith("document"):
        raise LocatorError(f"unsupported program_html locator {where!r}: expected it to start at `document`")
    rest, steps = text[len("document"):], []
    while True:
        match = _STEP.match(rest)
        if match is None:
            return steps, rest
        groups = match.groups()
        if groups[0] is not None or groups[1] is not None:
            steps.append({"op": "qs", "sel": _unquote(groups[0:2])})
        elif groups[2] is not None or groups[3] is not None:
            steps.append({"op": "qsa", "sel": _unquote(groups[2:4]), "index": int(groups[4])})
        else:
            steps.append({"op": "child", "name": groups[5]})
        rest = rest[match.end():]


def _term(text: str, where: str) -> dict[str, Any]:
    text = text.strip()
    literal = re.fullmatch(_STRING, text)
    if literal:
        return {"literal": _unquote(literal.groups())}
    optional = re.fullmatch(r"\((.*)\|\|\s*" + _STRING + r"\s*\)", text, re.DOTALL)
    if optional:
        term = _term(optional.group(1), where)
        term["default"] = _unquote(optional.groups()[1:3])
        return term
    mapped = _MAP.match(text)
    if mapped:
        steps, rest = _chain(mapped.group(1), where)
        attrs = [_unquote(m.groups()[1:3]) for m in _ATTR_OF.finditer(mapped.group(5))
                 if m.group(1) == mapped.group(4)]
        if rest or not attrs:
            raise LocatorError(f"unsupported program_html locator {where!r}")
        return {"steps": steps, "map": {"sel": _unquote(mapped.groups()[1:3]), "attrs": attrs,
                                        "sep": _unquote(mapped.groups()[5:7])}}
    steps, rest = _chain(text, where)
    value = _VALUE.fullmatch(rest)
    if value is None:
        raise LocatorError(f"unsupported program_html locator {where!r}: cannot read {rest!r}")
    optional_chain, prop, checked = value.group(1), value.group(2), value.group(3)
    if checked:
        read = {"prop": "checked"}
    elif prop:
        read = {"prop": prop}
    else:
        read = {"attr": _unquote(value.groups()[3:5])}
    return {"steps": steps, **read, "optional": bool(optional_chain)}


def parse_locator(locator: str) -> list[dict[str, Any]]:
    """The locator as a list of terms (data for :data:`INTERPRETER`); ``[]`` for the empty locator."""
    locator = locator.strip()
    if not locator:
        return []
    return [_term(part, locator) for part in _split_plus(locator)]


# Walks each term's steps from `document` and reads its value; a missing element gives the term's default
# (or "" when it has none), as a thrown TypeError makes the original check read "".
INTERPRETER = """(terms) => {
  const walk = (steps) => {
    let node = document;
    for (const step of steps) {
      if (node === null || node === undefined) return null;
      if (step.op === 'qs') node = node.querySelector(step.sel);
      else if (step.op === 'qsa') node = node.querySelectorAll(step.sel)[step.index];
      else node = node[step.name];
    }
    return node === undefined ? null : node;
  };
  let out = '';
  for (const term of terms) {
    if (term.literal !== undefined) { out += term.literal; continue; }
    const node = walk(term.steps);
    let value = null;
    if (node !== null) {
      if (term.map) value = [...node.querySelectorAll(term.map.sel)].map(
          (el) => term.map.attrs.map((a) => el.getAttribute(a)).find((v) => v) || '').join(term.map.sep);
      else if (term.attr !== undefined) value = node.getAttribute ? node.getAttribute(term.attr) : null;
      else if (term.prop === 'checked') value = String(node.checked);
      else value = node[term.prop];
    }
    if (value === null || value === undefined) {
      if (term.default === undefined) return '';
      value = term.default;
    }
    out += String(value);
  }
  return out;
}"""
