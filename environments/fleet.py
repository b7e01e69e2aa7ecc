"""A fleet of env servers: which server the next episode goes to, and which servers are out of rotation.

Every :class:`~environments.agentgym_http.AgentGymHTTPEnv` of a process that was given the same server list
shares one :class:`Fleet`. An episode holds a slot on its server from ``reset`` until it ends; a new episode
goes to the answering server with the fewest open episodes (below ``max_episodes_per_server``, counted per
process: with several env worker processes the total per server is that times ``env.num_workers``). A server
that stops answering is taken out of rotation for ``retry_after_s`` and tried again after that; the episodes it
held fail with the reason, and new episodes go elsewhere.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence


class FleetExhaustedError(RuntimeError):
    """No server can take another episode (all out of rotation, or all at their cap)."""


class Fleet:
    """Open-episode counts and availability of a list of servers (thread-safe)."""

    def __init__(self, urls: Sequence[str], max_episodes_per_server: int = 0, retry_after_s: float = 30.0,
                 clock=time.monotonic) -> None:
        if not urls:
            raise ValueError("a fleet needs at least one server URL")
        self.urls = tuple(urls)
        self.max_episodes = max_episodes_per_server
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._open = {url: 0 for url in self.urls}
        self._down_until = {url: 0.0 for url in self.urls}
        self._lock = threading.Lock()

    def available(self, url: str) -> bool:
        return self._clock() >= self._down_until[url]

    def acquire(self, preferred: str | None = None, exclude: Sequence[str] = ()) -> str:
        """A slot on the least-loaded answering server (``preferred`` when it is among the least loaded)."""
        with self._lock:
            candidates = [u for u in self.urls if u not in exclude and self.available(u)
                          and (self.max_episodes <= 0 or self._open[u] < self.max_episodes)]
            if not candidates:
                down = [u for u in self.urls if not self.available(u)]
                raise FleetExhaustedError(
                    f"no env server can take another episode: {len(down)} of {len(self.urls)} out of rotation "
                    f"{down}, the others at max_episodes_per_server={self.max_episodes} or already tried; start more "
                    "servers or raise the cap")
            least = min(self._open[u] for u in candidates)
            chosen = preferred if preferred in candidates and self._open[preferred] == least else next(
                u for u in candidates if self._open[u] == least)
            self._open[chosen] += 1
            return chosen

    def release(self, url: str) -> None:
        with self._lock:
            self._open[url] = max(0, self._open[url] - 1)

    def mark_down(self, url: str) -> None:
        """Takes ``url`` out of rotation for ``retry_after_s``."""
        with self._lock:
            self._down_until[url] = self._clock() + self.retry_after_s

    def open_episodes(self) -> dict[str, int]:
        with self._lock:
            return dict(self._open)


_FLEETS: dict[tuple, Fleet] = {}
_FLEETS_LOCK = threading.Lock()


def shared_fleet(urls: Sequence[str], max_episodes_per_server: int = 0, retry_after_s: float = 30.0) -> Fleet:
    """The process-wide fleet for these settings (created on first use)."""
    key = (tuple(urls), max_episodes_per_server, retry_after_s)
    with _FLEETS_LOCK:
        if key not in _FLEETS:
            _FLEETS[key] = Fleet(urls, max_episodes_per_server, retry_after_s)
        return _FLEETS[key]


def parse_urls(base_url: str | Sequence[str]) -> list[str]:
    """``"http://a:1, http://b:2"`` or a list -> clean URLs without trailing slashes (order kept, no repeats)."""
    items = base_url.split(",") if isinstance(base_url, str) else list(base_url)
    urls: list[str] = []
    for item in (str(i).strip().rstrip("/") for i in items):
        if item and item not in urls:
            urls.append(item)
    if not urls:
        raise ValueError(f"no server URL in {base_url!r}")
    return urls
