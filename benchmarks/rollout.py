"""Rollout-loop throughput: the demo config's training step, and continuous episodes against lock-step rounds.

    python -m benchmarks.rollout [--part=all|step|loops|async_env] [--steps=11] [--repeats=3]

``step``: ``--steps`` full training steps (rollout + update) of ``configs/cpu_demo.py`` after one warm-up step
that compiles (default: the rest of the demo's 12, so the warm-up and the timed steps are one whole demo's
training); medians over the timed steps, and over all of them with the warm-up. ``loops``: the demo's model on
BabyAI GoTo tasks with a horizon of 6 turns, the same episodes played by continuous episodes and by lock-step
rounds, interleaved, ``--repeats`` times each after a compiling warm-up (program builds inside a timed rollout
taken out); episodes/s medians.
``--loop_env=babyai_strict`` (the headline keys; ``benchmarks/strict_env.py``) ends an episode at its first action
BabyAI does not understand, so episodes end at turns the policy's samples decide; ``--loop_env=babyai`` (keys
``*_babyai``) plays plain BabyAI, where an untrained policy takes nearly every episode to the horizon;
``--loop_model`` plays a trained policy instead (the demo's export). ``async_env``: the
continuous loop with and without ``async_env_steps`` on BabyAI whose steps also wait ``--step_seconds``
(``benchmarks/slow_env.py``: a page load or a remote server), 2 pool workers. Each part updates its keys of
benchmarks/results/rollout.json.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import tempfile
from pathlib import Path

from absl import app, flags

from agentgym_jax import compile_stats
from benchmarks.common import RESULTS_DIR, cpu_facts, median, peak_rss_mib, write_json

_PART = flags.DEFINE_enum("part", "all", ["all", "step", "loops", "async_env"], "What to measure.")
_STEP_SECONDS = flags.DEFINE_list("step_seconds", ["0", "0.5"], "Added seconds per env step (part async_env).")
_STEPS = flags.DEFINE_integer("steps", 0, "Timed training steps after the warm-up step (part step); 0: the rest of "
                              "the demo's steps (train.steps - 1).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rollouts per loop (part loops).")
_ALL_ROWS = flags.DEFINE_bool("all_rows", True, "Also time lock-step rounds over all 32 rows at once (part loops).")
_LOOP_MODEL = flags.DEFINE_string(
    "loop_model", "", "Policy for part loops (a Hugging Face folder, e.g. the demo's runs/cpu_demo/export after "
    "`make demo`: a trained policy ends more episodes early); default: the demo config's model.")
_LOOP_ENV = flags.DEFINE_enum(
    "loop_env", "babyai_strict", ["babyai_strict", "babyai"], "Environment for part loops: babyai_strict (episodes "
    "end at the first action BabyAI does not understand: varied lengths) or plain babyai (an untrained policy plays "
    "nearly every episode to the horizon).")
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


@contextlib.contextmanager
def _playing_on(trainer, env: str, kwargs: dict, workers: int, module: str):
    """Inside the block the trainer's rollouts play ``env`` (registered on import of ``module``) in a pool of
    ``workers``; after it, that pool is closed and the trainer's own pool is put back, whatever happened."""
    from environments.workers import EnvPool

    own_pool = trainer.pool
    trainer.pool = EnvPool(env, kwargs, num_workers=workers, import_modules=(module,))
    try:
        yield
    finally:
        trainer.pool.close()
        trainer.pool = own_pool


def measure_loops() -> dict:
    """Episodes/s of continuous episodes and of lock-step rounds (in waves of the same rows, and all at once) on
    the same BabyAI episodes."""
    import dataclasses

    import jax

    from agentgym_jax.trainer import Trainer

    config = _demo_config()
    config.data.dynamic_sampling = False
    config.rollout.max_trajectory_tokens = 2048
    if _LOOP_MODEL.value:
        config.model.path = _LOOP_MODEL.value
    refill_after = config.rollout.refill_after
    loops = {"continuous": dict(continuous=True, max_rows=_LOOP_ROWS, refill_after=refill_after),
             "continuous_whole_turns": dict(continuous=True, max_rows=_LOOP_ROWS, refill_after=1.0),
             "lockstep_same_rows": dict(continuous=False, max_rows=_LOOP_ROWS),
             "lockstep_all_rows": dict(continuous=False, max_rows=0)}
    if not _ALL_ROWS.value:
        del loops["lockstep_all_rows"]
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    compiling: dict[str, list[float]] = {name: [] for name in loops}
    rounds, turns = {}, []
    compile_stats.install()
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        try:
            strict = _LOOP_ENV.value != "babyai"
            with (_playing_on(trainer, _LOOP_ENV.value, dict(config.env.kwargs), config.env.num_workers,
                              "benchmarks.strict_env") if strict else contextlib.nullcontext()):
                tasks = trainer.train_tasks[:_LOOP_TASKS]
                for repeat in range(_REPEATS.value + 1):  # the first pass compiles most shapes
                    for name, settings in loops.items():
                        trainer.rollout_config = dataclasses.replace(trainer.rollout_config, **settings)
                        before = compile_stats.total_build_seconds()
                        played, stats = trainer.rollout(tasks, _LOOP_SAMPLES, _LOOP_HORIZON,
                                                        jax.random.PRNGKey(repeat))
                        compiled = compile_stats.total_build_seconds() - before
                        total = stats.sampling_s + stats.env_s + stats.host_s
                        print(f"pass {repeat} {name}: {total:.1f} s ({compiled:.1f} s building programs), "
                              f"{stats.rounds} sampler calls", flush=True)
                        if repeat:
                            # a shape first met in a timed pass compiles there, in whichever loop meets it first
                            seconds[name].append(total - compiled)
                            compiling[name].append(compiled)
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
        "continuous_early_return_gain": rate["continuous"] / rate["continuous_whole_turns"],
        "loops": {
            "workload": f"{_LOOP_TASKS} {_LOOP_ENV.value} GoTo tasks x {_LOOP_SAMPLES} samples, "
                        f"horizon {_LOOP_HORIZON}, "
                        f"temperature {config.rollout.temperature}, {_LOOP_ROWS} sampler rows (all 32 for "
                        "lockstep_all_rows); the demo's prefix and stop rules; continuous calls return once "
                        f"{refill_after} of their rows finished their turn (rollout.refill_after; 1.0 for "
                        "continuous_whole_turns)",
            "policy": _LOOP_MODEL.value or "the demo config's model (untrained)",
            "episodes_per_s": rate, "seconds_without_program_builds": seconds, "program_build_seconds": compiling,
            "sampler_calls": rounds,
            "turns_per_episode": {"min": min(turns), "median": median(turns), "max": max(turns),
                                  "histogram": {str(n): turns.count(n) for n in sorted(set(turns))}},
            "statistic": f"median of {_REPEATS.value} rollouts per loop, interleaved, after a compiling pass; "
                         "the seconds spent building programs (trace, lower, XLA compile) inside a timed rollout "
                         "are taken out",
        },
    }


def measure_async_env() -> dict:
    """Episodes/s of the continuous loop with environment steps overlapping sampling (``async_env_steps``) and
    without, on BabyAI steps that each take ``--step_seconds`` longer; the same episodes, interleaved."""
    import dataclasses

    import jax

    from agentgym_jax.trainer import Trainer

    config = _demo_config()
    config.data.dynamic_sampling = False
    tasks_n, samples, rows, horizon, workers = 4, 4, 8, 3, 2
    compile_stats.install()
    loops = {"sync": dict(continuous=True, max_rows=rows, async_env_steps=False),
             "async": dict(continuous=True, max_rows=rows, async_env_steps=True)}
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        try:
            tasks = trainer.train_tasks[:tasks_n]
            for step_seconds in [float(x) for x in _STEP_SECONDS.value]:
                seconds: dict[str, list[float]] = {name: [] for name in loops}
                waited: dict[str, list[float]] = {name: [] for name in loops}
                building: dict[str, list[float]] = {name: [] for name in loops}
                with _playing_on(trainer, "babyai_slow", dict(config.env.kwargs, step_seconds=step_seconds),
                                 workers, "benchmarks.slow_env"):
                    for repeat in range(_REPEATS.value + 1):  # the first pass compiles most shapes
                        for name, settings in loops.items():
                            trainer.rollout_config = dataclasses.replace(trainer.rollout_config, **settings)
                            before = compile_stats.total_build_seconds()
                            _, stats = trainer.rollout(tasks, samples, horizon, jax.random.PRNGKey(repeat))
                            compiled = compile_stats.total_build_seconds() - before
                            total = stats.sampling_s + stats.env_s + stats.host_s
                            print(f"step_seconds {step_seconds} pass {repeat} {name}: {total:.1f} s "
                                  f"({compiled:.1f} s building programs, env wait {stats.env_s:.1f} s, "
                                  f"{stats.rounds} sampler calls)", flush=True)
                            if repeat:
                                seconds[name].append(total - compiled)
                                building[name].append(compiled)
                                waited[name].append(stats.env_s)
                rate = {name: tasks_n * samples / median(values) for name, values in seconds.items()}
                results[str(step_seconds)] = {"episodes_per_s": rate, "async_vs_sync": rate["async"] / rate["sync"],
                                              "seconds_without_program_builds": seconds,
                                              "program_build_seconds": building, "env_wait_s": waited}
        finally:
            trainer.close()
    return {"async_env_vs_sync": {k: v["async_vs_sync"] for k, v in results.items()},
            "async_env": {"workload": f"{tasks_n} BabyAI GoTo tasks x {samples} samples, horizon {horizon}, "
                                      f"{rows} sampler rows, {workers} env workers; the demo's model; each env step "
                                      "also waits step_seconds (the keys)",
                          "by_step_seconds": results,
                          "statistic": f"median of {_REPEATS.value} rollouts per loop, interleaved, after a "
                                       "compiling pass; the seconds spent building programs inside a timed rollout "
                                       "are taken out"}}


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
            for _ in range(_STEPS.value or config.train.steps - 1):  # one step per call, to book its builds
                before = compile_stats.total_build_seconds()
                timed += trainer.fit(steps=1)
                compile_s.append(compile_stats.total_build_seconds() - before)
        finally:
            trainer.close()
    each = [m["time/step_s"] for m in timed]
    keys = ("time/step_s", "time/sampling_s", "time/env_s", "time/train_s", "time/rollout_host_s")
    med = {k: median([m[k] for m in timed]) for k in keys}
    env_steps = median([m["rollout/turns"] * episodes_per_step for m in timed])
    tokens = median([m["rollout/generated_tokens"] for m in timed])
    middle = sorted(timed, key=lambda m: m["time/step_s"])[len(timed) // 2]  # the median step, split into its
    split = {part: middle[f"time/{part}_s"] for part in ("sampling", "env", "train")}  # parts (medians of each
    split["other"] = middle["time/step_s"] - sum(split.values())  # part need not add up to the median step)
    return {
        "config": "configs/cpu_demo.py",
        "episodes_per_step": episodes_per_step,
        "episodes_per_s": episodes_per_step / med["time/step_s"],
        "env_steps_per_s": env_steps / med["time/step_s"],
        "env_steps_per_s_env_only": env_steps / max(med["time/env_s"], 1e-9),
        "generated_tokens_per_s": tokens / max(med["time/sampling_s"], 1e-9),
        "time_split_s": split,
        "time_split_share": {part: seconds / middle["time/step_s"] for part, seconds in split.items()},
        "step_s": med["time/step_s"],  # with whatever programs the step built
        "step_s_each": each,
        # the demo's own median when the warm-up and the timed steps make its whole run (the default --steps)
        "step_s_with_warmup": median([warmup["time/step_s"], *each]),
        "warmup_step_s": warmup["time/step_s"],
        # new shapes (batch, prompt and window buckets, packed update sizes) still compile in the first steps;
        # a program build is its trace, lowering and XLA compile
        "program_build_s_per_step": compile_s,
        "step_s_without_program_builds": median([step - c for step, c in zip(each, compile_s)]),
        "timed_steps": len(timed),
        "statistic": "median over timed steps after one compiling warm-up step (step_s_with_warmup: over all "
                     "steps); time_split_s is the median step's",
    }


def main(argv: list[str]) -> None:
    del argv
    path = RESULTS_DIR / "rollout.json"
    payload = json.loads(path.read_text()) if path.exists() else {}  # each part replaces only its own keys
    if _PART.value in ("all", "loops"):
        loops = measure_loops()
        # the headline keys: the default model on the varied-length workload
        suffix = ("_other_policy" if _LOOP_MODEL.value else "") + ("_babyai" if _LOOP_ENV.value == "babyai" else "")
        payload.update({key + suffix: value for key, value in loops.items()})
    if _PART.value in ("all", "step"):
        payload.update(measure_step())
    if _PART.value in ("all", "async_env"):
        payload.update(measure_async_env())
    payload.update({"peak_rss_mib": peak_rss_mib(), "machine": cpu_facts()})
    print(write_json("rollout", payload))


if __name__ == "__main__":
    app.run(main)
