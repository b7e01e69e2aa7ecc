"""WebArena's action space, parsed from the agent's turn the way the original agent does.

The agent reasons, then writes one action inside triple backticks; the first ```...``` block counts
(``action_splitter`` in WebArena). Actions::

    click [id]   hover [id]   type [id] [text] [press_enter_after=0|1]   press [key_comb]   scroll [up|down]
    new_tab   tab_focus [tab_index]   close_tab   goto [url]   go_back   go_forward   stop [answer]

``type`` presses Enter after the text unless the last argument is 0, as in WebArena. Anything else is a
:class:`ParseError` whose message is the observation the agent gets back.
"""

from __future__ import annotations

import dataclasses
import re

NO_BACKTICKS = ("Cannot parse action from response. Your action should be inside triple backticks (```), e.g. "
                "```click [12]```. Please adjust accordingly.")
ACTION_NAMES = ("click", "type", "hover", "press", "scroll", "new_tab", "tab_focus", "close_tab", "goto", "go_back",
                "go_forward", "stop")
_BLOCK = re.compile(r"```(.*?)```", re.DOTALL)
_ARGS = re.compile(r"\[(.*?)\]", re.DOTALL)
_TYPE = re.compile(r"type\s*\[(\d+)\]\s*\[(.*)\]\s*\[([01])\]\s*$", re.DOTALL)
_TYPE_NO_ENTER = re.compile(r"type\s*\[(\d+)\]\s*\[(.*)\]\s*$", re.DOTALL)
_STOP = re.compile(r"stop\s*\[(.*)\]\s*$", re.DOTALL)
KEY_ALIASES = {"ctrl": "Control", "control": "Control", "cmd": "Meta", "meta": "Meta", "alt": "Alt", "shift": "Shift",
               "enter": "Enter", "return": "Enter", "esc": "Escape", "escape": "Escape", "tab": "Tab",
               "backspace": "Backspace", "delete": "Delete", "space": "Space", "up": "ArrowUp", "down": "ArrowDown",
               "left": "ArrowLeft", "right": "ArrowRight", "pageup": "PageUp", "pagedown": "PageDown",
               "home": "Home", "end": "End"}


class ParseError(ValueError):
    """The turn holds no valid action; ``str(error)`` is the message for the agent."""


@dataclasses.dataclass(frozen=True)
class Action:
    """One parsed action; ``text`` is its canonical form (shown as PREVIOUS ACTION)."""

    name: str
    element: int | None = None
    text: str = ""  # typed text, key combination, url, direction or answer
    number: int | None = None  # tab index, or press_enter_after for type

    def __str__(self) -> str:
        if self.name == "type":
            return f"type [{self.element}] [{self.text}] [{self.number}]"
        if self.element is not None:
            return f"{self.name} [{self.element}]"
        if self.name == "tab_focus":
            return f"tab_focus [{self.number}]"
        if self.name in ("press", "scroll", "goto", "stop"):
            return f"{self.name} [{self.text}]"
        return self.name


def extract_block(turn: str) -> str:
    """The text of the first triple-backtick block (a leading language tag line is dropped)."""
    match = _BLOCK.search(turn)
    if match is None:
        raise ParseError(NO_BACKTICKS)
    block = match.group(1).strip()
    first, _, rest = block.partition("\n")
    if rest and first.strip().isalpha() and first.strip() not in ACTION_NAMES:
        block = rest.strip()  # ```text\nclick [3]```
    return block


def normalize_keys(combo: str) -> str:
    """``ctrl+a`` -> ``Control+a``: Playwright's key names."""
    parts = [part.strip() for part in combo.split("+") if part.strip()]
    if not parts:
        raise ParseError("press needs a key combination, e.g. ```press [Enter]``` or ```press [Control+a]```")
    return "+".join(KEY_ALIASES.get(part.lower(), part) for part in parts)


def _element(name: str, args: list[str]) -> Action:
    if len(args) != 1 or not args[0].strip().isdigit():
        raise ParseError(f"{name} needs one element id from the observation, e.g. ```{name} [12]```")
    return Action(name, element=int(args[0]))


def parse_action(turn: str) -> Action:
    """The action of the agent's turn, or :class:`ParseError` with what is wrong."""
    block = extract_block(turn)
    name = re.match(r"[a-z_]*", block).group(0)
    args = _ARGS.findall(block)
    if name == "stop":
        match = _STOP.match(block)
        return Action("stop", text=match.group(1).strip() if match else "")
    if name == "type":
        match = _TYPE.match(block) or _TYPE_NO_ENTER.match(block)
        if match is None:
            raise ParseError("type needs an element id and the text, e.g. ```type [12] [blue shoes] [1]``` (the last "
                             "argument 1 presses Enter afterwards, 0 does not)")
        enter = int(match.group(3)) if match.lastindex == 3 else 1
        return Action("type", element=int(match.group(1)), text=match.group(2), number=enter)
    if name in ("click", "hover"):
        return _element(name, args)
    if name == "press":
        if len(args) != 1:
            raise ParseError("press needs one key combination, e.g. ```press [Enter]```")
        return Action("press", text=normalize_keys(args[0]))
    if name == "scroll":
        direction = args[0].strip().lower() if len(args) == 1 else ""
        if direction.startswith("direction="):
            direction = direction[len("direction="):]
        if direction not in ("up", "down"):
            raise ParseError("scroll needs a direction, ```scroll [down]``` or ```scroll [up]```")
        return Action("scroll", text=direction)
    if name == "tab_focus":
        if len(args) != 1 or not args[0].strip().isdigit():
            raise ParseError("tab_focus needs a tab index, e.g. ```tab_focus [0]```")
        return Action("tab_focus", number=int(args[0]))
    if name == "goto":
        if len(args) != 1 or not args[0].strip():
            raise ParseError("goto needs a URL, e.g. ```goto [http://example.com/page]```")
        return Action("goto", text=args[0].strip())
    if name in ("new_tab", "close_tab", "go_back", "go_forward"):
        return Action(name)
    raise ParseError(f"unknown action {block.split()[0] if block.split() else block!r}; use one of: "
                     + ", ".join(ACTION_NAMES))
