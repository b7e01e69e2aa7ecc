"""Host-side worker pool: many episodes of one environment, stepped in parallel worker processes.

    with EnvPool(env_name="textcraft", env_kwargs={}, num_workers=2, step_timeout_s=60.0) as pool:
        starts = pool.reset([3, 3, 17])                      # one new episode per entry
        outs = pool.step({starts[0].episode_id: "Action:\\nget 1 oak logs"})
        pool.close_episodes([s.episode_id for s in starts])

Each worker is a spawned process holding environment instances (reused across episodes, so a
SciWorld JVM is started once per instance, not per episode). A batch is split by worker; workers run
their parts at the same time and answer episode by episode, and every single env call must answer
within ``step_timeout_s``. Failures never take the pool down:

- an exception inside ``reset``/``step`` becomes that episode's ``error`` (done=True); its instance is
  closed and dropped, since its state is unknown;
- a worker that dies or hangs is killed together with its child processes (JVMs), replaced by a fresh
  one, and every episode it held comes back failed with the reason (the ones in the batch at once,
  the others at their next step).

``num_workers=0`` runs everything in the calling process (for debugging; no timeout is enforced there).
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import time
import traceback
from typing import Any, Iterable, Mapping, Sequence

import psutil

from environments.base import Environment, Task, make_env, registered_environments


class PoolError(RuntimeError):
    """Misuse of the pool: unknown episode ids, calls after shutdown, bad arguments."""


@dataclasses.dataclass
class EpisodeOutcome:
    """The result of a reset or step of one episode."""

    episode_id: int
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]
    error: str | None = None  # set when the episode failed (env exception, dead or hung worker)


def _describe_exception(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(error).__name__}: {error}{where}"


class EpisodeHost:
    """Holds the environment instances of the episodes assigned to one worker (or to the caller)."""

    def __init__(self, env_name: str, env_kwargs: Mapping[str, Any]) -> None:
        self.env_name = env_name
        self.env_kwargs = dict(env_kwargs)
        self.episodes: dict[int, Environment] = {}
        self.idle: list[Environment] = []
        self._describer: Environment | None = None

    def _instance(self) -> Environment:
        return self.idle.pop() if self.idle else make_env(self.env_name, **self.env_kwargs)

    def _discard(self, env: Environment) -> None:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - a broken instance is dropped either way
            pass

    def describe(self, split: str | None) -> Any:
        """The instruction (split=None) or a split's task list, from a spare instance."""
        if self._describer is None:
            self._describer = self.idle.pop() if self.idle else make_env(self.env_name, **self.env_kwargs)
        return self._describer.instruction() if split is None else list(self._describer.tasks(split))

    def reset(self, episode_id: int, task_id: int) -> EpisodeOutcome:
        env = self.episodes.pop(episode_id, None)
        try:
            env = env or self._instance()
            observation, info = env.reset(task_id)
        except Exception as error:  # noqa: BLE001 - becomes the episode's error
            if env is not None:
                self._discard(env)
            return EpisodeOutcome(episode_id, "", 0.0, True, {}, _describe_exception(error))
        self.episodes[episode_id] = env
        return EpisodeOutcome(episode_id, observation, 0.0, False, dict(info))

    def step(self, episode_id: int, action_text: str) -> EpisodeOutcome:
        env = self.episodes.get(episode_id)
        if env is None:
            return EpisodeOutcome(episode_id, "", 0.0, True, {}, "episode is not open (closed or failed earlier)")
        try:
            result = env.step(action_text)
        except Exception as error:  # noqa: BLE001 - becomes the episode's error
            del self.episodes[episode_id]
            self._discard(env)
            return EpisodeOutcome(episode_id, "", 0.0, True, {}, _describe_exception(error))
        return EpisodeOutcome(episode_id, result.observation, float(result.reward), bool(result.done), dict(result.info))

    def close_episode(self, episode_id: int) -> None:
        env = self.episodes.pop(episode_id, None)
        if env is None:
            return
        try:
            env.end_episode()
        except Exception:  # noqa: BLE001 - an instance that cannot end its episode cleanly is not reused
            self._discard(env)
            return
        self.idle.append(env)  # reused by the next reset

    def close_all(self) -> None:
        envs = list(self.episodes.values()) + self.idle + ([self._describer] if self._describer else [])
        self.episodes, self.idle, self._describer = {}, [], None
        for env in envs:
            self._discard(env)


def _sendable(host: EpisodeHost, outcome: EpisodeOutcome) -> EpisodeOutcome:
    """``outcome``, or, when it cannot cross the process boundary, that episode failed with the reason."""
    try:
        pickle.dumps(outcome)
        return outcome
    except Exception as error:  # noqa: BLE001 - pickling raises several types
        bad = []
        for key, value in outcome.info.items():
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001
                bad.append(key)
        host.close_episode(outcome.episode_id)
        return EpisodeOutcome(
            outcome.episode_id, "", 0.0, True, {},
            f"the environment returned data that cannot be sent from its worker process ({type(error).__name__}: "
            f"{error}); info keys {bad} hold such objects: return plain data (str, numbers, lists, dicts)")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _worker_main(
    conn: multiprocessing.connection.Connection, env_name: str, env_kwargs: dict, import_modules: Sequence[str]
) -> None:
    """A worker's loop: run commands from the pool, answer one message per episode, then ``"end"``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that `finally` closes the envs (and JVMs)
    for module in import_modules:
        importlib.import_module(module)
    registered_environments()  # imports the built-in environment packages before the first timed call
    host = EpisodeHost(env_name, env_kwargs)
    conn.send(("ready", None))
    try:
        while True:
            try:
                command, payload = conn.recv()
            except EOFError:
                return
            if command == "reset":
                for episode_id, task_id in payload:
                    conn.send(("outcome", _sendable(host, host.reset(episode_id, task_id))))
            elif command == "step":
                for episode_id, action in payload:
                    conn.send(("outcome", _sendable(host, host.step(episode_id, action))))
            elif command == "close":
                for episode_id in payload:
                    host.close_episode(episode_id)
            elif command == "describe":
                try:
                    conn.send(("value", host.describe(payload)))
                except Exception as error:  # noqa: BLE001 - reported to the caller
                    conn.send(("failure", _describe_exception(error)))
            elif command == "shutdown":
                return
            conn.send(("end", None))
    finally:
        host.close_all()


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, context: Any, env_name: str, env_kwargs: dict, import_modules: Sequence[str], index: int) -> None:
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=_worker_main,
            args=(child_conn, env_name, env_kwargs, tuple(import_modules)),
            name=f"envpool-{env_name}-{index}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.episodes: set[int] = set()
        self.ready = False  # becomes True at its first message, once its imports are done

    def kill(self) -> None:
        """Kills the worker and everything it started (e.g. JVMs), and waits for them."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            children = []
        self.process.kill()
        self.process.join(timeout=10)
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=10)
        self.conn.close()

    def stop(self, timeout_s: float) -> None:
        """Asks the worker to exit cleanly (closing its envs); kills it if it does not in time."""
        try:
            self.conn.send(("shutdown", None))
        except OSError:
            pass
        self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


class EnvPool:
    """A pool of environment episodes run by ``num_workers`` spawned processes (0: in-process)."""

    def __init__(
        self,
        env_name: str,
        env_kwargs: Mapping[str, Any] | None = None,
        num_workers: int = 2,
        step_timeout_s: float = 60.0,
        start_method: str = "spawn",
        import_modules: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
    ) -> None:
        """``import_modules`` are imported (in the caller and in each worker) before building envs,
        so that environments registered outside ``environments/`` can be pooled too.
        ``step_timeout_s`` bounds each env call; ``startup_timeout_s`` a new worker's start-up."""
        if num_workers < 0:
            raise PoolError(f"num_workers must be >= 0 (0 runs in-process), got {num_workers}")
        if step_timeout_s <= 0:
            raise PoolError(f"step_timeout_s must be positive, got {step_timeout_s}")
        self.env_name = env_name
        self.env_kwargs = dict(env_kwargs or {})
        self.num_workers = num_workers
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s  # a new worker's imports (e.g. minigrid) may take a while
        self._context = multiprocessing.get_context(start_method)
        self._next_episode_id = 0
        self._owner: dict[int, int] = {}  # open episode -> worker index (-1 in-process)
        self._failed: dict[int, str] = {}  # episode -> why it was lost with its worker
        self._instruction: str | None = None
        self._closed = False
        self.replacements = 0  # how many workers have been replaced after a crash or hang
        for module in import_modules:
            importlib.import_module(module)
        self.import_modules = tuple(import_modules)
        if env_name not in registered_environments():
            raise PoolError(f"unknown environment {env_name!r}; registered: {', '.join(registered_environments())}")
        self._host = EpisodeHost(env_name, self.env_kwargs) if num_workers == 0 else None
        self._workers = [self._spawn(i) for i in range(num_workers)]

    # -- lifecycle -------------------------------------------------------------------------------------

    def _spawn(self, index: int) -> _Worker:
        return _Worker(self._context, self.env_name, self.env_kwargs, self.import_modules, index)

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Closes every episode and stops every worker (and their JVMs). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._host is not None:
            self._host.close_all()
        for worker in self._workers:
            worker.stop(timeout_s)
        self._workers = []
        self._owner.clear()

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for tests and monitoring)."""
        return [worker.process.pid for worker in self._workers]

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError("the pool is closed; create a new EnvPool")

    # -- queries ---------------------------------------------------------------------------------------

    def _describe(self, split: str | None) -> Any:
        self._check_open()
        if self._host is not None:
            return self._host.describe(split)
        index = 0
        for attempt in range(2):  # a description is read-only, so a worker lost meanwhile is replaced and asked again
            results = self._run({index: ("describe", split)})
            kind, value = results[index][0]
            if kind == "failure":
                raise PoolError(f"worker could not describe {self.env_name!r}: {value}")
            if kind != "lost":
                return value
        raise PoolError(f"worker died twice while describing {self.env_name!r}: {value}")

    @property
    def instruction(self) -> str:
        """The environment's instruction text (the first user message)."""
        if self._instruction is None:
            self._instruction = self._describe(None)
        return self._instruction

    def tasks(self, split: str) -> list[Task]:
        """The environment's task list for ``split``."""
        return self._describe(split)

    @property
    def open_episodes(self) -> list[int]:
        return sorted(self._owner)

    # -- episodes --------------------------------------------------------------------------------------

    def reset(self, task_ids: Sequence[int]) -> list[EpisodeOutcome]:
        """Starts one new episode per task id (duplicates allowed); outcomes in the same order."""
        self._check_open()
        episode_ids = []
        for task_id in task_ids:
            episode_id = self._next_episode_id
            self._next_episode_id += 1
            worker = self._least_loaded()
            self._owner[episode_id] = worker
            if worker >= 0:
                self._workers[worker].episodes.add(episode_id)
            episode_ids.append((episode_id, task_id))
        outcomes = self._dispatch("reset", episode_ids)
        return [outcomes[episode_id] for episode_id, _ in episode_ids]

    def step(self, actions: Mapping[int, str]) -> dict[int, EpisodeOutcome]:
        """Steps each given episode with the agent's turn text; all workers run at the same time."""
        self._check_open()
        unknown = [e for e in actions if e not in self._owner and e not in self._failed]
        if unknown:
            raise PoolError(f"unknown or closed episode ids {sorted(unknown)}; reset() gives new episode ids")
        outcomes: dict[int, EpisodeOutcome] = {}
        live = []
        for episode_id, action in actions.items():
            if episode_id in self._failed:
                outcomes[episode_id] = EpisodeOutcome(episode_id, "", 0.0, True, {}, self._failed[episode_id])
            else:
                live.append((episode_id, action))
        outcomes.update(self._dispatch("step", live))
        return {episode_id: outcomes[episode_id] for episode_id in actions}

    def close_episodes(self, episode_ids: Iterable[int]) -> None:
        """Ends episodes; their environment instances stay in their worker for reuse."""
        self._check_open()
        by_worker: dict[int, list[int]] = {}
        for episode_id in episode_ids:
            self._failed.pop(episode_id, None)
            worker = self._owner.pop(episode_id, None)
            if worker is None:
                continue
            by_worker.setdefault(worker, []).append(episode_id)
        for worker, ids in by_worker.items():
            if worker < 0:
                for episode_id in ids:
                    self._host.close_episode(episode_id)
            else:
                self._workers[worker].episodes.difference_update(ids)
                self._run({worker: ("close", ids)})

    def _least_loaded(self) -> int:
        if not self._workers:
            return -1
        return min(range(len(self._workers)), key=lambda i: (len(self._workers[i].episodes), i))

    def _dispatch(self, command: str, items: Sequence[tuple[int, Any]]) -> dict[int, EpisodeOutcome]:
        if self._host is not None:
            run = self._host.reset if command == "reset" else self._host.step
            outcomes = {episode_id: run(episode_id, arg) for episode_id, arg in items}
        else:
            by_worker: dict[int, list[tuple[int, Any]]] = {}
            for episode_id, arg in items:
                by_worker.setdefault(self._owner[episode_id], []).append((episode_id, arg))
            results = self._run({w: (command, part) for w, part in by_worker.items()})
            outcomes = {}
            for worker, part in by_worker.items():
                for kind, value in results[worker]:
                    if kind == "outcome":
                        outcomes[value.episode_id] = value
                for episode_id, _ in part:
                    if episode_id not in outcomes:
                        outcomes[episode_id] = EpisodeOutcome(
                            episode_id, "", 0.0, True, {}, self._failed.get(episode_id, "worker lost")
                        )
        for outcome in outcomes.values():
            if outcome.error is not None:  # a failed episode is over; stepping it again repeats the error
                self._failed[outcome.episode_id] = outcome.error
                worker = self._owner.pop(outcome.episode_id, None)
                if worker is not None and worker >= 0:
                    self._workers[worker].episodes.discard(outcome.episode_id)
        return outcomes

    def _run(self, commands: Mapping[int, tuple[str, Any]]) -> dict[int, list]:
        """Sends each worker its command and collects its messages until ``"end"``.

        A worker that dies, or stays silent for ``step_timeout_s`` between messages, is killed and
        replaced; its result list then ends with ``("lost", reason)``.
        """
        results: dict[int, list] = {w: [] for w in commands}
        pending: dict[Any, int] = {}
        try:
            self._collect(commands, results, pending)
        except BaseException:  # e.g. Ctrl-C: workers still busy would answer the *next* command
            for index in list(pending.values()):
                self._replace(index, "interrupted while the worker was busy", results)
            raise
        return results

    def _collect(self, commands: Mapping[int, tuple[str, Any]], results: dict[int, list], pending: dict[Any, int]) -> None:
        for index, message in commands.items():
            worker = self._workers[index]
            try:
                worker.conn.send(message)
                pending[worker.conn] = index
            except (OSError, ValueError) as error:
                worker.process.join(timeout=2)  # a broken pipe usually means the process is gone
                code = worker.process.exitcode
                reason = (f"worker process died (exit code {code})" if code is not None
                          else f"worker process could not be reached ({error})")
                self._replace(index, reason, results)
        deadline = {
            index: time.monotonic() + (self.step_timeout_s if self._workers[index].ready else self.startup_timeout_s)
            for index in pending.values()
        }
        while pending:
            now = time.monotonic()
            for conn, index in list(pending.items()):
                if now >= deadline[index]:
                    del pending[conn]
                    limit = "step_timeout_s" if self._workers[index].ready else "startup_timeout_s"
                    seconds = self.step_timeout_s if self._workers[index].ready else self.startup_timeout_s
                    self._replace(index, f"worker timed out: no answer within {limit}={seconds}s", results)
            if not pending:
                break
            sentinels = {self._workers[i].process.sentinel: i for i in pending.values()}
            timeout = max(0.0, min(deadline[i] for i in pending.values()) - time.monotonic())
            ready = multiprocessing.connection.wait(list(pending) + list(sentinels), timeout=timeout)
            for handle in ready:
                index = pending.get(handle) if handle in pending else sentinels.get(handle)
                if index is None or self._workers[index].conn not in pending:
                    continue
                conn = self._workers[index].conn
                try:
                    while conn.poll():
                        kind, value = conn.recv()
                        if kind == "end":
                            del pending[conn]
                            break
                        if kind == "ready":
                            self._workers[index].ready = True
                        else:
                            results[index].append((kind, value))
                        deadline[index] = time.monotonic() + self.step_timeout_s
                    else:
                        if handle is not conn and not self._workers[index].process.is_alive():
                            raise EOFError
                except (EOFError, OSError):
                    pending.pop(conn, None)
                    self._workers[index].process.join(timeout=2)
                    code = self._workers[index].process.exitcode
                    self._replace(index, f"worker process died (exit code {code})", results)

    def _replace(self, index: int, reason: str, results: dict[int, list]) -> None:
        """Kills worker ``index``, marks all its episodes failed with ``reason``, starts a new worker."""
        old = self._workers[index]
        old.kill()
        for episode_id in old.episodes:
            self._failed[episode_id] = reason
            self._owner.pop(episode_id, None)
        results.setdefault(index, []).append(("lost", reason))
        self._workers[index] = self._spawn(index)
        self.replacements += 1
