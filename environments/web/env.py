"""Web navigation environments: a real Chromium, WebArena's observation and action space, three task families.

* ``webarena``: the 812 original WebArena tasks (``libwebarena``'s ``test.raw.json``) on real deployments
  addressed by URL (``sites=`` / ``WA_*`` variables), graded by WebArena's evaluators.
* ``webarena_local``: eight WebArena-format tasks on Corner Shop, a small SQLite shop the env serves itself
  on 127.0.0.1 (string, URL and program_html checks, one task behind a login).
* ``miniwob``: MiniWoB++ tasks from the ``miniwob`` package, rewarded by their own JavaScript.

Each instance owns one browser (launched at the first ``reset``) and opens a fresh browser context per
episode. A page that does not load, a crashed renderer or a browser that stops answering fails the
episode with an :class:`EpisodeFailed` naming the reason; the next ``reset`` goes on (with a new browser if
needed). An unparsable or impossible action is answered by an observation that says why.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import requests

from environments.base import EnvError, Environment, StepResult, Task, register
from environments.web import grading, prompt
from environments.web.actions import Action, ParseError, parse_action
from environments.web.browser import Browser, BrowserError
from environments.web.localshop import catalog
from environments.web.localshop.server import Shop
from environments.web.miniwob import MiniWoBTasks
from environments.web.session import ActionFailed, EpisodeBroken, Session, Timeouts
from environments.web.site_functions import SiteAccess
from environments.web.task_configs import TaskConfigs, original_tasks_path, site_url

LOCAL_TASKS = Path(__file__).resolve().parent / "localshop" / "tasks.json"
# What WebArena's prompts call its sites (its URL_MAPPINGS), shown to the agent instead of deployment URLs.
REAL_URLS = {"shopping_admin": "http://luma.com/admin", "shopping": "http://onestopmarket.com",
             "reddit": "http://reddit.com", "gitlab": "http://gitlab.com", "wikipedia": "http://wikipedia.org",
             "map": "http://openstreetmap.org", "homepage": "http://homepage.com"}
LOCAL_SHOP_URL = "http://cornershop.com"  # how Corner Shop's address on 127.0.0.1 is shown


class EpisodeFailed(EnvError):
    """The episode could not go on (page never loaded, renderer crashed, browser hung); says why."""


class WebEnv(Environment):
    """Shared episode loop; subclasses say how a task starts and how it is graded."""

    name = "web"

    def __init__(self, chromium_path: str | None = None, headless: bool = True, page_load_timeout_s: float = 30.0,
                 action_timeout_s: float = 5.0, call_timeout_s: float = 0.0, viewport_only: bool = True,
                 max_obs_tokens: int = 1920, max_steps: int = 0) -> None:
        """``call_timeout_s`` (0: page load + action + 15 s) bounds any browser call before the browser is
        killed; ``max_obs_tokens`` caps the tree (WebArena: 1920); ``max_steps`` > 0 ends and grades an episode
        after that many steps (0: the caller's horizon decides, and only ``stop`` grades)."""
        if max_obs_tokens < 50:
            raise ValueError(f"max_obs_tokens={max_obs_tokens} is too small to show a page; use >= 50 (WebArena 1920)")
        self.timeouts = Timeouts(page_load_s=page_load_timeout_s, action_s=action_timeout_s)
        self.browser = Browser(chromium_path, headless,
                               call_timeout_s or page_load_timeout_s + action_timeout_s + 15.0)
        self.viewport_only, self.max_obs_tokens, self.max_steps = viewport_only, max_obs_tokens, max_steps
        self.session: Session | None = None
        self.objective, self.previous_action, self.steps = "", "None", 0
        self._done, self._reward, self._last_observation = True, 0.0, ""
        self.task_id: int | None = None
        self._last_url = ""
        self.url_map: list[tuple[str, str]] = []  # (deployment URL, URL the agent sees), longest first

    # -- what subclasses provide ---------------------------------------------------------------------------

    def _prepare(self, task_id: int) -> dict[str, Any]:
        """Before the browser: start_url, storage_state, geolocation (raises for tasks that cannot run)."""
        raise NotImplementedError

    def _begin(self, session: Session, task_id: int) -> str:
        """On the browser thread after the start page loaded: the objective."""
        raise NotImplementedError

    def _progress(self, session: Session) -> tuple[bool, float, dict[str, Any]] | None:
        """On the browser thread after each action: (done, reward, info) when the page decides; else None."""
        return None

    def _grade(self, session: Session, answer: str) -> tuple[float, dict[str, Any]]:
        """On the browser thread at ``stop``: the reward and evaluation details."""
        raise NotImplementedError

    # -- URLs as the agent sees them -------------------------------------------------------------------

    def set_url_map(self, pairs: Mapping[str, str]) -> None:
        """Shows deployment URLs under stable names (WebArena shows e.g. ``http://gitlab.com``) and maps them
        back in ``goto``; observations then do not depend on hosts or ports."""
        self.url_map = sorted(((local.rstrip("/"), shown.rstrip("/")) for local, shown in pairs.items() if local),
                              key=lambda pair: -len(pair[0]))

    def shown(self, text: str) -> str:
        for local, shown in self.url_map:
            text = text.replace(local, shown)
        return text

    def _to_local(self, url: str) -> str:
        for local, shown in sorted(self.url_map, key=lambda pair: -len(pair[1])):
            if url == shown or url.startswith(shown + "/") or url.startswith(shown + "?"):
                return local + url[len(shown):]
        return url

    # -- the protocol ------------------------------------------------------------------------------------

    def instruction(self) -> str:
        return prompt.INSTRUCTION

    def _call(self, fn: Callable[[], Any]) -> Any:
        """A browser call; the ways an episode breaks become :class:`EpisodeFailed`."""
        try:
            return self.browser.call(fn)
        except (EpisodeBroken, BrowserError) as error:
            self._abandon()
            raise EpisodeFailed(f"web episode of task {self.task_id} failed: {error}") from None
        except Exception as error:
            if "crash" in str(error).lower() or "closed" in str(error).lower():
                self._abandon()
                raise EpisodeFailed(f"web episode of task {self.task_id} failed: {str(error).splitlines()[0]}") from None
            raise

    def _abandon(self) -> None:
        """Drops the episode's context (the browser itself is relaunched by the next reset if it died)."""
        session, self.session, self._done = self.session, None, True
        if session is not None and self.browser.alive:
            try:
                self.browser.call(session.close, timeout_s=10.0)
            except Exception:  # noqa: BLE001 - the browser was killed; its contexts went with it
                pass

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        spec = self._prepare(task_id)
        self._abandon()
        self.task_id, self.steps, self.previous_action = task_id, 0, "None"
        self._done, self._reward = False, 0.0
        self.browser.launch()
        self.browser.crash_reason = None

        def start() -> tuple[Session, str]:
            session = Session(self.browser.browser, self.timeouts, self.viewport_only, self.max_obs_tokens,
                              spec.get("storage_state"), spec.get("geolocation"), self.browser.report_crash)
            self.session = session
            session.open(spec["start_url"])
            return session, self._begin(session, task_id)

        self.session, self.objective = self._call(start)
        observation = self._observe()
        return observation, {"task_id": task_id, "objective": self.objective, "url": self._last_url}

    def _observe(self, note: str = "") -> str:
        def look() -> tuple[str, str, str]:
            tree = self.session.observe()
            return self.session.tab_titles(), tree.text, self.session.url()

        tabs, tree, url = self._call(look)
        self._last_url = self.shown(url)
        self._last_observation = self.shown(
            prompt.observation(tabs, tree, url, self.objective, self.previous_action, note))
        return self._last_observation

    def step(self, action_text: str) -> StepResult:
        if self.session is None or self._done:
            raise EnvError("the web episode is over (or was never started); call reset(task_id) first")
        self.steps += 1
        note, action, info = "", None, {}
        try:
            action = parse_action(action_text)
        except ParseError as error:
            note = str(error)
        if action is not None and action.name == "stop":
            return self._finish(action.text, action, {})
        if action is not None:
            target = dataclasses.replace(action, text=self._to_local(action.text)) if action.name == "goto" else action
            try:
                self._call(lambda: self.session.execute(target))
            except ActionFailed as error:
                note = f"The action {action} could not be performed: {error}"
            self.previous_action = str(action) + (" (failed)" if note else "")
            decided = self._call(lambda: self._progress(self.session))
            if decided is not None and decided[0]:
                return self._finish("", action, decided[2], reward=decided[1])
        if self.max_steps and self.steps >= self.max_steps:
            return self._finish("", action, {"step_limit": self.max_steps})
        observation = self._observe(note)
        info.update({"action": str(action) if action else None, "action_valid": action is not None and not note,
                     "url": self._last_url, "success": False})
        return StepResult(observation, 0.0, False, info)

    def _finish(self, answer: str, action: Action | None, info: dict[str, Any],
                reward: float | None = None) -> StepResult:
        """Ends the episode: grades it (unless the page already did) and returns the final step."""
        if reward is None:
            reward, details = self._call(lambda: self._grade(self.session, answer))
            info["evaluation"] = details
        self._done, self._reward = True, float(reward)
        if action is not None:
            self.previous_action = str(action)
        info.update({"action": str(action) if action else None, "action_valid": action is not None,
                     "answer": answer, "success": self._reward >= 1.0, "url": self._last_url})
        return StepResult(f"The episode is over. Final answer: {answer or '(none)'}", self._reward, True, info)

    def end_episode(self) -> None:
        self._abandon()

    def close(self) -> None:
        self._abandon()
        self.browser.close()


class _WebArenaFormat(WebEnv):
    """Tasks in WebArena's JSON format, graded by WebArena's evaluators."""

    def __init__(self, configs: TaskConfigs, judge_url: str | None = None, judge_model: str = "gpt-4-1106-preview",
                 judge_api_key_env: str = "OPENAI_API_KEY", shopping_admin_user: str = "admin",
                 shopping_admin_password: str = "admin1234", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.configs = configs
        self.judge = grading.judge_from(judge_url, judge_model, judge_api_key_env)
        self._admin = (shopping_admin_user, shopping_admin_password)
        self.config: dict[str, Any] = {}

    def tasks(self, split: str) -> Sequence[Task]:
        return self.configs.tasks(split)

    def task_details(self, task_id: int) -> dict[str, Any]:
        config = self.configs.raw(task_id)
        return {"intent": config["intent"], "sites": config.get("sites"), "eval_types": config["eval"]["eval_types"]}

    def _prepare(self, task_id: int) -> dict[str, Any]:
        config = self.configs.resolved(task_id)
        grading.check_gradable(config, self.judge)
        self.config = config
        return config

    def _begin(self, session: Session, task_id: int) -> str:
        return str(self.config["intent"])

    def _grade(self, session: Session, answer: str) -> tuple[float, dict[str, Any]]:
        access = SiteAccess(site_url("shopping", self.configs.sites) or "", *self._admin)
        verdict = grading.grade(session.page, self.config, answer, self.judge, access, self.timeouts.page_load_s)
        return verdict.score, verdict.details


@register("webarena")
class WebArena(_WebArenaFormat):
    """The 812 WebArena tasks against deployments given by URL (``sites=`` or ``WA_SHOPPING`` ...)."""

    name = "webarena"

    def __init__(self, config_file: str | None = None, sites: Mapping[str, str] | None = None,
                 auth_dir: str | None = None, show_real_urls: bool = True, **kwargs: Any) -> None:
        """``show_real_urls``: the agent sees WebArena's public names (``http://gitlab.com`` ...) instead of
        the deployment's URLs, as in the original's prompts."""
        super().__init__(TaskConfigs(config_file or original_tasks_path(), sites, auth_dir), **kwargs)
        if show_real_urls:
            self.set_url_map({site_url(site, self.configs.sites) or "": shown for site, shown in REAL_URLS.items()})


@register("webarena_local")
class WebArenaLocal(_WebArenaFormat):
    """WebArena-format tasks on Corner Shop, served by this instance; the shop's data is reset every episode."""

    name = "webarena_local"

    def __init__(self, **kwargs: Any) -> None:
        self.shop = Shop()
        self._auth = tempfile.TemporaryDirectory(prefix="agentgym-localshop-auth-")
        super().__init__(TaskConfigs(LOCAL_TASKS, {"localshop": self.shop.url}, self._auth.name), **kwargs)
        self.set_url_map({self.shop.url: LOCAL_SHOP_URL})
        self._login_state = Path(self._auth.name) / "localshop_state.json"

    def _log_in(self) -> None:
        """WebArena's auto-login for Corner Shop: signs in over HTTP and saves the cookies as storage state."""
        session = requests.Session()
        response = session.post(f"{self.shop.url}/login", allow_redirects=False, timeout=10,
                                data={k: catalog.CUSTOMER[k] for k in ("username", "password")})
        if "session" not in session.cookies:
            raise EnvError(f"Corner Shop login failed (HTTP {response.status_code})")
        cookies = [{"name": c.name, "value": c.value, "domain": "127.0.0.1", "path": "/", "expires": -1,
                    "httpOnly": False, "secure": False, "sameSite": "Lax"} for c in session.cookies]
        self._login_state.write_text(json.dumps({"cookies": cookies, "origins": []}))

    def _prepare(self, task_id: int) -> dict[str, Any]:
        self.configs.raw(task_id)  # a clear error for a bad id before touching the shop
        if not self._login_state.exists():
            self._log_in()
        self.shop.reset()
        return super()._prepare(task_id)

    def close(self) -> None:
        super().close()
        if self._auth is not None:
            self.shop.close()
            self._auth.cleanup()
            self._auth = None


@register("miniwob")
class MiniWoB(WebEnv):
    """MiniWoB++ tasks (``tasks=`` a subset of names) served from the ``miniwob`` package's files."""

    name = "miniwob"

    def __init__(self, tasks: Sequence[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("page_load_timeout_s", 15.0)
        super().__init__(**kwargs)
        self.family = MiniWoBTasks(tasks)

    def tasks(self, split: str) -> Sequence[Task]:
        return self.family.tasks(split)

    def task_details(self, task_id: int) -> dict[str, Any]:
        name, seed = self.family.locate(task_id)
        return {"task": name, "seed": seed}

    def _prepare(self, task_id: int) -> dict[str, Any]:
        return {"start_url": self.family.start_url(task_id)}

    def _begin(self, session: Session, task_id: int) -> str:
        return self.family.begin(session.page, task_id)

    def _progress(self, session: Session) -> tuple[bool, float, dict[str, Any]] | None:
        state = self.family.state(session.page)
        if not state["done"]:
            return None
        return True, max(0.0, float(state["raw"])), {"miniwob": state}

    def _grade(self, session: Session, answer: str) -> tuple[float, dict[str, Any]]:
        state = self.family.state(session.page)
        return (max(0.0, float(state["raw"])) if state["done"] else 0.0), {"miniwob": state}
