"""Serves one of our environments over the AgentGym env-server protocol (see environments/agentgym_server.py).

    python -m launch.serve_env --env=textcraft --port=36001
    python -m launch.serve_env --env=sciworld --port=36003 --env_kwargs='{"step_limit": 50}'
    python -m launch.serve_env --env=babyai --replica --port=36002   # answers like the original AgentGym server

Original AgentGym clients (and our ``agentgym_http`` environment) can then play it at
``http://<host>:<port>``. Every /create makes a new environment instance in this process.
"""

from __future__ import annotations

import json

from absl import app, flags

from environments.agentgym_server import build_app
from environments.agentgym_replica import REPLICAS, build_replica_app
from environments.base import registered_environments
from launch.common import run

FLAGS = flags.DEFINE_string("env", None, "registered environment to serve, e.g. textcraft, babyai, sciworld")
HOST = flags.DEFINE_string("host", "127.0.0.1", "interface to bind (0.0.0.0 to serve other machines)")
PORT = flags.DEFINE_integer("port", 36001, "TCP port")
ENV_KWARGS = flags.DEFINE_string("env_kwargs", "{}", "JSON object of keyword arguments for the environment")
BARE_ACTIONS = flags.DEFINE_bool(
    "bare_actions", False, "clients send only the parsed action (the original AgentGym clients do); see build_app"
)
REPLICA = flags.DEFINE_bool(
    "replica", False, "answer like the original AgentGym server of --env (babyai, textcraft): for dry runs of a "
    "remote set-up; see environments/agentgym_replica.py"
)
LOG_LEVEL = flags.DEFINE_enum("log_level", "warning", ["debug", "info", "warning", "error"], "uvicorn log level")
flags.mark_flag_as_required("env")


def main(argv: list[str]) -> None:
    del argv
    import logging

    import uvicorn

    logging.getLogger("py4j").setLevel(logging.WARNING)  # ScienceWorld's gateway logs every call at INFO

    names = [n for n in registered_environments() if n != "agentgym_http"]
    if FLAGS.value not in names:
        raise app.UsageError(f"--env={FLAGS.value!r} is not a registered environment; choose one of {names}")
    try:
        env_kwargs = json.loads(ENV_KWARGS.value)
    except json.JSONDecodeError as error:
        raise app.UsageError(f"--env_kwargs is not valid JSON ({error}); e.g. --env_kwargs='{{\"step_limit\": 50}}'")
    if not isinstance(env_kwargs, dict):
        raise app.UsageError("--env_kwargs must be a JSON object, e.g. '{}'")
    if REPLICA.value:
        if FLAGS.value not in REPLICAS or env_kwargs:
            raise app.UsageError(f"--replica serves the original servers' behaviour for {list(REPLICAS)}, without "
                                 "--env_kwargs")
        served = build_replica_app(FLAGS.value)
    else:
        served = build_app(FLAGS.value, env_kwargs, bare_actions=BARE_ACTIONS.value)
    uvicorn.run(served, host=HOST.value, port=PORT.value, log_level=LOG_LEVEL.value)


if __name__ == "__main__":
    run(main)
