"""One headless Chromium per environment instance, driven by Playwright's sync API on a thread of its own.

Playwright's sync objects may only be used from the thread that created them, and a CDP call into a hung
renderer never returns, so every browser call runs on a dedicated owner thread and the caller waits at most
``timeout_s``. A call that overruns kills the whole browser process tree (the Playwright driver and its
Chromium), which frees the owner thread; the episode fails with the reason and the next ``launch`` starts a
fresh browser. The browser is Debian's ``chromium`` (``apt-get install -y chromium``), found at
``$AGENTGYM_CHROMIUM`` or ``/usr/bin/chromium``; Playwright's own browser download is not used.

If the Python process is killed outright, the Playwright driver sees its stdin close and takes Chromium
down with it, so no browser outlives its owner.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import queue
import shutil
import threading
import weakref
from typing import Any, Callable, TypeVar

import psutil

T = TypeVar("T")
DEFAULT_CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1280, "height": 720}  # WebArena's
CHROMIUM_ARGS = ("--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--mute-audio")
_LAUNCH_LOCK = threading.Lock()  # so that the driver process started by a launch can be told apart
_LIVE: "weakref.WeakSet[Browser]" = weakref.WeakSet()


class BrowserError(RuntimeError):
    """The browser could not be started, crashed, or stopped answering."""


class BrowserHung(BrowserError):
    """A browser call did not return within its time limit; the browser was killed."""


def chromium_path(explicit: str | None = None) -> str:
    """The Chromium executable to drive, or a one-line error naming the fix."""
    path = explicit or os.environ.get("AGENTGYM_CHROMIUM") or DEFAULT_CHROMIUM
    resolved = shutil.which(path) or (path if os.access(path, os.X_OK) else None)
    if resolved is None:
        raise BrowserError(f"no Chromium at {path!r}: run `apt-get install -y chromium` (or `make setup`), or set "
                           "AGENTGYM_CHROMIUM / chromium_path= to a Chromium executable")
    return resolved


def kill_tree(pids: list[int]) -> None:
    """Kills the given processes and all their descendants, and waits for them."""
    procs: list[psutil.Process] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs.extend(root.children(recursive=True))
            procs.append(root)
        except psutil.Error:
            continue
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


class _OwnerThread:
    """A thread that runs submitted functions one at a time (Playwright's sync objects live here)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)


class Browser:
    """A Playwright-driven Chromium: ``launch``, then ``call(fn)`` with ``fn`` using ``self.browser``."""

    def __init__(self, executable: str | None = None, headless: bool = True, call_timeout_s: float = 60.0) -> None:
        self.executable = chromium_path(executable)
        self.headless = headless
        self.call_timeout_s = call_timeout_s
        self.browser: Any = None  # playwright.sync_api.Browser, only touched on the owner thread
        self._playwright: Any = None
        self._owner: _OwnerThread | None = None
        self.driver_pid: int | None = None
        self.crash_reason: str | None = None  # set by page crash events (on the owner thread)
        self._wake: threading.Event | None = None  # set when the pending call finishes or a page crashes
        _LIVE.add(self)

    @property
    def alive(self) -> bool:
        if self.browser is None:
            return False
        return self.driver_pid is None or psutil.pid_exists(self.driver_pid)  # None: driver not identified

    def launch(self) -> None:
        """Starts the driver and Chromium (no-op when already running)."""
        if self.alive:
            return
        self.kill()
        self._owner = _OwnerThread(f"chromium-owner-{id(self):x}")
        with _LAUNCH_LOCK:
            before = {p.pid for p in psutil.Process().children()}
            try:
                self.call(self._start, timeout_s=max(self.call_timeout_s, 60.0))
            finally:
                drivers = [p.pid for p in psutil.Process().children() if p.pid not in before]
                self.driver_pid = drivers[0] if drivers else None

    def _start(self) -> None:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        try:
            self.browser = self._playwright.chromium.launch(
                executable_path=self.executable, headless=self.headless, args=list(CHROMIUM_ARGS))
        except Exception as error:
            self._playwright.stop()
            self._playwright = None
            raise BrowserError(f"Chromium at {self.executable} did not start ({str(error).splitlines()[0]}); check "
                               "that it runs: `chromium --headless --dump-dom about:blank`") from None

    def call(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Runs ``fn`` on the owner thread; kills the browser if it takes longer than ``timeout_s``."""
        if self._owner is None:
            raise BrowserError("the browser is not running; call launch() first")
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        wake = self._wake = threading.Event()
        future = self._owner.submit(fn)
        future.add_done_callback(lambda _: wake.set())
        if not wake.wait(limit):
            self.kill()
            raise BrowserHung(f"the browser did not answer within {limit:.0f} s (a hung page or renderer); it was "
                              "killed and the next episode starts a fresh one")
        if future.done():
            return future.result()
        reason = self.crash_reason or "the browser reported a crash"
        self.kill()  # a call into a crashed page may never return; the next episode gets a fresh browser
        raise BrowserError(f"{reason}; the browser was restarted")

    def report_crash(self, reason: str) -> None:
        """Called (on the owner thread) when a page's renderer crashed: wakes the waiting caller."""
        self.crash_reason = reason
        if self._wake is not None:
            self._wake.set()

    def process_ids(self) -> list[int]:
        """The driver and every Chromium process under it (for tests and memory accounting)."""
        if self.driver_pid is None:
            return []
        try:
            driver = psutil.Process(self.driver_pid)
            return [driver.pid] + [p.pid for p in driver.children(recursive=True)]
        except psutil.Error:
            return []

    def renderer_pids(self) -> list[int]:
        """Chromium renderer processes of this browser."""
        pids = []
        for pid in self.process_ids():
            try:
                if "--type=renderer" in psutil.Process(pid).cmdline():
                    pids.append(pid)
            except psutil.Error:
                continue
        return pids

    def memory_mib(self) -> float:
        """Resident memory of the driver and all Chromium processes, in MiB (shared pages counted per process)."""
        total = 0
        for pid in self.process_ids():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue
        return total / 2**20

    def close(self) -> None:
        """Closes Chromium and the driver politely, then kills whatever is left. Safe to call twice."""
        if self._owner is not None and self.alive:
            try:
                self.call(self._stop, timeout_s=15.0)
            except Exception:  # noqa: BLE001 - killed below either way
                pass
        self.kill()

    def _stop(self) -> None:
        try:
            self.browser.close()
        finally:
            self._playwright.stop()

    def kill(self) -> None:
        """Kills the driver and its Chromium at once and retires the owner thread."""
        pids = self.process_ids()
        if pids:
            kill_tree(pids[:1])
        self.browser, self._playwright, self.driver_pid = None, None, None
        if self._owner is not None:
            self._owner.stop()
            self._owner = None


@atexit.register
def _kill_all_browsers() -> None:
    for browser in list(_LIVE):
        browser.kill()
