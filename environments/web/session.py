"""One episode's browser context: its tabs, the observation of the current tab, and action execution.

Every method runs on the browser's owner thread (see ``browser.py``). Impossible actions (an id that is not
on the page, an element that cannot be clicked in time, a bad tab index) raise :class:`ActionFailed`, whose
message becomes the agent's observation. A crashed renderer or a page that does not load raises
:class:`EpisodeBroken`: the episode cannot go on.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable

from environments.web import axtree
from environments.web.actions import Action
from environments.web.browser import VIEWPORT

TARGET_ATTRIBUTE = "data-agentgym-target"
# Marks the element behind an AX node so that Playwright's actionability checks (visible, enabled, stable,
# scrolled into view) apply to it; text nodes stand for their parent element; an <option> for its <select>.
_MARK = """function(token) {
  let el = this.nodeType === 1 ? this : this.parentElement;
  if (!el) return null;
  if (el.tagName === 'OPTION' && el.closest('select')) {
    el.closest('select').setAttribute('%s', token);
    return {kind: 'option', value: el.value};
  }
  el.setAttribute('%s', token);
  return {kind: 'element', tag: el.tagName.toLowerCase(), editable: el.isContentEditable ||
          ['INPUT', 'TEXTAREA'].includes(el.tagName)};
}""" % (TARGET_ATTRIBUTE, TARGET_ATTRIBUTE)
_tokens = itertools.count()


class ActionFailed(Exception):
    """The action could not be carried out; the message tells the agent why."""


class EpisodeBroken(Exception):
    """The episode cannot continue (renderer crash, page that never loads); the message says why."""


@dataclasses.dataclass
class Timeouts:
    page_load_s: float = 30.0
    action_s: float = 5.0
    settle_s: float = 0.05  # pause after an action before waiting for any navigation it started


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class Session:
    """A fresh browser context with its tabs; the current tab is ``self.page``."""

    def __init__(self, browser: Any, timeouts: Timeouts, viewport_only: bool, max_tokens: int,
                 storage_state: str | None = None, geolocation: dict | None = None,
                 on_crash: Callable[[str], None] | None = None) -> None:
        self.timeouts = timeouts
        self.viewport_only = viewport_only
        self.max_tokens = max_tokens
        options: dict[str, Any] = {"viewport": dict(VIEWPORT)}
        if storage_state:
            options["storage_state"] = storage_state
        if geolocation:
            options["geolocation"], options["permissions"] = geolocation, ["geolocation"]
        self.context = browser.new_context(**options)
        self.context.set_default_timeout(timeouts.action_s * 1000)
        self.context.set_default_navigation_timeout(timeouts.page_load_s * 1000)
        self.context.on("page", self._adopt)
        self.pages: list[Any] = []
        self.page: Any = None
        self.crashed: str | None = None
        self._on_crash = on_crash
        self._cdp: dict[int, Any] = {}
        self._ids: dict[int, axtree.IdMap] = {}
        self._loads: dict[int, dict[str, int]] = {}  # page -> main-frame navigation requests and loads/failures
        self.last_tree = axtree.AXTree("", {})

    # -- tabs --------------------------------------------------------------------------------------------

    def _adopt(self, page: Any) -> None:
        """Every new page (new_tab, a link opening a window) becomes a tab and the current one."""
        if page in self.pages:
            return
        page.on("crash", lambda _: self._mark_crashed())
        page.on("dialog", lambda dialog: dialog.accept())
        counts = self._loads.setdefault(id(page), {"requests": 0, "ends": 0})

        def is_main_navigation(request: Any) -> bool:
            return (request.is_navigation_request() and request.frame == page.main_frame
                    and request.redirected_from is None)  # a redirect chain is one navigation

        page.on("request", lambda r: counts.update(requests=counts["requests"] + is_main_navigation(r)))
        page.on("requestfailed", lambda r: counts.update(ends=counts["ends"] + is_main_navigation(r)))
        page.on("load", lambda _: counts.update(ends=counts["ends"] + 1))
        self.pages.append(page)
        self.page = page

    def _mark_crashed(self) -> None:
        self.crashed = "the page's renderer process crashed"
        if self._on_crash is not None:
            self._on_crash(self.crashed)

    def _cdp_of(self, page: Any) -> Any:
        key = id(page)
        if key not in self._cdp:
            self._cdp[key] = self.context.new_cdp_session(page)
        return self._cdp[key]

    def open(self, start_url: str) -> None:
        """Opens the start URL(s); WebArena separates several start tabs with `` |AND| ``."""
        for url in [u.strip() for u in start_url.split(" |AND| ") if u.strip()]:
            page = self.context.new_page()
            self._adopt(page)
            self._navigate(page, url)
        if self.pages:
            self.page = self.pages[0]
            self.page.bring_to_front()

    def _navigate(self, page: Any, url: str) -> None:
        try:
            page.goto(url, wait_until="load", timeout=self.timeouts.page_load_s * 1000)
        except Exception as error:  # noqa: BLE001 - Playwright raises its own Error/TimeoutError types
            self._raise_if_broken(error)
            if "Timeout" in type(error).__name__:
                raise EpisodeBroken(f"{url} did not load within the page-load timeout of "
                                    f"{self.timeouts.page_load_s:g} s") from None
            raise ActionFailed(f"could not open {url}: {_first_line(error)}") from None

    def tab_titles(self) -> str:
        """WebArena's tab line: ``Tab 0 (current): title | Tab 1: title``."""
        parts = []
        for index, page in enumerate(self.pages):
            try:
                title = page.title()
            except Exception:  # noqa: BLE001 - a page mid-navigation has no title yet
                title = ""
            parts.append(f"Tab {index}{' (current)' if page is self.page else ''}: {title}")
        return " | ".join(parts)

    # -- observation -------------------------------------------------------------------------------------

    def observe(self) -> axtree.AXTree:
        """The current tab's accessibility tree (also kept as ``last_tree`` for id look-ups)."""
        self._check_alive()
        try:
            ids = self._ids.setdefault(id(self.page), axtree.IdMap())
            self.last_tree = axtree.fetch(self.page, self._cdp_of(self.page), self.viewport_only, self.max_tokens, ids)
        except Exception as error:  # noqa: BLE001
            self._raise_if_broken(error)
            raise
        return self.last_tree

    def url(self) -> str:
        return self.page.url if self.page is not None else ""

    def _check_alive(self) -> None:
        if self.crashed:
            raise EpisodeBroken(self.crashed)
        if self.page is None:
            raise EpisodeBroken("the episode has no open tab")

    def _raise_if_broken(self, error: BaseException) -> None:
        if self.crashed or "crash" in str(error).lower():
            raise EpisodeBroken(self.crashed or f"the page's renderer crashed ({_first_line(error)})") from None

    # -- actions -----------------------------------------------------------------------------------------

    def execute(self, action: Action) -> None:
        """Carries out ``action`` (not ``stop``, which the environment handles)."""
        self._check_alive()
        for counts in self._loads.values():  # count only navigations this action starts
            counts["ends"] = counts["requests"] = max(counts["ends"], counts["requests"])
        try:
            getattr(self, f"_do_{action.name}")(action)
            if action.name not in ("new_tab", "tab_focus", "close_tab", "scroll"):
                self._wait_for_navigation(action)
        except (ActionFailed, EpisodeBroken):
            raise
        except Exception as error:  # noqa: BLE001 - Playwright's errors become the agent's observation
            self._raise_if_broken(error)
            if "Timeout" in type(error).__name__:
                raise ActionFailed(f"{action} timed out after {self.timeouts.action_s:g} s: the element may be "
                                   "hidden, covered or disabled") from None
            raise ActionFailed(f"{action} failed: {_first_line(error)}") from None
        self._check_alive()

    def _wait_for_navigation(self, action: Action) -> None:
        """Gives the action ``settle_s`` to start a navigation; if it did, waits for the new page's load."""
        page = self.page
        page.wait_for_timeout(self.timeouts.settle_s * 1000)  # pumps Playwright's events, unlike time.sleep
        counts = self._loads.get(id(page), {"requests": 0, "ends": 0})
        deadline = time.monotonic() + self.timeouts.page_load_s
        while counts["ends"] < counts["requests"] and not self.crashed:
            if time.monotonic() > deadline:
                raise EpisodeBroken(f"the page did not finish loading within the page-load timeout of "
                                    f"{self.timeouts.page_load_s:g} s after {action}")
            page.wait_for_timeout(20)

    def _target(self, element: int) -> tuple[Any, dict]:
        """A Playwright locator for the element with AX id ``element`` in the last observation."""
        if element not in self.last_tree.nodes:
            raise ActionFailed(f"there is no element with id [{element}] in the current observation; use an id "
                               "shown in the accessibility tree")
        cdp = self._cdp_of(self.page)
        try:
            remote = cdp.send("DOM.resolveNode", {"backendNodeId": self.last_tree.backend[element]})["object"]
        except Exception:  # noqa: BLE001 - the node was removed from the page since the observation
            raise ActionFailed(f"element [{element}] is no longer on the page") from None
        token = f"t{next(_tokens)}"
        marked = cdp.send("Runtime.callFunctionOn", {"objectId": remote["objectId"], "functionDeclaration": _MARK,
                                                    "arguments": [{"value": token}], "returnByValue": True})
        info = marked.get("result", {}).get("value")
        if not info:
            raise ActionFailed(f"element [{element}] cannot be acted on (it is not part of the page's layout)")
        return self.page.locator(f'[{TARGET_ATTRIBUTE}="{token}"]').first, info

    def _do_click(self, action: Action) -> None:
        locator, info = self._target(action.element)
        if info["kind"] == "option":
            locator.select_option(value=info["value"])
        else:
            locator.click()

    def _do_hover(self, action: Action) -> None:
        self._target(action.element)[0].hover()

    def _do_type(self, action: Action) -> None:
        locator, info = self._target(action.element)
        if info["kind"] == "option":
            raise ActionFailed(f"element [{action.element}] is a list option; click it to choose it")
        locator.click()
        if info.get("editable"):
            locator.fill("")
        locator.press_sequentially(action.text)
        if action.number == 1:
            self.page.keyboard.press("Enter")

    def _do_press(self, action: Action) -> None:
        self.page.keyboard.press(action.text)

    def _do_scroll(self, action: Action) -> None:
        sign = 1 if action.text == "down" else -1
        self.page.evaluate("(sign) => window.scrollBy(0, sign * window.innerHeight * 0.8)", sign)

    def _do_new_tab(self, action: Action) -> None:
        self._adopt(self.context.new_page())

    def _do_tab_focus(self, action: Action) -> None:
        if not 0 <= action.number < len(self.pages):
            raise ActionFailed(f"there is no tab {action.number}; open tabs are 0..{len(self.pages) - 1}")
        self.page = self.pages[action.number]
        self.page.bring_to_front()

    def _do_close_tab(self, action: Action) -> None:
        closing = self.page
        self.pages.remove(closing)
        self._cdp.pop(id(closing), None)
        self._ids.pop(id(closing), None)
        closing.close()
        if self.pages:
            self.page = self.pages[-1]
            self.page.bring_to_front()
        else:
            self._adopt(self.context.new_page())

    def _do_goto(self, action: Action) -> None:
        self._navigate(self.page, action.text)

    def _do_go_back(self, action: Action) -> None:
        self.page.go_back()

    def _do_go_forward(self, action: Action) -> None:
        self.page.go_forward()

    def close(self) -> None:
        try:
            self.context.close()
        except Exception:  # noqa: BLE001 - a context of a crashed or killed browser is gone already
            pass
