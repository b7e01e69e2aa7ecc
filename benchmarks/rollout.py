"""Rollout-loop throughput: the demo config's training step, and continuous episodes against lock-step rounds.

    python -m benchmarks.rollout [--part=all|step|loops] [--steps=3] [--repeats=3]

``step``: ``--steps`` full training steps (rollout + update) of ``configs/cpu_demo.py`` after one warm-up step
that compiles; medians over the timed steps. ``loops``: the demo's model and BabyAI GoTo tasks with a horizon of
6 turns (episodes end at different turns), the same episodes played by continuous episodes and by lock-step
rounds, interleaved, ``--repeats`` times each after a compiling warm-up; episodes/s medians. Each part updates
its keys of benchmarks/results/rollout.json.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path

from absl import app, flags

from agentgym_jax import compile_stats
from benchmarks.common import RESULTS_DIR, cpu_facts, median, peak_rss_mib, write_json

_PART = flags.DEFINE_enum("part", "all", ["all", "step", "loops"], "What to measure.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed training steps after the warm-up step.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rollouts per loop (part loops).")
_ALL_ROWS = flags.DEFINE_bool("all_rows", True, "Also time lock-step rounds over all 32 rows at once (part loops).")
_LOOP_TASKS, _LOOP_SAMPLES, _LOOP_ROWS, _LOOP_HORIZON = 8, 4, 8, 6
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


def measure_loops() -> dict:
    """Episodes/s of continuous episodes and of lock-step rounds (in waves of the same rows, and all at once) on
    the same BabyAI episodes."""
    import dataclasses

    import jax

    from agentgym_jax.trainer import Trainer

    config = _demo_config()
    config.data.dynamic_sampling = False
    config.rollout.max_trajectory_tokens = 2048
    loops = {"continuous": dict(continuous=True, max_rows=_LOOP_ROWS),
             "lockstep_same_rows": dict(continuous=False, max_rows=_LOOP_ROWS),
             "lockstep_all_rows": dict(continuous=False, max_rows=0)}
    if not _ALL_ROWS.value:
        del loops["lockstep_all_rows"]
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    rounds, turns = {}, []
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        try:
            tasks = trainer.train_tasks[:_LOOP_TASKS]
            for repeat in range(_REPEATS.value + 1):  # the first pass compiles every shape
                for name, settings in loops.items():
                    trainer.rollout_config = dataclasses.replace(trainer.rollout_config, **settings)
                    played, stats = trainer.rollout(tasks, _LOOP_SAMPLES, _LOOP_HORIZON, jax.random.PRNGKey(repeat))
                    print(f"pass {repeat} {name}: {stats.sampling_s + stats.env_s + stats.host_s:.1f} s, "
                          f"{stats.rounds} sampler calls", flush=True)
                    if repeat:
                        seconds[name].append(stats.sampling_s + stats.env_s + stats.host_s)
                        rounds.setdefault(name, []).append(stats.rounds)
                        if name == "continuous":
                            turns += [t.turns for t in played]
        finally:
            trainer.close()
    episodes = _LOOP_TASKS * _LOOP_SAMPLES
    rate = {name: episodes / median(values) for name, values in seconds.items()}
    return {
        "continuous_vs_lockstep": rate["continuous"] / rate["lockstep_same_rows"],
        "continuous_vs_lockstep_all_rows": (rate["continuous"] / rate["lockstep_all_rows"]
                                            if "lockstep_all_rows" in rate else None),
        "loops": {
            "workload": f"{_LOOP_TASKS} BabyAI GoTo tasks x {_LOOP_SAMPLES} samples, horizon {_LOOP_HORIZON}, "
                        f"temperature {config.rollout.temperature}, {_LOOP_ROWS} sampler rows (all 32 for "
                        "lockstep_all_rows); the demo's model, prefix and stop rules",
            "episodes_per_s": rate, "seconds": seconds, "sampler_calls": rounds,
            "turns_per_episode": {"min": min(turns), "median": median(turns), "max": max(turns),
                                  "histogram": {str(n): turns.count(n) for n in sorted(set(turns))}},
            "statistic": f"median of {_REPEATS.value} rollouts per loop, interleaved, after a compiling pass",
        },
    }


def measure_step() -> dict:
    from agentgym_jax.trainer import Trainer

    config = _demo_config()
    episodes_per_step = config.data.tasks_per_step * config.data.samples_per_task
    compile_stats.install()
    compile_s = []
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        try:
            warmup = trainer.fit(steps=1)[0]
            timed = []
            for _ in range(_STEPS.value):  # one step per call, to book each step's XLA compile time
                before = compile_stats.total_compile_seconds()
                timed += trainer.fit(steps=1)
                compile_s.append(compile_stats.total_compile_seconds() - before)
        finally:
            trainer.close()
    keys = ("time/step_s", "time/sampling_s", "time/env_s", "time/train_s", "time/rollout_host_s")
    med = {k: median([m[k] for m in timed]) for k in keys}
    env_steps = median([m["rollout/turns"] * episodes_per_step for m in timed])
    tokens = median([m["rollout/generated_tokens"] for m in timed])
    other = med["time/step_s"] - med["time/sampling_s"] - med["time/env_s"] - med["time/train_s"]
    return {
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
        # new shapes (batch, prompt and window buckets, packed update sizes) still compile in the first steps
        "compile_s_per_step": compile_s,
        "step_s_without_compiles": median([m["time/step_s"] - c for m, c in zip(timed, compile_s)]),
        "timed_steps": len(timed),
        "statistic": "median over timed steps after one compiling warm-up step",
    }


def main(argv: list[str]) -> None:
    del argv
    path = RESULTS_DIR / "rollout.json"
    payload = json.loads(path.read_text()) if path.exists() else {}  # each part replaces only its own keys
    if _PART.value in ("all", "loops"):
        payload.update(measure_loops())
    if _PART.value in ("all", "step"):
        payload.update(measure_step())
    payload.update({"peak_rss_mib": peak_rss_mib(), "machine": cpu_facts()})
    print(write_json("rollout", payload))


if __name__ == "__main__":
    app.run(main)
