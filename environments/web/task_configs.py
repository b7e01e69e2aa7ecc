"""WebArena task configs: loading the 812 originals, splitting them, resolving site placeholders and login state.

The originals are ``test.raw.json`` of the PyPI package ``libwebarena`` 0.0.5 (installed without its
dependencies by ``make setup``; only the data file is read). Site placeholders such as ``__SHOPPING__`` or
``__GITLAB__`` are replaced by the deployment's URL, taken from ``sites={"gitlab": "http://host:8023"}`` or
the environment variables ``WA_GITLAB`` / ``GITLAB`` (BrowserGym's and WebArena's names). Login state:
``storage_state: ./.auth/<site>_state.json`` is looked up in ``auth_dir`` (or ``$WEBARENA_AUTH_DIR``), the
directory WebArena's ``auto_login.py`` writes.

Splits: whole intent templates are held out, so a test intent is never a rewording of a train intent: a task
is in ``test`` when ``intent_template_id % 5 == 2`` (about a fifth), unless its config names a ``split``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from environments.base import EnvError, InvalidTaskError, Task, check_split

PLACEHOLDER = re.compile(r"__([A-Z][A-Z_]*[A-Z])__")
TEST_TEMPLATE_EVERY, TEST_TEMPLATE_REMAINDER = 5, 2


class SiteNotConfigured(EnvError):
    """A task needs a site (or login state) whose URL (or file) is not configured."""


def original_tasks_path() -> Path:
    """``test.raw.json`` inside the installed ``libwebarena`` package."""
    spec = importlib.util.find_spec("webarena")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / "test.raw.json"
        if path.is_file():
            return path
    raise EnvError("WebArena's task configs are not installed: run `make setup` (or `pip install --no-deps "
                   "libwebarena==0.0.5`), or pass config_file= to a test.raw.json")


@functools.lru_cache(maxsize=8)
def load_configs(path: str) -> tuple[dict[str, Any], ...]:
    """Task configs of a JSON file (a list of configs, or one config), checked for the keys the env uses."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise EnvError(f"cannot read WebArena task configs from {path}: {error}") from None
    configs = data if isinstance(data, list) else [data]
    for index, config in enumerate(configs):
        missing = [key for key in ("task_id", "start_url", "intent", "eval") if key not in config]
        if missing or "eval_types" not in config.get("eval", {}):
            raise EnvError(f"task config #{index} in {path} lacks {missing or ['eval.eval_types']}; see WebArena's "
                           "config_files/examples/1.json for the format")
    return tuple(sorted(configs, key=lambda c: int(c["task_id"])))


def split_of(config: Mapping[str, Any]) -> str:
    if config.get("split") in ("train", "test"):
        return config["split"]
    template = int(config.get("intent_template_id", config["task_id"]))
    return "test" if template % TEST_TEMPLATE_EVERY == TEST_TEMPLATE_REMAINDER else "train"


def site_url(site: str, sites: Mapping[str, str]) -> str | None:
    """The configured URL of ``site`` (``shopping_admin`` ...), without a trailing slash, or None."""
    url = sites.get(site) or os.environ.get(f"WA_{site.upper()}") or os.environ.get(site.upper())
    return url.rstrip("/") if url else None


def resolve(value: Any, sites: Mapping[str, str], task_id: int) -> Any:
    """``value`` with every ``__SITE__`` placeholder (in strings, lists and dicts) replaced by the site's URL."""
    if isinstance(value, str):
        def replace(match: re.Match) -> str:
            site = match.group(1).lower()
            url = site_url(site, sites)
            if url is None:
                raise SiteNotConfigured(
                    f"task {task_id} needs the {site!r} site: set WA_{site.upper()}=http://host:port or pass "
                    f"sites={{{site!r}: 'http://host:port'}} (the WebArena deployment's URL)")
            return url
        return PLACEHOLDER.sub(replace, value)
    if isinstance(value, list):
        return [resolve(item, sites, task_id) for item in value]
    if isinstance(value, dict):
        return {key: resolve(item, sites, task_id) for key, item in value.items()}
    return value


def storage_state_file(config: Mapping[str, Any], auth_dir: str | None) -> str | None:
    """The login state file of a task, or None when it needs none."""
    state = config.get("storage_state")
    if not state:
        return None
    directory = auth_dir or os.environ.get("WEBARENA_AUTH_DIR")
    path = Path(directory) / Path(state).name if directory else Path(state)
    if not path.is_file():
        raise SiteNotConfigured(
            f"task {config['task_id']} needs the login state {state}: pass auth_dir= (or set WEBARENA_AUTH_DIR) to "
            "the directory WebArena's browser_env/auto_login.py wrote")
    return str(path)


class TaskConfigs:
    """A list of WebArena-format configs with task ids, splits and resolution against a deployment."""

    def __init__(self, path: str | os.PathLike, sites: Mapping[str, str] | None = None,
                 auth_dir: str | None = None) -> None:
        self.path = str(path)
        self.configs = load_configs(self.path)
        self.by_id = {int(c["task_id"]): c for c in self.configs}
        self.sites = dict(sites or {})
        self.auth_dir = auth_dir

    def tasks(self, split: str) -> Sequence[Task]:
        check_split(split)
        return [Task(int(c["task_id"]), split, "+".join(c.get("sites") or ["unknown"]))
                for c in self.configs if split_of(c) == split]

    def raw(self, task_id: int) -> Mapping[str, Any]:
        if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id not in self.by_id:
            ids = sorted(self.by_id)
            raise InvalidTaskError(f"web task id {task_id!r} is not in {self.path} (ids {ids[0]}..{ids[-1]})")
        return self.by_id[task_id]

    def resolved(self, task_id: int) -> dict[str, Any]:
        """The config with its sites' URLs filled in and ``storage_state`` pointing at an existing file."""
        config = self.raw(task_id)
        resolved = resolve({k: v for k, v in config.items() if k != "storage_state"}, self.sites, task_id)
        resolved["storage_state"] = storage_state_file(config, self.auth_dir)
        return resolved
