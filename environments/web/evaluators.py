"""WebArena's evaluators: string match, URL match and program_html, multiplied as ``evaluator_router`` does.

* ``string_match``: ``exact_match`` (cleaned strings equal), ``must_include`` (every item a substring; a single
  one-word item must be a whole word of the answer, as the original's tokenized check), ``fuzzy_match`` (each
  reference judged by an LLM; ``"N/A"`` first tries an exact match). Cleaning: strip, drop one pair of
  surrounding quotes, lowercase.
* ``url_match`` ("GOLD in PRED"): some reference's host+path is a substring of the final URL's, and every query
  parameter of the references has one of its values in the final URL.
* ``program_html``: for each check, open its url (``last``: stay), read the locator, and compare with
  ``required_contents`` (``exact_match`` or ``must_include``, items may hold `` |OR| `` alternatives).

The fuzzy judge is optional; with none configured, a fuzzy check raises :class:`JudgeUnavailable`, so no
answer silently passes or fails.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any, Callable, Mapping
from urllib.parse import parse_qs, urlparse

import requests

JUDGE_PROMPT = ("You grade a student's answer against a reference answer. The student may phrase it "
                "differently; decide whether the meaning is the same.\nquestion: {question}\nreference answer: "
                "{reference}\nThe string 'N/A' means 'not achievable'.\nstudent answer: {answer}\nEnd your reply "
                "with one verdict: correct, incorrect, or partially correct.")
UA_PROMPT = ("A task was judged not achievable for this reason: {reason}\nThe agent stopped with this "
             "answer: {answer}\nDoes the agent's answer say the task cannot be done for the same reason? "
             "Reply 'same' or 'different'.\ntask: {question}")


class JudgeUnavailable(RuntimeError):
    """A fuzzy_match check needs an LLM judge and none is configured (or it failed)."""


@dataclasses.dataclass
class Judge:
    """An OpenAI-compatible chat-completions endpoint, e.g. ``http://host:8000/v1/chat/completions``."""

    url: str
    model: str = "gpt-4-1106-preview"
    api_key: str = ""
    timeout_s: float = 60.0

    def ask(self, prompt: str) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "temperature": 0, "max_tokens": 768,
                "messages": [{"role": "system", "content": "You are a helpful assistant"},
                             {"role": "user", "content": prompt}]}
        try:
            response = requests.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
            response.raise_for_status()
            return str(response.json()["choices"][0]["message"]["content"]).lower()
        except (requests.RequestException, KeyError, IndexError, ValueError) as error:
            raise JudgeUnavailable(f"the fuzzy_match judge at {self.url} failed ({error})") from None


def clean(text: Any) -> str:
    text = str(text).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text.lower()


def exact_match(reference: Any, answer: Any) -> float:
    return float(clean(reference) == clean(answer))


def must_include(reference: str, answer: str, whole_word: bool = False) -> float:
    ref, ans = clean(reference), clean(answer)
    if whole_word and len(re.findall(r"\w+|[^\w\s]", ref)) == 1:
        return float(ref in re.findall(r"\w+|[^\w\s]", ans))
    return float(ref in ans)


def string_score(answers: Mapping[str, Any], answer: str, intent: str, string_note: str, judge: Judge | None) -> float:
    """The product of the string checks of ``reference_answers``."""
    score = 1.0
    for kind, value in answers.items():
        if kind == "exact_match":
            score *= exact_match(value, answer)
        elif kind == "must_include":
            items = value if isinstance(value, list) else [value]
            for item in items:
                score *= must_include(item, answer, whole_word=len(items) == 1)
        elif kind == "fuzzy_match":
            score *= _fuzzy(value, answer, intent, string_note, judge)
        else:
            raise ValueError(f"unknown reference_answers kind {kind!r}; expected exact_match, must_include or "
                             "fuzzy_match")
    return score


def _fuzzy(value: Any, answer: str, intent: str, string_note: str, judge: Judge | None) -> float:
    if value == "N/A":
        if exact_match("N/A", answer):
            return 1.0
        if judge is None:
            raise JudgeUnavailable("this task is not achievable and the answer is not 'N/A': judging whether it "
                                   "gives the same reason needs a judge (judge_url=...)")
        verdict = judge.ask(UA_PROMPT.format(reason=string_note, answer=answer, question=intent))
        return float("same" in verdict and "different" not in verdict)
    if judge is None:
        raise JudgeUnavailable("fuzzy_match needs an LLM judge: pass judge_url= (an OpenAI-compatible "
                               "chat-completions URL) or set WEBARENA_JUDGE_URL")
    score = 1.0
    for reference in value if isinstance(value, list) else [value]:
        verdict = judge.ask(JUDGE_PROMPT.format(question=intent, reference=reference, answer=answer))
        score *= float("correct" in verdict and "incorrect" not in verdict and "partially" not in verdict)
    return score


def _host_path_and_query(url: str) -> tuple[str, dict[str, list[str]]]:
    parsed = urlparse(url.rstrip("/"))
    return parsed.netloc + parsed.path, parse_qs(parsed.query)


def url_score(reference_url: str, final_url: str, rule: str | None = "GOLD in PRED") -> float:
    """WebArena's URL match of the page's final URL against `` |OR| ``-separated references."""
    if rule not in (None, "GOLD in PRED"):
        raise ValueError(f"unknown url_note {rule!r}; only 'GOLD in PRED' is defined")
    references = [_host_path_and_query(url) for url in reference_url.split(" |OR| ")]
    predicted_path, predicted_query = _host_path_and_query(final_url)
    wanted: dict[str, set[str]] = defaultdict(set)
    for _, query in references:
        for key, values in query.items():
            wanted[key].update(values)
    base = float(any(path in predicted_path for path, _ in references))
    query = 1.0
    for key, values in wanted.items():
        query *= float(any(value in predicted_query.get(key, []) for value in values))
    return base * query


def contents_score(required: Mapping[str, Any], found: str) -> float:
    """``required_contents`` of one program_html check against the text its locator read."""
    score = 1.0
    for kind, value in required.items():
        if kind == "exact_match":
            score *= exact_match(value, found)
        elif kind == "must_include":
            for item in value if isinstance(value, list) else [value]:
                score *= float(any(must_include(option, found) for option in str(item).split(" |OR| ")))
        else:
            raise ValueError(f"unknown required_contents kind {kind!r}; expected exact_match or must_include")
    return score


@dataclasses.dataclass
class Verdict:
    """An evaluation: the score (0/1 product) and per-check details for logging."""

    score: float
    details: dict[str, Any]


def evaluate(config: Mapping[str, Any], answer: str, final_url: str, read_html: Callable[[dict], str],
             judge: Judge | None) -> Verdict:
    """Runs every ``eval_types`` entry; ``read_html(check)`` returns the text one program_html check reads."""
    spec = config["eval"]
    score, details = 1.0, {}
    for kind in spec["eval_types"]:
        if kind == "string_match":
            part = string_score(spec["reference_answers"], answer, config.get("intent", ""),
                                spec.get("string_note", ""), judge)
        elif kind == "url_match":
            part = url_score(spec["reference_url"], final_url, spec.get("url_note"))
        elif kind == "program_html":
            part = 1.0
            for index, check in enumerate(spec["program_html"]):
                found = read_html(check)
                ok = contents_score(check["required_contents"], found)
                details[f"program_html[{index}]"] = {"read": found[:200], "score": ok}
                part *= ok
        else:
            raise ValueError(f"unknown eval_types entry {kind!r}; expected string_match, url_match, program_html")
        details[kind] = part
        score *= part
    return Verdict(score, details)
