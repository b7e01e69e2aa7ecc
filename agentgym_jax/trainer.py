"""The end-to-end multi-turn RL loop: rollout -> advantages -> update, with evaluation, checkpoints and logs.

Built from one ml_collections config (see ``configs/``). The sampler and the learner share one set of sharded
parameters on one mesh. The task order and every random key are pure functions of ``(seed, step)``, so a run
resumed from a checkpoint reproduces the uninterrupted run exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from agentgym_jax import distributed, evaluation, hf, host_shards, schedule, sharding
from agentgym_jax.allocator import peak_rss_gb
from agentgym_jax.buckets import LENGTH_BUCKETS, bucket
from agentgym_jax.chat import ChatTokenizer
from agentgym_jax.checkpoint import RunCheckpointer
from agentgym_jax.diagnostics import SignalMonitor, learner_diagnostics, progress_fields, rollout_diagnostics
from agentgym_jax.dynamic_sampling import collect_groups_with_signal
from agentgym_jax.errors import ConfigError
from agentgym_jax.learner import Learner
from agentgym_jax.metrics_log import MetricLogger, NoLogger, plot_run
from agentgym_jax.rollout import END_REASONS, RolloutConfig, RolloutStats, Trajectory, run_rollout
from agentgym_jax.rollout_records import RolloutRecorder
from agentgym_jax.run_config import (learner_config_from, resolve_model_path, validate_multiprocess_config,
                                     validate_run_config)
from agentgym_jax.run_dir import atomic_write_text, claim_run_directory
from agentgym_jax.sampling import Sampler, SamplerConfig



def _filter_tasks(tasks: Sequence[Any], subtasks: Sequence[str]) -> list[Any]:
    return [t for t in tasks if not subtasks or t.subtask in subtasks]


class Trainer:
    """Owns the model, sampler, learner, environment pool, logger and checkpointer of one run."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | Path | None = None,
                 checkpoint_dir: str | Path | None = None):
        validate_run_config(config)
        self.config = config
        self.workdir = Path(workdir or config.train.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.mesh = sharding.make_mesh(tuple(config.mesh.shape)) if config.mesh.shape != (1, 1, 1) else None
        self.processes = jax.process_count()
        if self.processes > 1:
            validate_multiprocess_config(config, self.processes, jax.device_count())
        # the sampler runs on this process's devices (its data slices of the mesh), over views of the same arrays
        self.sampler_mesh = distributed.local_mesh(self.mesh)
        self.model_dir = resolve_model_path(config.model.path)
        if self.model_dir.is_dir():
            hf.read_hf_config(self.model_dir)  # a broken config.json is named as such, not as a tokenizer problem
        self.chat = ChatTokenizer.from_pretrained(self.model_dir,
                                                  template_kwargs=dict(config.model.chat_template_kwargs))
        model = hf.load_model(
            self.model_dir, mesh=self.mesh, param_dtype=config.model.param_dtype, dtype=config.model.dtype,
            remat=config.model.remat, lora_rank=config.model.lora_rank, lora_alpha=config.model.lora_alpha,
            lora_targets=tuple(config.model.lora_targets),
        )
        self.learner = Learner(model, learner_config_from(config), mesh=self.mesh)
        budget = config.rollout.max_trajectory_tokens
        if budget > model.config.max_position_embeddings:
            raise ConfigError(f"rollout.max_trajectory_tokens={budget} exceeds the model's context of "
                              f"{model.config.max_position_embeddings} tokens (max_position_embeddings); lower it")
        cache_length = bucket(budget, LENGTH_BUCKETS, "rollout.max_trajectory_tokens")
        stop_ids = tuple(self.chat.stop_token_ids)
        if config.rollout.stop_at_newline:  # a turn ends at its first line break (e.g. after the action line)
            stop_ids += self.chat.newline_token_ids()
        self.sampler = Sampler(
            model, SamplerConfig(cache_length=cache_length, stop_token_ids=stop_ids,
                                 stop_sequences=self.chat.stop_sequences(tuple(config.rollout.stop_strings)),
                                 cache_dtype=config.model.dtype,
                                 logprob_temperature=float(config.algo.temperature),
                                 window_buckets=tuple(b for b in LENGTH_BUCKETS if b < cache_length),
                                 token_buckets=(1, 4, 16, 32, 64, 128) + tuple(b for b in LENGTH_BUCKETS if b > 128)),
            mesh=self.sampler_mesh,
        )
        self._point_sampler()
        self._compilations_before = self.sampler.compilations  # the counter is per process
        self.rollout_config = RolloutConfig(
            max_turn_tokens=config.rollout.max_turn_tokens,
            max_trajectory_tokens=config.rollout.max_trajectory_tokens,
            temperature=config.rollout.temperature, top_p=config.rollout.top_p, top_k=config.rollout.top_k,
            system_prompt=config.rollout.system_prompt or None, canned_reply=config.rollout.canned_reply,
            response_prefix=config.rollout.response_prefix, max_rows=config.rollout.max_rows,
            continuous=config.rollout.continuous, async_env_steps=config.rollout.async_env_steps,
            refill_after=config.rollout.refill_after,
        )
        self.signal_monitor = SignalMonitor()
        from environments.workers import EnvPool

        env_name, env_kwargs = config.env.name, dict(config.env.kwargs)
        if config.env.remote:
            from environments.remote import RemoteConfigError, remote_env_spec

            try:
                env_name, env_kwargs = remote_env_spec(config.env.remote, config.env.name,
                                                       config.env.remote_profile, env_kwargs)
            except RemoteConfigError as error:
                raise ConfigError(str(error)) from None
        self.pool = EnvPool(
            env_name, env_kwargs, num_workers=config.env.num_workers,
            step_timeout_s=config.env.step_timeout_s, import_modules=tuple(config.env.import_modules),
        )
        self._split_tasks()
        self.logger = (MetricLogger(self.workdir, tensorboard=config.train.tensorboard) if distributed.is_main()
                       else NoLogger())  # process 0 writes the run's logs
        self.checkpointer = RunCheckpointer(checkpoint_dir or self.workdir / "checkpoints",
                                            keep_last=config.train.keep_checkpoints)
        self.recorder = RolloutRecorder(self.workdir / "rollouts") if config.train.record_rollouts else None
        self.step = 0

    # -- data ------------------------------------------------------------------------------------------

    def _task_list(self, split: str) -> list[Any]:
        """A split's tasks, read from the environment's TFDS task dataset for these env arguments (built on first
        use); an env server given by URL lists its own."""
        env = self.config.env
        if env.remote:
            return list(self.pool.tasks(split))
        from environments.task_datasets import ensure_task_dataset, read_tasks

        ensure_task_dataset(env.name, dict(env.kwargs), tuple(env.import_modules))
        # every process reads the whole list (ids): a step's tasks are a function of (seed, step), then shared out
        return read_tasks(env.name, split, 0, 1, env_kwargs=dict(env.kwargs))

    def _split_tasks(self) -> None:
        config = self.config
        train = _filter_tasks(self._task_list("train"), config.env.train_subtasks)
        test = _filter_tasks(self._task_list("test"), config.env.test_subtasks)
        if config.data.train_task_limit:
            train = train[: config.data.train_task_limit]
        order = np.random.default_rng(config.train.seed).permutation(len(train))
        held = config.data.validation_tasks
        self.validation_tasks = [train[i] for i in order[:held]]  # held out of training, for checkpoint selection
        self.train_tasks = [train[i] for i in order[held:]]
        test_order = np.random.default_rng(config.train.seed + 1).permutation(len(test))
        limit = config.data.test_tasks or len(test)
        self.test_tasks = [test[i] for i in sorted(test_order[:limit])]
        if not self.train_tasks:
            raise ConfigError("no training tasks left after env.train_subtasks, data.train_task_limit and "
                              "data.validation_tasks; loosen those settings")
        if not self.test_tasks:
            raise ConfigError("no test tasks after env.test_subtasks; check the subtask names")

    def tasks_for_step(self, step: int) -> list[Any]:
        """The tasks of 1-based ``step``: consecutive slices of per-epoch permutations (a function of seed, step)."""
        per_step = self.config.data.tasks_per_step
        n = len(self.train_tasks)
        picked = []
        for flat in range((step - 1) * per_step, step * per_step):
            epoch, position = divmod(flat, n)
            order = np.random.default_rng([self.config.train.seed, epoch]).permutation(n)
            picked.append(self.train_tasks[order[position]])
        return picked

    def extra_tasks(self, step: int, round_index: int, count: int) -> list[Any]:
        """``count`` further training tasks for dynamic sampling's ``round_index`` (a function of seed, step, round)."""
        n = len(self.train_tasks)
        generator = np.random.default_rng([self.config.train.seed, step, round_index, 1])
        return [self.train_tasks[i] for i in generator.choice(n, size=count, replace=count > n)]

    def _step_keys(self, step: int) -> tuple[jax.Array, jax.Array]:
        key = jax.random.fold_in(jax.random.PRNGKey(self.config.train.seed), step)
        rollout_key, update_key = jax.random.split(key)
        return rollout_key, update_key

    # -- one step ----------------------------------------------------------------------------------------

    def rollout(self, tasks: Sequence[Any], samples: int, horizon: int, rng: jax.Array, greedy: bool = False,
                desc: str = "rollout", first_task: int | None = None) -> tuple[list[Trajectory], Any]:
        """Plays ``samples`` episodes of each task; group ids number the tasks.

        ``tasks`` is the global list, of which this process plays its share; or, with ``first_task``, this
        process's own tasks, numbered from ``first_task``.
        """
        if first_task is None:
            share = host_shards.episode_share(tasks, samples)
        else:
            share = host_shards.EpisodeShare([t for t in tasks for _ in range(samples)],
                                             [first_task + i for i in range(len(tasks)) for _ in range(samples)],
                                             first_task * samples)
        config = self.rollout_config
        if greedy:
            config = dataclasses.replace(config, temperature=0.0)
        bar = tqdm(total=horizon, desc=desc, leave=False, disable=not self._progress_bars)

        def progress(round_index: int, active: int, finished: int) -> None:
            bar.update(1)
            bar.set_postfix(active=active, done=finished)

        try:
            return run_rollout(self.sampler, self.pool, self.chat, share.tasks, share.group_ids, config, horizon, rng,
                               progress, episode_offset=share.episode_offset)
        finally:
            bar.close()

    def train_step(self, step: int) -> dict[str, float]:
        """Rollout on this step's tasks (with dynamic sampling: until enough groups carry signal), then one
        learner update over the batch."""
        data = self.config.data
        horizon = schedule.horizon_at(self.config.horizon, step)
        rollout_key, update_key = self._step_keys(step)
        t0 = time.perf_counter()
        stats = RolloutStats()

        def play(tasks: Sequence[Any], round_index: int) -> list[Trajectory]:
            key = rollout_key if round_index == 0 else jax.random.fold_in(rollout_key, round_index)
            desc = f"step {step} rollout" + (f" (round {round_index + 1})" if round_index else "")
            played, round_stats = self.rollout(tasks, data.samples_per_task, horizon, key, desc=desc)
            for field in dataclasses.fields(RolloutStats):
                setattr(stats, field.name, getattr(stats, field.name) + getattr(round_stats, field.name))
            return played

        metrics: dict[str, float] = {}
        if data.dynamic_sampling:
            collected = collect_groups_with_signal(
                play, self.tasks_for_step(step), lambda r, n: self.extra_tasks(step, r, n), data.tasks_per_step,
                data.dynamic_max_rounds, data.dynamic_oversample,
            )
            trajectories, train_on = collected.played, collected.kept
            metrics.update({"dynamic/rounds": collected.rounds, "dynamic/groups_played": collected.groups_played,
                            "dynamic/groups_kept": collected.groups_kept})
        else:
            trajectories = train_on = play(self.tasks_for_step(step), 0)
        t_rollout = time.perf_counter()
        update_metrics: dict[str, float] = {}
        if train_on:
            batch = host_shards.pack_local_batch(train_on, LENGTH_BUCKETS, self._batch_multiple(),
                                                 self.chat.pad_token_id)
            self.sampler.release_packed()  # the update's peak memory need not hold the sampler's packed weights
            update_metrics = self.learner.update(batch, update_key)
            self._point_sampler()
            metrics["rollout/batch_tokens"] = batch.num_rows * batch.seq_len * self.processes
        else:  # dynamic sampling found no group with signal: an update would only move the KL/entropy terms
            logging.warning("step %d: no group with reward variance after %d rounds; update skipped", step,
                            metrics["dynamic/rounds"])
            metrics["train/skipped_no_signal"] = 1.0
        t_train = time.perf_counter()
        local_trajectories = trajectories
        trajectories, stats = host_shards.gather_rollout(trajectories, stats)  # metrics cover every process
        metrics.update({f"train/{k}": v for k, v in update_metrics.items()})
        metrics.update(self._rollout_metrics(trajectories, prefix="rollout"))
        metrics.update(rollout_diagnostics(trajectories))
        metrics.update(learner_diagnostics(update_metrics))
        generated = max(stats.generated_tokens, 1)
        metrics.update({
            "horizon": horizon,
            "time/sampling_s": stats.sampling_s, "time/env_s": stats.env_s,
            "time/rollout_host_s": stats.host_s, "time/train_s": t_train - t_rollout,
            "time/step_s": t_train - t0,
            "rollout/generated_tokens": stats.generated_tokens,
            "rollout/generated_tokens_per_s": generated / max(stats.sampling_s, 1e-9),
            "rollout/env_steps_per_s": stats.env_steps / max(stats.env_s, 1e-9),
            "sampler/compilations": self.sampler.compilations - self._compilations_before,
            "memory/peak_rss_gb": peak_rss_gb()["peak_rss_gb"],
        })
        count = self.config.train.sample_log_count
        self.logger.write_samples(step, [_readable(t) for t in local_trajectories[:count]])
        if self.recorder is not None:
            self.recorder.write("train", step, local_trajectories, trained=train_on)
        return metrics

    @property
    def _progress_bars(self) -> bool:
        return bool(self.config.train.progress_bars) and distributed.is_main()

    def _point_sampler(self) -> None:
        """Points the sampler at the learner's parameters (this process's view of them: no copy)."""
        self.sampler.update_params(distributed.local_view(self.learner.policy_state, self.mesh))

    def _batch_multiple(self) -> int:
        algo = self.config.algo
        multiple = int(np.lcm(max(1, int(algo.minibatch_size or 1)), max(1, int(algo.microbatch_size or 1))))
        return int(np.lcm(multiple, sharding.batch_rows(self.mesh)))

    @staticmethod
    def _rollout_metrics(trajectories: Sequence[Trajectory], prefix: str) -> dict[str, float]:
        n = max(1, len(trajectories))
        metrics = {
            f"{prefix}/score": sum(t.score for t in trajectories) / n,
            f"{prefix}/success": sum(t.success for t in trajectories) / n,
            f"{prefix}/turns": sum(t.turns for t in trajectories) / n,
            f"{prefix}/agent_tokens": sum(t.num_agent_tokens for t in trajectories) / n,
            f"{prefix}/trajectory_tokens": sum(len(t.tokens) for t in trajectories) / n,
        }
        for reason in END_REASONS:
            metrics[f"{prefix}/end_{reason}"] = sum(t.end_reason == reason for t in trajectories) / n
        return metrics

    # -- evaluation --------------------------------------------------------------------------------------

    def evaluate(self, tasks: Sequence[Any], k: int | None = None, greedy: bool | None = None,
                 desc: str = "eval") -> tuple[dict[str, Any], list[Trajectory]]:
        """Avg@k / Pass@k of the current policy on ``tasks`` at the schedule's largest horizon."""
        k = k or self.config.eval.k
        greedy = self.config.eval.greedy if greedy is None else greedy
        horizon = self.config.eval.horizon or schedule.max_horizon(self.config.horizon)
        key = jax.random.PRNGKey(self.config.train.seed + 7919)
        trajectories: list[Trajectory] = []
        chunk = self.config.eval.batch_tasks
        # each process evaluates its part of the tasks; an episode's key is its global index (layout-independent)
        mine = np.array_split(np.arange(len(tasks)), self.processes)[jax.process_index()]
        for start in range(0, len(mine), chunk):
            part = mine[start: start + chunk]
            batch, _ = self.rollout([tasks[i] for i in part], k, horizon, key, greedy=greedy, desc=desc,
                                    first_task=int(part[0]))
            trajectories += batch
        trajectories = host_shards.gather_all(trajectories, "evaluation episodes")
        summary = evaluation.summarize(trajectories, k)
        summary["settings"] = self.rollout_settings(greedy=greedy, horizon=horizon)
        return summary, trajectories

    def rollout_settings(self, greedy: bool, horizon: int) -> dict[str, Any]:
        """What shapes an episode besides the policy: recorded with every evaluation so results stay comparable."""
        rollout = self.config.rollout
        return {
            "env": self.config.env.name, "env_kwargs": dict(self.config.env.kwargs),
            **({"env_server": self.pool.env_kwargs.get("base_url"), "env_profile": self.pool.env_kwargs.get("profile")}
               if self.config.env.remote else {}),
            "response_prefix": rollout.response_prefix, "stop_at_newline": bool(rollout.stop_at_newline),
            "stop_strings": list(rollout.stop_strings),
            "greedy": bool(greedy), "temperature": 0.0 if greedy else float(rollout.temperature),
            "top_p": float(rollout.top_p), "top_k": int(rollout.top_k), "horizon": int(horizon),
            "max_turn_tokens": int(rollout.max_turn_tokens), "system_prompt": rollout.system_prompt,
            "canned_reply": rollout.canned_reply,
        }

    # -- the loop ----------------------------------------------------------------------------------------

    def checkpoint_record(self) -> dict[str, Any]:
        return {"step": self.step, "seed": self.config.train.seed,
                "horizon": schedule.horizon_at(self.config.horizon, max(self.step, 1)),
                "config": json.loads(self.config.to_json_best_effort())}

    def save(self, eval_score: float | None = None) -> None:
        self.checkpointer.save(self.step, self.learner.checkpoint_state(), self.checkpoint_record(), eval_score)

    def maybe_resume(self) -> bool:
        """Restores the newest readable checkpoint; True if one was found."""
        restored = self.checkpointer.restore_latest(self.learner.checkpoint_state())
        if restored is None:
            return False
        step, state, record = restored
        self.learner.restore_checkpoint_state(state)
        self._point_sampler()
        self.step = int(record["step"])
        skipped = f" (skipped unreadable checkpoints {self.checkpointer.skipped})" if self.checkpointer.skipped else ""
        logging.warning("restored checkpoint %d from %s%s", step, self.checkpointer.directory, skipped)
        return True

    def fit(self, steps: int | None = None) -> list[dict[str, float]]:
        """Trains until ``config.train.steps`` (or ``steps`` more steps); returns the per-step metrics."""
        train = self.config.train
        last = train.steps if steps is None else self.step + steps
        history = []
        bar = tqdm(total=last, initial=self.step, desc="training", disable=not self._progress_bars)
        while self.step < last:
            self.step += 1
            metrics = self.train_step(self.step)
            eval_score = None
            if train.eval_every and self.step % train.eval_every == 0 and self.validation_tasks:
                summary, _ = self.evaluate(self.validation_tasks, desc=f"step {self.step} validation")
                k = summary["k"]
                eval_score = summary["overall"][f"avg@{k}"]
                metrics.update({"eval/score": eval_score, "eval/success": summary["overall"]["success_rate"],
                                "eval/turns": summary["overall"]["mean_turns"]})
            self.logger.write(self.step, metrics)
            self.signal_monitor.observe(metrics)
            history.append(metrics)
            if train.checkpoint_every and (self.step % train.checkpoint_every == 0 or self.step == last):
                self.save(eval_score)
            bar.update(1)
            bar.set_postfix(progress_fields(metrics))
        bar.close()
        self.checkpointer.wait()
        return history

    def export(self, out_dir: str | Path | None = None, overwrite: bool = True, adapter_only: bool = False) -> Path:
        """Writes the current policy as a Hugging Face directory (replacing only an earlier export of ours); a LoRA
        policy merged, or with ``adapter_only`` as a PEFT adapter directory."""
        out = Path(out_dir or self.workdir / "export")
        model = self.learner.policy_model()
        if self.processes > 1:  # this process's replica of the parameters: readable without the other hosts
            nnx.update(model, distributed.local_view(nnx.state(model), self.mesh))
        return hf.export_model(model, out, tokenizer_dir=self.model_dir, overwrite=overwrite,
                               adapter_only=adapter_only)

    def plot(self) -> Path:
        return plot_run(self.workdir)

    def close(self) -> None:
        self.checkpointer.close()
        self.logger.close()
        self.pool.close()


def _readable(trajectory: Trajectory) -> dict[str, Any]:
    return {"task_id": trajectory.task_id, "subtask": trajectory.subtask, "score": trajectory.score,
            "success": trajectory.success, "turns": trajectory.turns, "end_reason": trajectory.end_reason,
            "error": trajectory.error, "valid_actions": trajectory.valid_actions,
            "judged_actions": trajectory.judged_actions, "messages": trajectory.messages}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | Path | None = None,
                       resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """The whole run: optional test evaluation before, training, test evaluation after, export and plot.

    The run directory is claimed first (:mod:`agentgym_jax.run_dir`): a directory holding another run is
    refused unless ``resume`` (same config) or ``overwrite`` is set. On resume the logs are rewound to the
    restored step. Returns a report (also written to ``workdir/report.json``, and to ``config.train.report_path``
    if set).
    """
    started = time.perf_counter()
    validate_run_config(config)
    main = distributed.is_main()  # process 0 claims the directory and writes reports, plots and the export
    refusal = None
    if main:
        try:
            claim_run_directory(workdir or config.train.workdir, config, resume=resume, overwrite=overwrite)
        except ConfigError as error:
            refusal = str(error)
    refusal = distributed.allgather(refusal, "run directory claim")[0]  # every process stops on a refusal
    if refusal:
        raise ConfigError(refusal)
    trainer = Trainer(config, workdir)
    report: dict[str, Any] = {"workdir": str(trainer.workdir), "n_test_tasks": len(trainer.test_tasks)}
    try:
        if resume:
            if trainer.maybe_resume():
                report["resumed_from_step"] = trainer.step
            trainer.logger.rewind(trainer.step)  # drops rows logged after the checkpoint (all, if none was saved)
            if trainer.recorder is not None:
                trainer.recorder.rewind(trainer.step)
        if config.train.eval_before and trainer.step == 0:
            before, trajectories = trainer.evaluate(trainer.test_tasks, desc="test eval (before)")
            report["eval_before"] = before
            if main:
                _write_eval(trainer.workdir / "eval_before", before, trajectories)
            if trainer.recorder is not None:
                trainer.recorder.write("eval_before", 0, trajectories)
        trainer.fit()
        after, trajectories = trainer.evaluate(trainer.test_tasks, desc="test eval (after)")
        report["eval_after"] = after
        if main:
            _write_eval(trainer.workdir / "eval_after", after, trajectories)
        if trainer.recorder is not None:
            trainer.recorder.write("eval_after", trainer.step, trajectories)
        if config.train.export_final and main:
            report["export"] = str(trainer.export())
        if main:
            report["plot"] = str(trainer.plot())
    finally:
        trainer.close()
    report["minutes"] = (time.perf_counter() - started) / 60
    report.update(peak_rss_gb())
    if "eval_before" in report and "eval_after" in report:
        report["settings"] = report["eval_after"]["settings"]
        report["paired"] = evaluation.paired_outcomes(report["eval_before"], report["eval_after"])
    for key, name in (("eval_before", "before"), ("eval_after", "after")):
        if key in report:
            overall = report[key]["overall"]
            k = report[key]["k"]
            report[f"success_{name}"] = overall[f"pass@{k}"]
            report[f"wilson_{name}"] = overall["pass_wilson95"]
    if not main:
        return report
    atomic_write_text(Path(report["workdir"]) / "report.json", json.dumps(report, indent=2))
    if config.train.report_path:
        keys = ("success_before", "success_after", "wilson_before", "wilson_after", "n_test_tasks", "minutes",
                "paired", "peak_rss_gb", "peak_rss_children_gb", "settings")
        summary = {k: report[k] for k in keys if k in report}
        summary.update({"env": config.env.name, "train_subtasks": list(config.env.train_subtasks),
                        "steps": int(config.train.steps), "algorithm": config.algo.advantage_estimator,
                        "eval_k": int(config.eval.k), "eval_greedy": bool(config.eval.greedy)})
        atomic_write_text(config.train.report_path, json.dumps(summary, indent=2) + "\n")
    return report


def _write_eval(prefix: Path, summary: dict[str, Any], trajectories: Sequence[Trajectory]) -> None:
    lines = "".join(json.dumps(_readable(t), ensure_ascii=False) + "\n" for t in trajectories)
    atomic_write_text(prefix.with_suffix(".trajectories.jsonl"), lines)
    atomic_write_text(prefix.with_suffix(".md"), evaluation.markdown_table(summary))
    atomic_write_text(prefix.with_suffix(".json"), json.dumps(summary, indent=2) + "\n")
