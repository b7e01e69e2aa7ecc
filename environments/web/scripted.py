"""Scripted solutions that act through the agent's interface: they read element ids from the observation text.

Used by the tests (the evaluators must pass them and fail wrong answers) and the benchmark (realistic
turns). A plan is a list of steps such as ``("click", "link", "Kitchen")`` or ``("type", "textbox", "Search
products", "tea", 1)``; each is turned into a turn text against the *current* observation, so ids are
always the page's own. ``("stop", answer)`` may take a function of the observation.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

Step = tuple[Any, ...]
_LINE = re.compile(r"\[(\d+)\] (\S+) '((?:[^'\\]|\\.)*)'")


def element_id(observation: str, role: str, name: str) -> int:
    """The id of the first element with this role and exact name (``*`` matches any role)."""
    for match in _LINE.finditer(observation):
        if (role == "*" or match.group(2) == role) and match.group(3) == name:
            return int(match.group(1))
    raise LookupError(f"no {role} named {name!r} in the observation")


def turn(observation: str, step: Step) -> str:
    """The agent turn (reasoning, then the action in backticks) for one plan step."""
    verb = step[0]
    if verb == "stop":
        answer = step[1](observation) if callable(step[1]) else step[1]
        action = f"stop [{answer}]"
    elif verb == "type":
        action = f"type [{element_id(observation, step[1], step[2])}] [{step[3]}] [{step[4]}]"
    elif verb in ("click", "hover"):
        action = f"{verb} [{element_id(observation, step[1], step[2])}]"
    else:
        action = " ".join([verb, *(f"[{arg}]" for arg in step[1:])])
    return f"Let's think step-by-step. Following the plan. In summary, the next action I will perform is ```{action}```"


def _products_count(observation: str) -> str:
    return re.search(r"'(\d+) products'", observation).group(1)


# Corner Shop (webarena_local) task id -> plan. The home page is the start page of every task.
LOCAL_PLANS: dict[int, list[Step]] = {
    0: [("click", "link", "Kitchen"), ("stop", _products_count)],
    1: [("click", "link", "Garden"), ("click", "link", "Copper Watering Can"), ("stop", "Copper Watering Can")],
    2: [("type", "textbox", "Search products", "tea", 1), ("stop", "")],
    3: [("click", "link", "Stationery"), ("click", "link", "Recycled Paper Envelopes"), ("stop", "")],
    4: [("type", "textbox", "Search products", "Oak Cutting Board", 1), ("click", "link", "Oak Cutting Board"),
        ("type", "textbox", "Nickname", "Sam", 0), ("click", "option", "5 stars"),
        ("type", "textbox", "Review", "Sturdy and smooth", 0), ("click", "button", "Submit review"), ("stop", "")],
    5: [("click", "link", "My account (emma)"), ("click", "link", "Newsletter settings"),
        ("click", "checkbox", "Subscribe to the weekly newsletter"), ("click", "button", "Save"), ("stop", "")],
    6: [("type", "textbox", "Search products", "Linen Tea Towel", 1), ("click", "link", "Linen Tea Towel"),
        ("type", "textbox", "Quantity", "2", 0), ("click", "button", "Add to cart"), ("click", "button", "Place order"),
        ("stop", "")],
    7: [("click", "link", "Home"), ("click", "link", "Walnut Desk Organizer"), ("stop", "$24.00")],
}
# Wrong solutions: plausible plans that must score 0.
LOCAL_WRONG_PLANS: dict[int, list[Step]] = {
    0: [("click", "link", "Kitchen"), ("stop", "5")],
    1: [("click", "link", "Garden"), ("stop", "Canvas Kneeling Pad")],
    2: [("type", "textbox", "Search products", "mug", 1), ("stop", "")],
    3: [("click", "link", "Stationery"), ("click", "link", "Brass Pencil Sharpener"), ("stop", "")],
    4: [("type", "textbox", "Search products", "Oak Cutting Board", 1), ("click", "link", "Oak Cutting Board"),
        ("type", "textbox", "Nickname", "Sam", 0), ("type", "textbox", "Review", "Wobbly", 0),
        ("click", "button", "Submit review"), ("stop", "")],
    5: [("click", "link", "My account (emma)"), ("click", "link", "Newsletter settings"), ("click", "button", "Save"),
        ("stop", "")],
    6: [("type", "textbox", "Search products", "Linen Tea Towel", 1), ("click", "link", "Linen Tea Towel"),
        ("click", "button", "Add to cart"), ("click", "button", "Place order"), ("stop", "")],
    7: [("click", "link", "Home"), ("click", "link", "Walnut Desk Organizer"), ("stop", "$26.00")],
}


def _quoted(objective: str) -> list[str]:
    return re.findall(r'"([^"]*)"', objective)


def _arithmetic(observation: str) -> str:
    a, op, b = re.search(r"'(-?\d+) ([-+x*]) (-?\d+) ='", observation).groups()
    return str({"+": int(a) + int(b), "-": int(a) - int(b)}.get(op, int(a) * int(b)))


def _selection(objective: str) -> list[str]:
    match = re.match(r"Select (.*) and click Submit\.", objective)
    if not match or match.group(1) == "nothing":
        return []
    return [name.strip() for name in re.split(r",\s*(?:and\s+)?|\s+and\s+", match.group(1)) if name.strip()]


def miniwob_plan(task: str, objective: str, observation: str, wrong: bool = False) -> list[Step]:
    """A plan for the MiniWoB++ tasks in :data:`MINIWOB_SOLVABLE` (``wrong``: a plausible failing one)."""
    quoted = _quoted(objective)
    if task in ("click-button", "unicode-test"):
        names = [m.group(3) for m in _LINE.finditer(observation) if m.group(2) == "button"]
        target = next(n for n in names if n != quoted[0]) if wrong else quoted[0]
        return [("click", "button", target)]
    if task == "click-test":
        return [("click", "StaticText", "Click the button.")] if wrong else [("click", "button", "Click Me!")]
    if task == "click-test-2":
        target = re.search(r"Click button (\w+)\.", objective).group(1)
        return [("click", "button", {"ONE": "TWO", "TWO": "ONE"}[target] if wrong else target)]
    if task == "click-link":
        return [("click", "StaticText", quoted[0])] if not wrong else [("click", "StaticText", objective)]
    if task == "focus-text":
        return [("click", "StaticText", objective)] if wrong else [("click", "textbox", "")]
    if task in ("enter-text", "enter-text-2"):
        text = quoted[0]
        if task == "enter-text-2":
            text = text.lower() if "lower case" in objective else text.upper()
        return [("type", "textbox", "", text + ("x" if wrong else ""), 0), ("click", "button", "Submit")]
    if task == "enter-password":
        password = quoted[0] + ("x" if wrong else "")
        first = element_id(observation, "textbox", "")
        second = max(int(m.group(1)) for m in _LINE.finditer(observation) if m.group(2) == "textbox")
        return [("type_id", first, password), ("type_id", second, quoted[0]), ("click", "button", "Submit")]
    if task == "login-user":
        user, password = quoted[0], quoted[1] + ("x" if wrong else "")
        boxes = [int(m.group(1)) for m in _LINE.finditer(observation) if m.group(2) == "textbox"]
        return [("type_id", boxes[0], user), ("type_id", boxes[1], password), ("click", "button", "Login")]
    if task in ("click-checkboxes", "click-option"):
        role = "checkbox" if task == "click-checkboxes" else "radio"
        names = _selection(objective)
        if wrong:
            others = [m.group(3) for m in _LINE.finditer(observation) if m.group(2) == role and m.group(3) not in names]
            names = names[:-1] + others[:1] if names else others[:1]
        return [("click", role, name) for name in names] + [("click", "button", "Submit")]
    if task == "click-tab":
        target = re.search(r"Click on (Tab #\d+)\.", objective).group(1)
        return [("click", "StaticText", objective)] if wrong else [("click", "link", target)]
    if task == "choose-list":
        target = re.match(r"Select (.*) from the list and click Submit\.", objective).group(1)
        options = [m.group(3) for m in _LINE.finditer(observation) if m.group(2) == "option"]
        return [("click", "option", next(o for o in options if o != target) if wrong else target),
                ("click", "button", "Submit")]
    if task == "simple-arithmetic":
        answer = str(int(_arithmetic(observation)) + (1 if wrong else 0))
        return [("type", "textbox", "", answer, 0), ("click", "button", "Submit")]
    raise KeyError(f"no scripted plan for MiniWoB++ task {task!r}; scripted ones: {MINIWOB_SOLVABLE}")


MINIWOB_SOLVABLE = ("click-button", "unicode-test", "click-test", "click-test-2", "click-link", "focus-text",
                    "enter-text", "enter-text-2", "enter-password", "login-user", "click-checkboxes", "click-option",
                    "click-tab", "choose-list", "simple-arithmetic")


def run_plan(reset_observation: str, plan: list[Step], step: Callable[[str], Any]) -> Iterator[Any]:
    """Plays ``plan`` with ``step(turn_text) -> StepResult``; yields each result (stops when done)."""
    observation = reset_observation
    for item in plan:
        if item[0] == "type_id":
            text = f"```type [{item[1]}] [{item[2]}] [0]```"
        else:
            text = turn(observation, item)
        result = step(text)
        yield result
        if result.done:
            return
        observation = result.observation
