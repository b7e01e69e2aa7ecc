"""Shared launcher plumbing: one-line errors instead of tracebacks for user mistakes, and quiet logs.

Every launcher runs through :func:`run`: flag and config mistakes (an unknown ``--config.*`` key, a bad value, a
missing or broken config file, a missing required flag) and ``AgentGymError`` s print ``error: <message>`` and
exit with status 2. Logs show warnings and errors by default; ``--verbosity=0`` brings back INFO lines (e.g.
orbax's per-save messages), ``--verbosity=1`` debug lines. Before anything runs, glibc is told to hand large freed
buffers back to the system (:mod:`agentgym_jax.allocator`), and compiled programs are kept for the next run
(:mod:`agentgym_jax.compilation_cache`; ``--compilation_cache_dir=off`` turns that off).
"""

from __future__ import annotations

import logging as pylogging
import re
import sys
from typing import Any, Callable, NoReturn, Sequence

from absl import app, flags, logging

from agentgym_jax.allocator import limit_allocator_retention
from agentgym_jax.errors import AgentGymError

QUIET_VERBOSITY = -1  # absl: -1 is WARNING, 0 INFO, 1 DEBUG

# Multi-process runs (agentgym_jax.distributed): every launcher connects its processes before touching a device.
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 in a multi-process run "
                                   "(default: $JAX_COORDINATOR_ADDRESS; SLURM, Open MPI and TPU pods are detected).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run "
                                      "(default: $JAX_NUM_PROCESSES or the detected cluster).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0 .. num_processes-1 "
                                   "(default: $JAX_PROCESS_ID or the detected cluster).")
_CONNECT_TIMEOUT = flags.DEFINE_integer("connect_timeout_s", 300, "How long a multi-process run's processes wait "
                                        "for each other to connect before giving up.")
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache_dir", None, "Where compiled XLA programs are kept for the next run (default: "
    "~/.cache/agentgym_jax/xla, or xla/ under $AGENTGYM_JAX_CACHE); 'off' compiles everything afresh.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout_s", 30, "A multi-process run stops within about this many "
                                  "seconds when one of its processes dies or cannot be reached.")


def _exit_with(message: str) -> NoReturn:
    logging.flush()
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _unknown_key_message(error: BaseException, argv: Sequence[str]) -> str:
    text = str(error).replace("\\", "")
    found = re.search(r"'([A-Za-z0-9_]+)'", text)
    key = found.group(1) if found else text
    hint = re.search(r'Did you mean "[^"]+" instead of "[^"]+"\?', text)
    flag = next((arg.split("=", 1)[0] for arg in argv if arg.startswith("--config.") and key in arg), "--config.*")
    return f"{flag}: the config has no key {key!r}." + (f" {hint.group(0)}" if hint else "")


def _check_config_files() -> None:
    """Loads every config-file flag now, so that a missing or broken file is reported as such."""
    from ml_collections.config_flags.config_flags import is_config_flag

    for name in list(flags.FLAGS):
        flag = flags.FLAGS[name]
        if not is_config_flag(flag) or not flag.present:
            continue
        try:
            list(flag.value.keys())  # a config that failed to load raises its deferred error here
        except (OSError, SyntaxError, ImportError, AttributeError, TypeError, ValueError) as error:
            detail = str(error)
            missing = re.search(r"\[Errno 2\][^\n]*", detail)
            reason = missing.group(0) if missing else detail.strip().splitlines()[-1]
            _exit_with(f"--{name}: cannot load the config file ({reason}); pass a file such as configs/cpu_demo.py")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing with one-line errors (passed to ``app.run`` as ``flags_parser``)."""
    try:
        remaining = flags.FLAGS(argv)
    except flags.Error as error:
        _exit_with(f"{error} (see --helpshort)")
    except (AttributeError, KeyError) as error:  # ml_collections: an unknown --config.<key>
        _exit_with(_unknown_key_message(error, argv))
    except SyntaxError as error:  # in a config file; other exceptions raised by its code keep their traceback
        _exit_with(f"config file {error.filename} line {error.lineno}: {error.msg}")
    except (TypeError, ValueError) as error:
        _exit_with(f"bad flag value: {error}")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(QUIET_VERBOSITY)
    _check_config_files()
    return remaining


def run_main(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Wraps an absl ``main`` so a user-facing error prints ``error: <message>`` and exits with status 2."""

    def wrapped(argv: list[str]) -> None:
        try:
            _connect_processes()
            if _COMPILATION_CACHE.value != "off":
                from agentgym_jax import compilation_cache

                compilation_cache.enable(_COMPILATION_CACHE.value)
            main(argv)
        except AgentGymError as error:
            _exit_with(str(error))

    return wrapped


def _connect_processes() -> None:
    """``jax.distributed.initialize`` when the flags, the environment or a detected cluster ask for several
    processes; then every log line names its process."""
    from agentgym_jax import distributed

    if not distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _HEARTBEAT.value,
                                  _CONNECT_TIMEOUT.value):
        return
    tag = f"[process {distributed.process_index()}/{distributed.process_count()}] "

    class _Tag(pylogging.Filter):
        def filter(self, record: pylogging.LogRecord) -> bool:
            if not str(record.msg).startswith(tag):
                record.msg = tag + str(record.msg)
            return True

    for handler in {logging.get_absl_handler(), *pylogging.getLogger().handlers}:
        handler.addFilter(_Tag())


def run(main: Callable[[list[str]], Any]) -> None:
    """``app.run`` with quiet logs by default, one-line flag errors and bounded allocator retention."""
    limit_allocator_retention()
    app.run(main, flags_parser=parse_flags)
