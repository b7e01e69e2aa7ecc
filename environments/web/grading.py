"""Grading a WebArena-format episode in its browser: the answer, the final URL and the program_html checks.

Runs on the browser thread at ``stop`` (or at the env's step limit). A program_html check first opens its url
(``last``: the page the agent left; ``func:...``: computed, see ``site_functions``; otherwise the resolved
URL), then reads its locator with the fixed interpreter of ``program_html``. A locator that throws in the page
(e.g. its element is missing) reads as "", as in WebArena.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import requests

from environments.base import EnvError
from environments.web import evaluators, program_html, site_functions


class EvaluationUnavailable(EnvError):
    """The episode cannot be graded (no fuzzy judge, a site helper that failed); the message says why."""


def judge_from(url: str | None, model: str, api_key_env: str) -> evaluators.Judge | None:
    """The configured fuzzy_match judge (``url`` or ``$WEBARENA_JUDGE_URL``), or None."""
    url = url or os.environ.get("WEBARENA_JUDGE_URL")
    if not url:
        return None
    return evaluators.Judge(url=url, model=model, api_key=os.environ.get(api_key_env, ""))


def needs_judge(config: Mapping[str, Any]) -> bool:
    """Whether grading this task always needs the LLM judge (fuzzy_match other than "N/A")."""
    spec = config["eval"]
    answers = spec.get("reference_answers") or {}
    return "string_match" in spec["eval_types"] and "fuzzy_match" in answers and answers["fuzzy_match"] != "N/A"


def check_gradable(config: Mapping[str, Any], judge: evaluators.Judge | None) -> None:
    """Raises before the episode starts when the task could only be graded by a judge that is not there."""
    if judge is None and needs_judge(config):
        raise EvaluationUnavailable(
            f"task {config['task_id']} is graded by fuzzy_match, which needs an LLM judge: pass judge_url= (an "
            "OpenAI-compatible chat-completions URL) or set WEBARENA_JUDGE_URL, or leave this task out")


def _read(page: Any, check: Mapping[str, Any], access: site_functions.SiteAccess, load_timeout_ms: float) -> str:
    url = str(check.get("url") or "last")
    if url.startswith("func:"):
        url = site_functions.url_function(url, page.url, access)
    if url != "last":
        page.goto(url, wait_until="load", timeout=load_timeout_ms)
    locator = str(check.get("locator") or "")
    if locator.startswith("func:"):
        return site_functions.locator_function(locator, page.evaluate, access)
    if not locator.strip():
        return page.content()
    terms = program_html.parse_locator(locator)
    try:
        return str(page.evaluate(program_html.INTERPRETER, terms))
    except Exception as error:  # noqa: BLE001 - a query that throws in the page reads as ""
        if "crash" in str(error).lower():
            raise
        return ""


def grade(page: Any, config: Mapping[str, Any], answer: str, judge: evaluators.Judge | None,
          access: site_functions.SiteAccess, load_timeout_s: float) -> evaluators.Verdict:
    """The task's verdict for the episode that ended on ``page`` with ``answer``."""
    final_url = page.url

    def read(check: dict) -> str:
        return _read(page, check, access, load_timeout_s * 1000)

    try:
        return evaluators.evaluate(config, answer, final_url, read, judge)
    except (evaluators.JudgeUnavailable, site_functions.FunctionError, program_html.LocatorError,
            requests.RequestException) as error:
        raise EvaluationUnavailable(f"task {config['task_id']} cannot be graded: {error}") from None
