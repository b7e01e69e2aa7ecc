"""Answer scoring as the original does it: normalize, then exact match (the reward) and token F1 (reported).

Normalization: lower-case, punctuation removed, the articles a/an/the removed, whitespace collapsed.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """``"The  Euro!"`` -> ``"euro"``."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold_answers: Sequence[str]) -> float:
    """1.0 when the normalized prediction equals any normalized gold answer, else 0.0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(gold) for gold in gold_answers))


def f1_score(prediction: str, gold_answers: Sequence[str]) -> float:
    """The best token-overlap F1 between the normalized prediction and any gold answer."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for gold in gold_answers:
        reference = normalize_answer(gold).split()
        common = sum((collections.Counter(predicted) & collections.Counter(reference)).values())
        if common:
            precision, recall = common / len(predicted), common / len(reference)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
