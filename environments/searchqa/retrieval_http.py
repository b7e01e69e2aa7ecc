"""Search-R1's retrieval protocol, both sides: a server for any of our retrievers and a client retriever.

    POST /retrieve {"queries": ["..."], "topk": 3, "return_scores": true}
    -> {"result": [[{"document": {"id": "...", "contents": "\\"Title\\"\\ntext"}, "score": 12.3}, ...], ...]}

Without ``return_scores`` each hit is the bare document ``{"id", "contents"}`` (as Search-R1 answers). So our
env can use a Search-R1 server by URL, and Search-R1's rollout can use ours.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import pydantic
import requests

from environments.searchqa.corpus import Passage
from environments.searchqa.retrieval import Hit, RetrievalError, Retriever, register_retriever

MAX_QUERIES_PER_REQUEST = 512
MAX_QUERY_CHARS = 4096
MAX_TOPK = 100


class RetrieveBody(pydantic.BaseModel):
    """Search-R1's request body."""

    queries: list[str]
    topk: int | None = 3
    return_scores: bool = False


def build_retrieval_app(retriever: Retriever, name: str = "bm25") -> Any:
    """A FastAPI app answering Search-R1 ``/retrieve`` requests with ``retriever``."""
    import fastapi

    app = fastapi.FastAPI(title=f"agentgym-jax {name} retriever")

    @app.get("/")
    def hello() -> dict[str, Any]:
        return {"retriever": name, "protocol": "search-r1"}

    @app.post("/retrieve")
    def retrieve(body: RetrieveBody) -> Any:
        k = 3 if body.topk is None else body.topk
        problems = []
        if not 1 <= k <= MAX_TOPK:
            problems.append(f"topk must be in 1..{MAX_TOPK}, got {k}")
        if len(body.queries) > MAX_QUERIES_PER_REQUEST:
            problems.append(f"at most {MAX_QUERIES_PER_REQUEST} queries per request, got {len(body.queries)}")
        too_long = [i for i, q in enumerate(body.queries) if len(q) > MAX_QUERY_CHARS]
        if too_long:
            problems.append(f"queries {too_long[:5]} are longer than {MAX_QUERY_CHARS} characters")
        if problems:
            raise fastapi.HTTPException(status_code=400, detail="; ".join(problems))
        results = retriever.search(body.queries, k)
        if body.return_scores:
            return {"result": [[{"document": h.passage.to_row(), "score": h.score} for h in hits] for hits in results]}
        return {"result": [[h.passage.to_row() for h in hits] for hits in results]}

    return app


@register_retriever("http")
class HttpRetriever(Retriever):
    """A Search-R1 ``/retrieve`` server by URL; connection failures are retried, then a clear RetrievalError."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 2, retry_wait_s: float = 0.5) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/retrieve") else base + "/retrieve"
        self.timeout_s, self.retries, self.retry_wait_s = timeout_s, retries, retry_wait_s
        self._http = requests.Session()

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        if not queries:
            return []
        payload = {"queries": list(queries), "topk": int(k), "return_scores": True}
        error: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                response = self._http.post(self.url, json=payload, timeout=self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as failure:
                error = failure
                time.sleep(self.retry_wait_s * (attempt + 1))
                continue
            if response.status_code >= 500:
                error = RetrievalError(f"{self.url} -> HTTP {response.status_code}: {response.text[:200]}")
                time.sleep(self.retry_wait_s * (attempt + 1))
                continue
            if response.status_code != 200:
                raise RetrievalError(f"{self.url} refused the request: HTTP {response.status_code} "
                                     f"{response.text[:300]}")
            return _parse_result(response.json(), len(queries), self.url)
        raise RetrievalError(f"the retrieval server at {self.url} did not answer after {self.retries + 1} tries "
                             f"({error}); start it with `python -m launch.serve_retriever` or fix retriever_url")

    def close(self) -> None:
        self._http.close()


def _parse_result(body: Any, n_queries: int, url: str) -> list[list[Hit]]:
    try:
        result = body["result"]
        if len(result) != n_queries:
            raise ValueError(f"{len(result)} result lists for {n_queries} queries")
        parsed = []
        for hits in result:
            row = []
            for entry in hits:
                document, score = (entry["document"], float(entry.get("score", 0.0))) if "document" in entry \
                    else (entry, 0.0)
                row.append(Hit(Passage.from_contents(str(document["id"]), document["contents"]), score))
            parsed.append(row)
        return parsed
    except (KeyError, TypeError, ValueError) as error:
        raise RetrievalError(f"{url} answered in an unexpected shape ({error!r}); is it a Search-R1 /retrieve "
                             "server?") from None
