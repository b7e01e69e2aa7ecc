"""MiniWoB++ as a task family: the ``miniwob`` package's HTML tasks, opened from disk, with their own reward.

Task id ``i * 100 + seed`` is task ``MINIWOB_TASKS[i]`` with ``Math.seedrandom(seed)`` (as the ``miniwob``
package seeds it); seeds ``s % 5 == 4`` are the test split, and the page's data mode is set to the split.
Only tasks that the accessibility-tree action space can solve are listed (no drawing, dragging or
coordinate tasks). The task's JavaScript decides the reward (``core.endEpisode``); we read
``WOB_RAW_REWARD_GLOBAL`` (the reward before MiniWoB's time discount, which would otherwise charge the agent
for the model's thinking time; the discounted one is in ``info``), clipped to [0, 1]. The page's own
10-second episode timer is lifted and its reward display hidden.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Sequence

from environments.base import EnvError, InvalidTaskError, Task, check_split

SEEDS_PER_TASK = 100
TEST_SEED_EVERY, TEST_SEED_REMAINDER = 5, 4
MINIWOB_TASKS = (
    "click-button", "click-button-sequence", "click-checkboxes", "click-checkboxes-large", "click-checkboxes-soft",
    "click-checkboxes-transfer", "click-collapsible", "click-collapsible-2", "click-dialog", "click-dialog-2",
    "click-link", "click-menu", "click-option", "click-scroll-list", "click-tab", "click-tab-2", "click-tab-2-hard",
    "click-test", "click-test-2", "click-widget", "choose-list", "email-inbox", "email-inbox-forward-nl",
    "email-inbox-nl-turk", "enter-password", "enter-text", "enter-text-2", "enter-text-dynamic", "find-word",
    "focus-text", "focus-text-2", "form-sequence", "form-sequence-2", "login-user", "login-user-popup",
    "multi-layouts", "multi-orderings", "navigate-tree", "read-table", "read-table-2", "search-engine",
    "sign-agreement", "simple-algebra", "simple-arithmetic", "social-media", "social-media-all",
    "social-media-some", "terminal", "text-transform", "unicode-test", "use-autocomplete",
)
_START = """([seed, mode]) => {
  Math.seedrandom(seed);
  core.setDataMode(mode);
  core.EPISODE_MAX_TIME = 1e9;
  core.startEpisodeReal();
  for (const id of ['reward-display', 'click-canvas']) {
    const el = document.getElementById(id);
    if (el) el.style.display = 'none';
  }
  return WOB_TASK_READY;
}"""
_STATE = ("() => ({done: WOB_DONE_GLOBAL, raw: WOB_RAW_REWARD_GLOBAL, reward: WOB_REWARD_GLOBAL, "
          "reason: WOB_REWARD_REASON === null ? '' : String(WOB_REWARD_REASON)})")


def html_dir() -> Path:
    """``miniwob/html`` of the installed ``miniwob`` package (its Python code is not imported)."""
    spec = importlib.util.find_spec("miniwob")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "html" / "miniwob"
        if path.is_dir():
            return path.parent
    raise EnvError("the MiniWoB++ tasks are not installed: run `make setup` (or `pip install --no-deps miniwob==1.1.0`)")


class MiniWoBTasks:
    """MiniWoB++ tasks x seeds; ``begin``/``state`` run on the browser thread with the episode's page."""

    def __init__(self, tasks: Sequence[str] | None = None) -> None:
        self.names = tuple(tasks) if tasks else MINIWOB_TASKS
        root = html_dir()
        missing = [name for name in self.names if not (root / "miniwob" / f"{name}.html").is_file()]
        if missing:
            raise EnvError(f"unknown MiniWoB++ tasks {missing}; they are files in {root / 'miniwob'}")
        self.root = root

    def task_list(self) -> list[Task]:
        return [Task(i * SEEDS_PER_TASK + seed, self.split_of(seed), name)
                for i, name in enumerate(self.names) for seed in range(SEEDS_PER_TASK)]

    @staticmethod
    def split_of(seed: int) -> str:
        return "test" if seed % TEST_SEED_EVERY == TEST_SEED_REMAINDER else "train"

    def tasks(self, split: str) -> list[Task]:
        check_split(split)
        return [task for task in self.task_list() if task.split == split]

    def locate(self, task_id: int) -> tuple[str, int]:
        """(task name, seed) of a task id."""
        if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id < len(
                self.names) * SEEDS_PER_TASK:
            raise InvalidTaskError(f"miniwob task id {task_id!r} is out of range; valid ids are "
                                   f"0..{len(self.names) * SEEDS_PER_TASK - 1} (task index * 100 + seed)")
        return self.names[task_id // SEEDS_PER_TASK], task_id % SEEDS_PER_TASK

    def start_url(self, task_id: int) -> str:
        name, _ = self.locate(task_id)
        return (self.root / "miniwob" / f"{name}.html").as_uri()

    def begin(self, page: Any, task_id: int) -> str:
        """Starts the seeded episode on the loaded page; returns its utterance (the objective)."""
        _, seed = self.locate(task_id)
        ready = page.evaluate(_START, [seed, self.split_of(seed)])
        deadline = time.monotonic() + 2.0
        while not ready and time.monotonic() < deadline:
            time.sleep(0.05)
            ready = page.evaluate("() => WOB_TASK_READY")
        if not ready:
            raise EnvError(f"MiniWoB++ task {self.names[task_id // SEEDS_PER_TASK]} did not become ready in 2 s")
        return str(page.evaluate("() => core.getUtterance()"))

    @staticmethod
    def state(page: Any) -> dict[str, Any]:
        """The page's episode state: done, raw reward (the one we use), discounted reward and reason."""
        return dict(page.evaluate(_STATE))
