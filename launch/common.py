"""Shared launcher plumbing: clear one-line errors instead of tracebacks for user mistakes."""

from __future__ import annotations

import sys
from typing import Callable

from absl import logging

from agentgym_jax.errors import AgentGymError


def run_main(main: Callable[[list[str]], None]) -> Callable[[list[str]], None]:
    """Wraps an absl ``main`` so a user-facing error prints ``error: <message>`` and exits with status 2."""

    def wrapped(argv: list[str]) -> None:
        try:
            main(argv)
        except AgentGymError as error:
            logging.flush()
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)

    return wrapped
