"""SearchQA (Deep Search): answer a question by searching a corpus, as AgentGym's searchqa and Search-R1.

Each turn the agent writes ``<search>query</search>`` or ``<answer>text</answer>`` (the first of either tag in
the turn decides; an answer is read from the turn's last ``<answer>``). A search returns the top-k passages
(default 3) as ``<information>Doc 1(Title: ...) ...</information>``. An answer is scored by exact match after
normalization against every gold answer: right ends the episode with reward 1; wrong is not terminal, the agent
is told so and may go on. A turn with neither tag gets the format hint. ``info`` carries EM, F1, the retrieved
doc ids and, for a search that could not be served, the reason (the episode goes on).

Questions: the generated set (``dataset="generated"``, built into the cache, see ``dataset.py``) or the
original's FlashRAG files (``dataset="flashrag", flashrag_dir=...``), or either converted to one ArrayRecord file
(``dataset="records", questions_path=...``, see ``question_records.py``: a worker reads a question when it plays
it). Retrieval: ``retriever="bm25"`` (default;
``index_dir`` or the generated set's index), ``"dense"`` (``dense_index``, ``dense_corpus``, ``dense_encoder``) or
``"http"`` (``retriever_url``, a Search-R1 ``/retrieve`` server).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from environments.base import EnvError, Environment, StepResult, Task, register
from environments.searchqa.answers import exact_match, f1_score
from environments.searchqa.retrieval import RetrievalError, Retriever, format_information, make_retriever

MAX_QUERY_CHARS = 1000
_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

INSTRUCTION = """You answer questions by searching an encyclopedia. Think step by step inside <think> and </think>. When you need a fact, search for it by writing a short query between <search> and </search>, then stop and wait: the top results come back between <information> and </information>. Search as often as you need. When you know the answer, write it between <answer> and </answer>, short and without explanation, for example <answer> Beijing </answer>."""

INVALID_FORMAT = ("Your previous action is invalid. To search, put a query between <search> and </search>. "
                  "To answer, put the answer between <answer> and </answer>. Please try again.")
CORRECT = "Congratulations! Your answer is correct."
WRONG = "Sorry, your answer is incorrect. You may search again or give another answer."


@register("searchqa")
class SearchQA(Environment):
    """Search-and-answer episodes over a question set and a retriever."""

    name = "searchqa"

    def __init__(self, dataset: str = "generated", seed: int = 0, flashrag_dir: str = "",
                 flashrag_datasets: Sequence[str] = (), retriever: str = "", index_dir: str = "",
                 retriever_url: str = "", dense_index: str = "", dense_corpus: str = "", dense_encoder: str = "",
                 top_k: int = 3, questions_path: str = "") -> None:
        from environments.searchqa import dataset as datasets

        if int(top_k) < 1:
            raise EnvError(f"top_k must be >= 1, got {top_k}")
        self.top_k = int(top_k)
        if dataset == "generated":
            directory = datasets.prepare_generated(int(seed))
            self.questions = datasets.QuestionSet(datasets.read_questions(directory / "questions.jsonl"),
                                                  f"the generated set {directory}")
            index_dir = index_dir or str(directory / "bm25")
        elif dataset == "flashrag":
            from environments.searchqa.flashrag import load_flashrag

            if not flashrag_dir:
                raise EnvError("dataset='flashrag' needs flashrag_dir=<directory of FlashRAG's QA files>")
            self.questions = datasets.QuestionSet(load_flashrag(flashrag_dir, tuple(flashrag_datasets)),
                                                  f"FlashRAG files in {flashrag_dir}")
        elif dataset == "records":  # an ArrayRecord question file (question_records.py): read per question
            from environments.searchqa.question_records import QuestionRecords

            if not questions_path:
                raise EnvError("dataset='records' needs questions_path=<file written by "
                               "`python -m environments.searchqa.question_records`>")
            self.questions = QuestionRecords(questions_path)
        else:
            raise EnvError(f"unknown searchqa dataset {dataset!r}; use 'generated', 'flashrag' or 'records'")
        self._retriever_spec = _retriever_spec(retriever, index_dir, retriever_url, dense_index, dense_corpus,
                                               dense_encoder)
        self._retriever: Retriever | None = None
        self.question = None
        self._done = False
        self._reward = 0.0

    def instruction(self) -> str:
        return INSTRUCTION

    def tasks(self, split: str) -> Sequence[Task]:
        return self.questions.tasks(split)

    def task_details(self, task_id: int) -> dict[str, Any]:
        question = self.questions[task_id]
        return {"question": question.question, "golden_answers": list(question.golden_answers)}

    @property
    def retriever(self) -> Retriever:
        if self._retriever is None:
            name, options = self._retriever_spec
            self._retriever = make_retriever(name, **options)
        return self._retriever

    def reset(self, task_id: int) -> tuple[str, dict[str, Any]]:
        self.question = self.questions[task_id]
        self._done, self._reward = False, 0.0
        self.retriever  # opened on the first episode (not at construction: a worker may only describe the env)
        info = {"task_id": task_id, "subtask": self.question.subtask, "split": self.question.split}
        return f"Question: {self.question.question}", info

    def step(self, action_text: str) -> StepResult:
        if self.question is None:
            raise RuntimeError("SearchQA.step called before reset; call reset(task_id) first")
        match = _TAG.search(action_text)
        if match is None:
            return self._result(INVALID_FORMAT, {"action": None, "action_valid": False})
        if match.group(1) == "answer":
            answer = _ANSWER.findall(action_text)[-1].strip()
            em = exact_match(answer, self.question.golden_answers)
            self._reward, self._done = em, em >= 1.0
            info = {"action": "answer", "action_valid": True, "answer": answer, "em": em,
                    "f1": f1_score(answer, self.question.golden_answers)}
            return self._result(CORRECT if self._done else WRONG, info)
        return self._search(match.group(2).strip())

    def _search(self, query: str) -> StepResult:
        info: dict[str, Any] = {"action": "search", "query": query[:200], "action_valid": False}
        if not query:
            return self._result("Your search query is empty. Put a few words between <search> and </search>.", info)
        if len(query) > MAX_QUERY_CHARS:
            return self._result(f"Your search query is too long ({len(query)} characters; the limit is "
                                f"{MAX_QUERY_CHARS}). Search with a few keywords.", info)
        try:
            hits = self.retriever.search([query], self.top_k)[0]
        except RetrievalError as error:
            info["search_error"] = str(error)
            return self._result("The search engine is unavailable right now, so this search returned nothing. "
                                "You may search again or answer.", info)
        info.update(action_valid=True, retrieved_doc_ids=[hit.passage.doc_id for hit in hits])
        if not hits:
            return self._result("<information>No results.</information>", info)
        return self._result(format_information(hits), info)

    def _result(self, observation: str, info: dict[str, Any]) -> StepResult:
        info["success"] = self._done
        return StepResult(observation, self._reward, self._done, info)

    def close(self) -> None:
        if self._retriever is not None:
            self._retriever.close()
            self._retriever = None
        self.questions.close()


def _retriever_spec(name: str, index_dir: str, url: str, dense_index: str, dense_corpus: str,
                    dense_encoder: str) -> tuple[str, dict[str, Any]]:
    """Which retriever the env builds (lazily, on the first search), from its flat keyword arguments."""
    name = name or ("http" if url else "dense" if dense_index else "bm25")
    if name == "bm25":
        if not index_dir:
            raise EnvError("retriever='bm25' needs index_dir=<a bm25 index built by environments.searchqa.build>")
        return name, {"index_dir": index_dir}
    if name == "http":
        if not url:
            raise EnvError("retriever='http' needs retriever_url=http://host:port (a Search-R1 /retrieve server)")
        return name, {"url": url}
    if name == "dense":
        missing = [key for key, value in (("dense_index", dense_index), ("dense_corpus", dense_corpus),
                                          ("dense_encoder", dense_encoder)) if not value]
        if missing:
            raise EnvError(f"retriever='dense' needs {', '.join(missing)} (FAISS index, wiki-18 corpus, e5 encoder)")
        return name, {"index_path": dense_index, "corpus_path": dense_corpus, "encoder_path": dense_encoder}
    raise EnvError(f"unknown retriever {name!r}; use 'bm25', 'dense' or 'http'")
