"""Rollout-loop throughput of the demo config: episodes/s, env steps/s, generated tokens/s and the time split.

    python -m benchmarks.rollout [--steps=3]

Runs ``--steps`` full training steps (rollout + update) of ``configs/cpu_demo.py`` after one warm-up step that
compiles, and reports medians over the timed steps. Writes benchmarks/results/rollout.json.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from absl import app, flags

from benchmarks.common import cpu_facts, median, peak_rss_mib, write_json

_STEPS = flags.DEFINE_integer("steps", 3, "Timed training steps after the warm-up step.")
_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.py"


def _demo_config():
    spec = importlib.util.spec_from_file_location("cpu_demo", _CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.train.progress_bars = False
    config.train.tensorboard = False
    config.train.checkpoint_every = 0
    config.train.report_path = ""
    return config


def main(argv: list[str]) -> None:
    del argv
    from agentgym_jax.trainer import Trainer

    config = _demo_config()
    episodes_per_step = config.data.tasks_per_step * config.data.samples_per_task
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        try:
            warmup = trainer.fit(steps=1)[0]
            timed = trainer.fit(steps=_STEPS.value)
        finally:
            trainer.close()
    keys = ("time/step_s", "time/sampling_s", "time/env_s", "time/train_s", "time/rollout_host_s")
    med = {k: median([m[k] for m in timed]) for k in keys}
    env_steps = median([m["rollout/turns"] * episodes_per_step for m in timed])
    tokens = median([m["rollout/generated_tokens"] for m in timed])
    other = med["time/step_s"] - med["time/sampling_s"] - med["time/env_s"] - med["time/train_s"]
    payload = {
        "config": "configs/cpu_demo.py",
        "episodes_per_step": episodes_per_step,
        "episodes_per_s": episodes_per_step / med["time/step_s"],
        "env_steps_per_s": env_steps / med["time/step_s"],
        "env_steps_per_s_env_only": env_steps / max(med["time/env_s"], 1e-9),
        "generated_tokens_per_s": tokens / max(med["time/sampling_s"], 1e-9),
        "time_split_s": {"sampling": med["time/sampling_s"], "env": med["time/env_s"], "train": med["time/train_s"],
                         "other": other},
        "time_split_share": {k: v / med["time/step_s"] for k, v in (("sampling", med["time/sampling_s"]),
                             ("env", med["time/env_s"]), ("train", med["time/train_s"]), ("other", other))},
        "warmup_step_s": warmup["time/step_s"],
        "timed_steps": len(timed),
        "statistic": "median over timed steps after one compiling warm-up step",
        "peak_rss_mib": peak_rss_mib(),
        "machine": cpu_facts(),
    }
    print(write_json("rollout", payload))


if __name__ == "__main__":
    app.run(main)
