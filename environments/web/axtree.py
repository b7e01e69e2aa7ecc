"""The page's accessibility tree as WebArena's text observation: lines ``[id] role 'name' props``.

The tree comes from CDP ``Accessibility.getFullAXTree`` of the main frame. Element ids are small integers
given in tree order as elements first appear (:class:`IdMap`): an element keeps its id while it lives, and the
first observation of a page is the same in every process. As in WebArena: nodes with no name and no properties of layout-only roles are dropped
(their children move up), some properties are never shown, indentation is one tab per level, and with
``viewport_only`` (WebArena's ``current_viewport_only``) nodes whose layout box lies outside the visible
viewport are dropped, so the agent scrolls to see more. Static text repeated verbatim by the line above it is
removed. Length is capped at ``max_tokens`` approximate tokens (characters / 4; there is no tokenizer in the
environment), cut at a line boundary with a note saying how much was cut.
"""

from __future__ import annotations

import dataclasses
from typing import Any

IGNORED_PROPERTIES = frozenset({"focusable", "editable", "readonly", "level", "settable", "multiline", "invalid",
                                "url"})  # the page URL is given on its own line; link targets cost many tokens
EMPTY_LAYOUT_ROLES = frozenset({"generic", "img", "list", "strong", "paragraph", "banner", "navigation", "Section",
                                "LabelText", "Legend", "listitem", "none"})
SKIPPED_ROLES = frozenset({"InlineTextBox", "LineBreak"})
CHARS_PER_TOKEN = 4


def approx_tokens(text: str) -> int:
    """A tokenizer-free token count: one token per 4 characters (English BPE tokenizers average ~4)."""
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


@dataclasses.dataclass
class AXTree:
    """A rendered tree: the text, and what each shown id is (for executing actions on it)."""

    text: str
    nodes: dict[int, str]  # id -> its line (role and name)
    truncated_lines: int = 0
    backend: dict[int, int] = dataclasses.field(default_factory=dict)  # id -> CDP backendDOMNodeId


class IdMap:
    """Element ids of one tab: 1, 2, ... in tree order as elements first appear, kept for the element's life.

    So the first observation of a page is the same in every process (CDP's backend node ids are not), and an
    element keeps its id while the page changes around it. A new document starts again from 1.
    """

    def __init__(self) -> None:
        self.document: int | None = None
        self.ids: dict[int, int] = {}

    def start(self, document: int | None) -> None:
        if document != self.document:
            self.document, self.ids = document, {}

    def __call__(self, backend: int) -> int:
        return self.ids.setdefault(backend, len(self.ids) + 1)


def _value(field: Any) -> Any:
    return field.get("value") if isinstance(field, dict) else None


def _layout_boxes(snapshot: dict[str, Any]) -> dict[int, tuple[float, float, float, float]]:
    """backendNodeId -> (x, y, width, height) in document coordinates, from DOMSnapshot.captureSnapshot."""
    if not snapshot.get("documents"):
        return {}
    document = snapshot["documents"][0]
    backend_ids = document["nodes"].get("backendNodeId", [])
    boxes: dict[int, tuple[float, float, float, float]] = {}
    for index, bounds in zip(document["layout"]["nodeIndex"], document["layout"]["bounds"]):
        backend = backend_ids[index]
        x, y, w, h = bounds
        if backend in boxes:  # a node with several boxes (wrapped text): their union
            ox, oy, ow, oh = boxes[backend]
            nx, ny = min(ox, x), min(oy, y)
            boxes[backend] = (nx, ny, max(ox + ow, x + w) - nx, max(oy + oh, y + h) - ny)
        else:
            boxes[backend] = (x, y, w, h)
    return boxes


def _format_node(node: dict[str, Any]) -> tuple[str, bool]:
    """The node's line (without id) and whether it is worth showing."""
    role = str(_value(node.get("role")) or "")
    name = str(_value(node.get("name")) or "")
    properties = []
    for prop in node.get("properties") or []:
        if prop.get("name") in IGNORED_PROPERTIES:
            continue
        value = _value(prop.get("value"))
        if value is None or value == "":
            continue
        properties.append(f"{prop['name']}: {value}")
    line = f"{role} {name!r}" + (" " + " ".join(properties) if properties else "")
    if role in SKIPPED_ROLES or not role or role == "StaticText" and not name.strip():
        return line, False
    if not name.strip() and (not properties and role in EMPTY_LAYOUT_ROLES or role == "listitem"):
        return line, False
    return line, True


def render(nodes: list[dict[str, Any]], boxes: dict[int, tuple] | None, viewport: tuple[float, float, float, float],
           max_tokens: int, ids: IdMap | None = None) -> AXTree:
    """Renders CDP AX nodes; ``boxes`` None shows every node, else only those meeting ``viewport`` (x, y, w, h).
    ``ids`` numbers the elements (default: a fresh :class:`IdMap`)."""
    if not nodes:
        return AXTree("", {})
    ids = ids if ids is not None else IdMap()
    ids.start(nodes[0].get("backendDOMNodeId"))
    by_id = {node["nodeId"]: node for node in nodes}
    children_of = {node["nodeId"]: node.get("childIds") or [] for node in nodes}
    vx, vy, vw, vh = viewport
    lines: list[str] = []
    shown: dict[int, str] = {}
    backend_of: dict[int, int] = {}

    def visible(backend: int | None) -> bool:
        if boxes is None or backend is None or backend not in boxes:
            return True
        x, y, w, h = boxes[backend]
        return not (x + w < vx or y + h < vy or x > vx + vw or y > vy + vh)

    stack: list[tuple[str, int]] = [(nodes[0]["nodeId"], 0)]
    while stack:
        node_id, depth = stack.pop()
        node = by_id.get(node_id)
        if node is None:
            continue
        keep = False
        if not node.get("ignored"):
            line, keep = _format_node(node)
            backend = node.get("backendDOMNodeId")
            keep = keep and backend is not None and visible(backend)
            if keep and _value(node.get("role")) == "StaticText" and lines and line[len("StaticText "):] in lines[-1]:
                keep = False  # the text is already on the line above (e.g. a link's name)
            if keep:
                element = ids(backend)
                lines.append("\t" * depth + f"[{element}] {line}")
                shown[element], backend_of[element] = line, backend
        child_depth = depth + 1 if keep else depth
        for child in reversed(children_of.get(node_id, [])):
            stack.append((child, child_depth))
    return _cap(lines, shown, backend_of, max_tokens)


def _cap(lines: list[str], shown: dict[int, str], backend_of: dict[int, int], max_tokens: int) -> AXTree:
    budget = max_tokens * CHARS_PER_TOKEN
    used, kept = 0, 0
    for line in lines:
        if used + len(line) + 1 > budget:
            break
        used += len(line) + 1
        kept += 1
    cut = len(lines) - kept
    text = "\n".join(lines[:kept])
    if cut:
        text += f"\n[... {cut} more lines cut to fit {max_tokens} tokens; scroll or narrow the page to see them]"
    return AXTree(text, shown, cut, backend_of)


def fetch(page: Any, cdp: Any, viewport_only: bool, max_tokens: int, ids: IdMap) -> AXTree:
    """The rendered tree of ``page`` (a Playwright page; ``cdp`` its CDP session). Runs on the browser thread."""
    nodes = cdp.send("Accessibility.getFullAXTree")["nodes"]
    boxes, viewport = None, (0.0, 0.0, 0.0, 0.0)
    if viewport_only:
        snapshot = cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": []})
        boxes = _layout_boxes(snapshot)
        metrics = cdp.send("Page.getLayoutMetrics")["cssLayoutViewport"]
        viewport = (metrics["pageX"], metrics["pageY"], metrics["clientWidth"], metrics["clientHeight"])
    return render(nodes, boxes, viewport, max_tokens, ids)
