"""The original's question sets: FlashRAG's QA files on disk, with the original's item-id ranges.

``flashrag_dir`` holds FlashRAG's layout, ``<dir>/<dataset>/<split>.jsonl`` with rows
``{"id", "question", "golden_answers": [...]}`` (the ``RUC-NLPIR/FlashRAG_datasets`` repository). The test
split takes each dataset's ``test`` file, else ``dev``, else ``train`` (as the original's preprocessing), the
train split takes the ``train`` files of nq and hotpotqa. Item ids are the original's: test 0-51712, train
51713-221327, each dataset in its own range, rows numbered from the range's start.
"""

from __future__ import annotations

import json
from pathlib import Path

from environments.base import EnvError
from environments.searchqa.knowledge import Question

# (split, dataset, first item id, number of items), in the original's order.
ITEM_RANGES = (
    ("test", "nq", 0, 3610), ("test", "triviaqa", 3610, 11313), ("test", "popqa", 14923, 14267),
    ("test", "hotpotqa", 29190, 7405), ("test", "2wikimultihopqa", 36595, 12576), ("test", "musique", 49171, 2417),
    ("test", "bamboogle", 51588, 125), ("train", "nq", 51713, 79168), ("train", "hotpotqa", 130881, 90447),
)
_SOURCE = "the RUC-NLPIR/FlashRAG_datasets repository"


def _split_file(root: Path, dataset: str, split: str) -> Path:
    choices = ("test", "dev", "train") if split == "test" else ("train",)
    for name in choices:
        path = root / dataset / f"{name}.jsonl"
        if path.is_file():
            return path
    wanted = " or ".join(f"{dataset}/{name}.jsonl" for name in choices)
    raise EnvError(f"{root} has no {wanted}; download {dataset} from {_SOURCE} into {root}/{dataset}/, "
                   f"or leave it out with datasets=(...)")


def load_flashrag(flashrag_dir: str | Path, datasets: tuple[str, ...] = ()) -> list[Question]:
    """The questions of the chosen datasets (default: all of the original's) with the original's item ids."""
    root = Path(flashrag_dir)
    if not root.is_dir():
        raise EnvError(f"flashrag_dir={str(root)!r} is not a directory; it should hold FlashRAG's "
                       f"<dataset>/<split>.jsonl files from {_SOURCE}")
    known = {name for _, name, _, _ in ITEM_RANGES}
    unknown = sorted(set(datasets) - known)
    if unknown:
        raise EnvError(f"unknown FlashRAG datasets {unknown}; the original uses {sorted(known)}")
    questions = []
    for split, dataset, first_id, count in ITEM_RANGES:
        if datasets and dataset not in datasets:
            continue
        path = _split_file(root, dataset, split)
        with path.open(encoding="utf-8") as lines:
            rows = [line for line in lines if line.strip()]
        if len(rows) > count:
            raise EnvError(f"{path} has {len(rows)} rows but the original's item-id range for {split} {dataset} "
                           f"holds {count}; is it the FlashRAG release the original used?")
        for offset, line in enumerate(rows):
            try:
                row = json.loads(line)
                answers = tuple(str(a) for a in row["golden_answers"])
                question = str(row["question"]).strip()
            except (ValueError, KeyError, TypeError) as error:
                raise EnvError(f"{path}:{offset + 1}: not a FlashRAG QA row ({error!r})") from None
            questions.append(Question(first_id + offset, question, answers, split, dataset))
    return questions
