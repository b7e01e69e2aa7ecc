"""The learner: optimizer, train state and the jitted, sharded PPO-style train step over trajectory batches.

One :meth:`Learner.update` call consumes one rollout batch:

1. host checks (shapes, mask, group sizes, divisibility by the minibatch/microbatch sizes and the mesh);
2. an experience pass, one micro-batch at a time: reference log-probs (frozen initial policy), recomputed
   behaviour log-probs (``old_logp_source='recompute'``) and critic values (PPO);
3. advantages and returns over the whole batch with the estimator named in the config;
4. ``ppo_epochs`` passes over the batch, each shuffled (with the given rng) into minibatches of
   ``minibatch_size`` trajectories; each minibatch is one optimizer update, its gradient accumulated exactly over
   micro-batches of ``microbatch_size`` rows (the loss denominator of the whole minibatch is computed first and
   every micro-batch's numerator is divided by it).

The policy parameters are the very arrays the sampler reads (``learner.policy_state``). With ``donate=True``
(the default) each update reuses their buffers in place, so after :meth:`Learner.update` re-point the sampler:
``sampler.update_params(learner.policy_state)``; the model object passed to the constructor no longer holds live
arrays then (use :meth:`Learner.policy_model`).

A minibatch whose loss or gradient is NaN/inf is skipped (parameters and optimizer states unchanged), counted in
the ``skipped_updates`` metric and logged as a warning. ``learner.step`` counts the optimizer updates applied.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax import advantages as adv_lib
from agentgym_jax import distributed, freezing, lora, packing, sharding
from agentgym_jax.batch import BatchError, TrajectoryBatch
from agentgym_jax.critic import Critic, copy_tree
from agentgym_jax.errors import CheckpointError, ConfigError
from agentgym_jax.learner_config import (  # noqa: F401 - re-exported: the learner's public settings
    LR_SCHEDULES, OLD_LOGP_SOURCES, LearnerConfig, learning_rate_schedule, make_optimizer,
)
from agentgym_jax.model import DecoderLM, Segments, abstract_model
from agentgym_jax.train_step import StepParts, experience_program, train_step_program
from agentgym_jax.update_metrics import batch_stats, summarize_update
from agentgym_jax.policy_objective import (  # noqa: F401 - re-exported for callers of the learner module
    AGENT_POSITION_BUCKETS, TrainingBatch, _accumulated_grads, _keep_if, agent_positions, loss_denominator,
    policy_loss, policy_loss_terms, selected_logprobs, to_token_positions, token_logprobs,
    token_logprobs_from_logits, unembedding, value_loss,
)

log = logging.getLogger(__name__)

Array = jax.Array
TRAIN_STEP_NAME = "_learner_train_step"
EXPERIENCE_NAME = "_learner_experience"



class Learner:
    """Owns the policy (and critic) parameters, their optimizer states and the frozen reference policy."""

    def __init__(self, model: DecoderLM, config: LearnerConfig, mesh: Mesh | None = None):
        config.validate()
        self.config = config
        self.mesh = mesh
        if mesh is not None:
            sharding.check_model_fits_mesh(model.config, mesh)
        # In a multi-process run every process passes its own rows; the global batch is their concatenation.
        self._processes = jax.process_count()
        if self._processes > 1:
            if mesh is None or mesh.devices.size != jax.device_count():
                raise ConfigError("a multi-process learner needs a mesh over every process's devices; set mesh.shape "
                                  f"to axis sizes whose product is {jax.device_count()}")
            if config.pack_rows:
                raise ConfigError("pack_rows=True is single-process for now (it lays rows out on the host); set "
                                  "algo.pack_rows=False for a multi-process run")
        self._estimator = adv_lib.get_estimator(config.advantage_estimator)
        self._graphdef, policy = nnx.split(model)
        self._policy = self._commit(policy)
        non_params = [k for k, v in nnx.to_flat_state(self._policy) if not isinstance(v, nnx.Param)]
        if non_params:
            raise ConfigError(f"the policy holds non-parameter state {non_params[:3]}; the learner trains Params only")
        self._lora = model.config.lora_rank > 0  # train the adapters only; the base is also the KL reference
        if self._lora and config.uses_critic:
            raise ConfigError("LoRA policies train with critic-free estimators (grpo, rloo, reinforce_pp); a critic "
                              "would be a full copy of the model. Set lora_rank=0 or another advantage_estimator")
        frozen = freezing.frozen_layer_count(model.config.num_hidden_layers, config.trainable_layers)
        train_model_config = dataclasses.replace(
            model.config, dtype=config.compute_dtype or model.config.dtype, frozen_layers=frozen,
            remat=model.config.remat if config.remat is None else config.remat)
        self._train_graphdef = nnx.split(abstract_model(train_model_config))[0]
        self._optimizer, self._schedule = make_optimizer(config, config.learning_rate, config.warmup_steps)
        if frozen or config.freeze_embeddings:
            self._optimizer = freezing.freeze_layers(self._optimizer, frozen, config.freeze_embeddings)
        # Nothing below the frozen layers trains: their output is fixed through a step, so prepare() computes it
        # once and every update starts from it.
        self._cache_trunk = bool(frozen) and config.freeze_embeddings
        with sharding.use_mesh(mesh):
            self._opt_state = self._commit(jax.jit(self._optimizer.init)(self._trainable(self._policy)[0]))
        # Under LoRA the reference is the policy with its adapters zeroed (lora.without_adapters): no copy.
        self._reference = copy_tree(self._policy) if config.use_reference and not self._lora else None
        self._critic = self._critic_opt = self._critic_graphdef = None
        self._critic_optimizer = self._critic_schedule = None
        if config.uses_critic:
            _, critic = nnx.split(Critic.from_policy(model, mesh))
            self._critic = self._commit(critic)
            self._critic_graphdef = nnx.split(nnx.eval_shape(lambda: Critic(train_model_config, nnx.Rngs(0))))[0]
            self._critic_optimizer, self._critic_schedule = make_optimizer(
                config, config.critic_learning_rate, config.critic_warmup_steps
            )
            with sharding.use_mesh(mesh):
                self._critic_opt = self._commit(jax.jit(self._critic_optimizer.init)(self._critic))
        self._step = 0
        self._updates_called = 0
        self._gradients_program = None
        self._build_programs()

    # ---------------------------------------------------------------------------------------- public state

    @property
    def policy_state(self) -> nnx.State:
        """The policy's parameters (``nnx.split(model)[1]`` layout): the arrays the Sampler reads."""
        return self._policy

    @property
    def critic_state(self) -> nnx.State | None:
        """The critic's parameters (None without a critic)."""
        return self._critic

    @property
    def reference_state(self) -> nnx.State | None:
        """The frozen reference policy's parameters (None when ``use_reference=False``)."""
        return self._reference

    @property
    def step(self) -> int:
        """Optimizer updates applied so far (skipped and empty minibatches not counted)."""
        return self._step

    def policy_model(self) -> DecoderLM:
        """The policy as a ``DecoderLM`` (the model's own numerics), sharing the learner's arrays."""
        return nnx.merge(self._graphdef, self._policy)

    def critic_model(self) -> Critic | None:
        """The critic as a module (None without one)."""
        if self._critic is None:
            return None
        return nnx.merge(self._critic_graphdef, self._critic)

    def learning_rate(self, step: int | None = None) -> float:
        """The policy learning rate at optimizer update ``step`` (default: the next one)."""
        return float(self._schedule(self._step if step is None else step))

    # ---------------------------------------------------------------------------------------- programs

    def _build_programs(self) -> None:
        config = self.config
        self._experience = jax.jit(experience_program(config, self._train_graphdef, self._critic_graphdef,
                                                      self._lora))
        parts = StepParts(
            config=config, train_graphdef=self._train_graphdef, critic_graphdef=self._critic_graphdef,
            split_trainable=functools.partial(split_trainable, use_lora=self._lora), optimizer=self._optimizer,
            schedule=self._schedule,
            critic_optimizer=self._critic_optimizer, critic_schedule=self._critic_schedule,
            param_shardings=self._shardings(self._policy), critic_shardings=self._shardings(self._critic))
        self._train_step = jax.jit(train_step_program(parts), donate_argnums=(0, 1, 2, 3) if config.donate else ())
        self._advantages = jax.jit(functools.partial(
            adv_lib.compute_advantages, config.advantage_estimator, **config.resolved_estimator_options()))
        self._gather_minibatch = jax.jit(functools.partial(minibatch_from_global, self.mesh), static_argnums=(2,))
        self._trunk = jax.jit(functools.partial(trunk_of, self._train_graphdef)) if self._cache_trunk else None

    def _commit(self, tree: Any) -> Any:
        """Pins every array to its device(s), so jit sees the same argument placement on every call."""
        device = None if self.mesh is not None else jax.devices()[0]
        return jax.tree.map(lambda x: jax.device_put(x, device or x.sharding), tree)

    def _shardings(self, tree: Any) -> Any:
        if self.mesh is None or tree is None:
            return None
        return jax.tree.map(lambda x: x.sharding, tree)

    def _put(self, array: np.ndarray, stacked: bool) -> Array:
        """Places a host array with its rows split over the mesh's batch axes (leading micro-batch axis kept)."""
        if self.mesh is None:
            return jnp.asarray(array)
        rows = (None,) if stacked else ()
        spec = P(*rows, sharding.BATCH, *([None] * (array.ndim - len(rows) - 1)))
        return distributed.global_rows(array, self.mesh, spec)  # this process's rows of the global array

    # ---------------------------------------------------------------------------------------- sizes and checks

    def _sizes(self, batch: TrajectoryBatch) -> tuple[int, int]:
        rows = batch.num_rows * self._processes
        minibatch = self.config.minibatch_size or rows
        micro = self.config.microbatch_size or minibatch
        if rows % minibatch:
            raise BatchError(
                f"the batch has {rows} rows, not a multiple of minibatch_size={minibatch}; pad it with "
                f"batch.pad_rows({-(-rows // minibatch) * minibatch}) (padding rows have valid=0) or change "
                "minibatch_size"
            )
        if minibatch % micro:
            raise BatchError(f"minibatch of {minibatch} rows is not a multiple of microbatch_size={micro}")
        if self.mesh is not None:
            try:
                sharding.check_batch_fits_mesh(micro, self.mesh)
            except ConfigError as error:
                raise BatchError(f"micro-batch size: {error}") from None
        return minibatch, micro

    def _check(self, batch: TrajectoryBatch) -> np.ndarray:
        batch.validate()
        mask = batch.effective_loss_mask()
        if not any(distributed.allgather(bool((mask > 0).any()), "loss-mask check")):
            raise BatchError(
                "the batch's loss mask is all zero (after dropping valid=0 rows): it has no agent tokens to train "
                "on; check that the rollout marks the agent's sampled tokens with loss_mask=1"
            )
        try:
            adv_lib.check_estimator_inputs(self.config.advantage_estimator, np.asarray(batch.group_ids), mask)
        except adv_lib.AdvantageError as error:
            raise BatchError(str(error)) from None
        if "step_states" in self._estimator.requires and batch.step_states is None:
            raise BatchError(f"advantage_estimator={self.config.advantage_estimator!r} needs per-turn data "
                             "(turn_ids, step_rewards, step_states); build the batch with "
                             "trajectory_packing.pack_trajectories")
        return mask

    # ---------------------------------------------------------------------------------------- experience

    def prepare(self, batch: TrajectoryBatch) -> TrainingBatch:
        """The per-token training inputs of a batch (host arrays): the experience forward one micro-batch at a
        time (reference log-probs, recomputed old log-probs, critic values, the frozen layers' output when it is
        fixed through the step), reward shaping, then the estimator on the whole batch."""
        batch = batch.to_numpy()
        mask = self._check(batch)
        _, micro = self._sizes(batch)
        local_micro = micro // self._processes  # each process feeds its share of every micro-batch
        tokens = batch.tokens
        largest = int((mask > 0).sum(axis=1).max(initial=0))
        positions = agent_positions(mask, max(distributed.allgather(largest, "agent-token counts")))
        if self.config.pack_rows:  # single-process (checked): each group's shared prompt computed once
            experience = packing.packed_per_token(tokens, mask, np.asarray(batch.group_ids),
                                                  packing.row_lengths(tokens.shape[1]), local_micro * tokens.shape[1],
                                                  sharding.batch_rows(self.mesh), self._packed_experience)
        else:
            experience = self._padded_experience(tokens, positions, local_micro)
        on = mask > 0
        on_mask = lambda x: None if x is None else np.where(on, x, 0.0).astype(np.float32)  # noqa: E731
        old_logp = on_mask(experience.get("old_logp", batch.old_logp))
        ref_logp, values = on_mask(experience.get("ref_logp")), on_mask(experience.get("values"))
        scores = batch.scores
        config = self.config
        if config.overlong_buffer:
            scores = scores - adv_lib.overlong_penalty(mask.sum(axis=-1), config.overlong_max_tokens,
                                                       config.overlong_buffer, config.overlong_penalty)
        inputs = dict(scores=scores, loss_mask=mask, group_ids=batch.group_ids, old_logp=old_logp,
                      ref_logp=ref_logp, values=values, turn_ids=batch.turn_ids, step_rewards=batch.step_rewards,
                      step_states=batch.step_states)
        inputs = {k: v for k, v in inputs.items() if v is not None}
        if self._processes > 1:  # batch-wide statistics (e.g. REINFORCE++'s normalization) span every process
            inputs = {k: self._put(np.asarray(v), False) for k, v in inputs.items()}
        with sharding.use_mesh(self.mesh):
            advantages, returns = map(distributed.local_rows, self._advantages(**inputs))
        return TrainingBatch(tokens=tokens, positions=positions, loss_mask=mask, old_logp=old_logp,
                             advantages=np.asarray(advantages), returns=np.asarray(returns), scores=scores,
                             valid=batch.valid, ref_logp=ref_logp, old_values=values,
                             trunk=experience.get("trunk"))

    def _padded_experience(self, tokens: np.ndarray, positions: np.ndarray, rows: int) -> dict[str, np.ndarray]:
        """The experience pass (and the trunk) over the padded rows, ``rows`` at a time."""
        parts: dict[str, list[np.ndarray]] = {}
        with sharding.use_mesh(self.mesh):
            for start in range(0, tokens.shape[0], rows):
                row_tokens, take = self._put(tokens[start:start + rows], False), slice(start, start + rows)
                out = self._experience(self._policy, self._reference, self._critic, row_tokens,
                                       self._put(positions[take], False))
                if self._trunk is not None:
                    out["trunk"] = self._trunk(self._policy, row_tokens)
                for key, value in out.items():
                    parts.setdefault(key, []).append(distributed.local_rows(value))
        return {k: np.concatenate(v) for k, v in parts.items()}

    def _packed_experience(self, tokens: np.ndarray, rope_positions: np.ndarray, blocks: np.ndarray,
                           branches: np.ndarray, positions: np.ndarray, sources: np.ndarray) -> dict[str, Array]:
        """The experience pass (and the trunk) over packed rows (:func:`packing.packed_per_token`)."""
        with sharding.use_mesh(self.mesh):
            put = lambda x: self._put(x, False)  # noqa: E731
            segments = tuple(map(put, (rope_positions, blocks, branches)))
            out = self._experience(self._policy, self._reference, self._critic, put(tokens), put(positions),
                                   (*segments, put(sources)))
            if self._trunk is not None:
                out["trunk"] = self._trunk(self._policy, put(tokens), *segments)
        return out

    # ---------------------------------------------------------------------------------------- update

    def _put_replicated(self, array: np.ndarray) -> Array:
        return jax.device_put(array, NamedSharding(self.mesh, P()))

    def _minibatch_order(self, rng: jax.Array, valid_rows: np.ndarray, group_ids: np.ndarray,
                         num_minibatches: int) -> list[np.ndarray]:
        """Row indices of each minibatch: real rows shuffled and dealt round-robin, then padding rows. With
        ``group_minibatches`` the groups are shuffled instead and dealt whole, in order, ``len // num_minibatches``
        rows per minibatch (a group larger than the room left spills into the next)."""
        seed = np.asarray(jax.random.key_data(rng) if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) else rng)
        generator = np.random.default_rng(seed.astype(np.uint32).ravel().tolist())
        real, padding = np.flatnonzero(valid_rows), np.flatnonzero(~valid_rows)
        if not self.config.group_minibatches:
            order = np.concatenate([generator.permutation(real), generator.permutation(padding)])
            return [np.sort(order[i::num_minibatches]) for i in range(num_minibatches)]
        groups = np.unique(group_ids[real])
        rank = dict(zip(groups.tolist(), generator.permutation(len(groups)).tolist()))
        real = np.asarray(sorted(real.tolist(), key=lambda row: (rank[int(group_ids[row])], row)), np.int64)
        order = np.concatenate([real, generator.permutation(padding)])
        return [np.sort(part) for part in np.split(order, num_minibatches)]

    def _stack(self, prepared: TrainingBatch, index: np.ndarray, group_ids: np.ndarray, minibatch: int,
               micro: int) -> tuple[TrainingBatch, int]:
        """One minibatch as device arrays with a leading micro-batch axis, and the token positions it holds."""
        if not self.config.pack_rows:
            stack = prepared.map(lambda x: self._put(x[index].reshape(minibatch // micro, micro, *x.shape[1:]), True))
            return stack, minibatch * prepared.tokens.shape[1]
        width = prepared.tokens.shape[1]
        lengths = packing.row_lengths(width)
        packed = packing.pack_training_batch(prepared.map(lambda x: x[index]), group_ids[index], lengths,
                                             max_block=lengths[-1])
        rows, length = packed.tokens.shape
        # at most `micro` padded rows' positions per micro-batch
        per_micro = packing.rows_per_call_for(rows, length, micro * width, sharding.batch_rows(self.mesh))
        count = 1 << (-(-rows // per_micro) - 1).bit_length()
        packed = packing.pad_rows(packed, count * per_micro)
        return packed.map(lambda x: self._put(x.reshape(count, per_micro, *x.shape[1:]), True)), rows * length

    def update(self, batch: TrajectoryBatch, rng: jax.Array) -> dict[str, float]:
        """Trains on one rollout batch: ``ppo_epochs`` shuffled passes of minibatch updates. Returns metrics."""
        started = time.perf_counter()
        prepared = self.prepare(batch)
        minibatch, micro = self._sizes(batch)
        rows = prepared.tokens.shape[0] * self._processes
        num_minibatches = rows // minibatch
        # the shuffle is over the global rows (every process's rows, in process order): the same minibatches
        # however many processes hold them
        real_rows = np.concatenate(distributed.allgather(prepared.loss_mask.any(axis=-1), "real rows"))
        group_ids = np.asarray(batch.group_ids)
        global_groups = group_ids
        if self.config.group_minibatches and self._processes > 1:  # only whole-group dealing reads them
            global_groups = np.concatenate(distributed.allgather(group_ids, "group ids"))
        step_metrics = []
        positions = 0
        with sharding.use_mesh(self.mesh):
            full = prepared.map(lambda x: self._put(x, False)) if self._processes > 1 else None
            for epoch in range(self.config.ppo_epochs):
                # packing changes how a minibatch is laid out, never which trajectories it holds
                order = self._minibatch_order(jax.random.fold_in(rng, epoch), real_rows, global_groups,
                                              num_minibatches)
                for index in order:
                    if full is not None:
                        stack = self._gather_minibatch(full, self._put_replicated(index), micro)
                        held = minibatch * prepared.tokens.shape[1]
                    else:
                        stack, held = self._stack(prepared, index, group_ids, minibatch, micro)
                    positions += held
                    self._policy, self._opt_state, self._critic, self._critic_opt, metrics = self._train_step(
                        self._policy, self._opt_state, self._critic, self._critic_opt, stack, jnp.int32(self._step)
                    )
                    metrics = jax.tree.map(distributed.replicated_value, metrics)
                    applied = bool(metrics["applied"])
                    self._step += int(applied)
                    step_metrics.append(metrics)
        self._updates_called += 1
        elapsed = time.perf_counter() - started
        stats = distributed.allgather(batch_stats(prepared), "batch statistics")
        result = summarize_update(step_metrics, stats, elapsed, positions // self.config.ppo_epochs,
                                  self.config.ppo_epochs)
        result["step"] = float(self._step)
        if result["skipped_updates"]:
            log.warning(
                "skipped %d of %d optimizer updates: non-finite loss or gradient (parameters left unchanged)",
                int(result["skipped_updates"]), len(step_metrics),
            )
        return result

    # ---------------------------------------------------------------------------------------- gradients (debug)

    def gradients(self, batch: TrajectoryBatch) -> tuple[nnx.State, dict[str, float]]:
        """The policy gradient of the whole batch as one minibatch at the current parameters (no update).

        Uses the train step's own accumulation over micro-batches of ``microbatch_size`` rows; for checks.
        """
        prepared = self.prepare(batch)
        _, micro = self._sizes(batch)
        rows = batch.num_rows
        if self._gradients_program is None:
            config, graphdef = self.config, self._train_graphdef
            split = functools.partial(split_trainable, use_lora=self._lora)

            def _learner_gradients(policy: Any, stack: TrainingBatch) -> tuple[Any, dict[str, Array]]:
                mask = stack.loss_mask
                denominator = loss_denominator(config.loss_aggregation, mask.reshape(-1, mask.shape[-1]))
                loss_fn = functools.partial(policy_loss, config=config)
                trainable, fixed = split(policy)
                return _accumulated_grads(loss_fn, graphdef, trainable, stack, denominator, fixed)

            self._gradients_program = jax.jit(_learner_gradients)
        with sharding.use_mesh(self.mesh):
            stack = prepared.map(lambda x: self._put(x.reshape(rows // micro, micro, *x.shape[1:]), True))
            grads, aux = self._gradients_program(self._policy, stack)
        return grads, {k: float(v) for k, v in jax.device_get(aux).items()}

    # ---------------------------------------------------------------------------------------- checkpoints

    def _trainable(self, policy: nnx.State) -> tuple[nnx.State, nnx.State | None]:
        return split_trainable(policy, self._lora)

    def _trees(self) -> dict[str, Any]:
        # Under LoRA a checkpoint holds the adapters and their optimizer state; the base comes from model.path.
        trees = {"policy": self._trainable(self._policy)[0], "policy_opt": self._opt_state}
        if self._reference is not None:
            trees["reference"] = self._reference
        if self._critic is not None:
            trees["critic"], trees["critic_opt"] = self._critic, self._critic_opt
        return trees

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything for an exact resume, as a flat ``{name: array}`` dict (orbax-friendly).

        Keys are ``<part>/<dotted path>`` for the policy, its optimizer state, the reference policy and the
        critic with its optimizer state, plus ``step``. The arrays are the live ones (save before the next update
        when ``donate=True``).
        """
        flat: dict[str, Any] = {}
        for part, tree in self._trees().items():
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                flat[f"{part}/{sharding.path_to_str(path)}"] = leaf
        flat["step"] = np.asarray(self._step, np.int64)
        return flat

    def restore_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`checkpoint_state` returned (arrays placed with the current shardings)."""
        expected = self.checkpoint_state()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"learner checkpoint does not match this learner: missing {missing[:5]} ({len(missing)}), "
                f"unexpected {unexpected[:5]} ({len(unexpected)}); restore with the same LearnerConfig "
                "(estimator, use_reference) and model"
            )
        restored = {}
        for part, tree in self._trees().items():
            paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
            leaves = []
            for path, current in paths_leaves:
                key = f"{part}/{sharding.path_to_str(path)}"
                value = state[key]
                if tuple(np.shape(value)) != tuple(current.shape):
                    raise CheckpointError(
                        f"{key} has shape {np.shape(value)} in the checkpoint, expected {current.shape}")
                if not isinstance(value, jax.Array):
                    value = np.asarray(jax.device_get(value))
                value = value.astype(current.dtype)
                leaves.append(jax.device_put(value, current.sharding))
            restored[part] = jax.tree_util.tree_unflatten(treedef, leaves)
        policy = restored["policy"]
        if self._lora:
            policy = nnx.merge_state(policy, self._trainable(self._policy)[1])
        self._policy, self._opt_state = policy, restored["policy_opt"]
        self._reference = restored.get("reference")
        if self._critic is not None:
            self._critic, self._critic_opt = restored["critic"], restored["critic_opt"]
        self._step = int(np.asarray(state["step"]))


# The learner's programs hold these module functions, not bound methods: a program holding the learner would keep
# it (and its arrays) alive in a reference cycle until the next garbage collection.

def split_trainable(policy: nnx.State, use_lora: bool) -> tuple[nnx.State, nnx.State | None]:
    """(what the optimizer trains, the rest): (adapters, base weights) under LoRA, else (policy, None)."""
    if not use_lora:
        return policy, None
    return nnx.split_state(policy, lora.LoRAParam, ...)


def trunk_of(graphdef: Any, policy: nnx.State, tokens: Array, positions: Array | None = None,
             blocks: Array | None = None, branches: Array | None = None) -> Array:
    """The policy's hidden states after its frozen layers for ``tokens`` (:meth:`DecoderLM.trunk`), of packed rows
    when given their RoPE ``positions`` and segments (``blocks``, ``branches``)."""
    segments = None if blocks is None else Segments(blocks, branches)
    return nnx.merge(graphdef, policy).trunk(tokens, positions, segments)


def minibatch_from_global(mesh: Mesh | None, full: TrainingBatch, index: Array, micro: int) -> TrainingBatch:
    """The rows ``index`` of a global batch, stacked into micro-batches split over the mesh (the rows move between
    hosts inside the program)."""
    def take(x: Array) -> Array:
        picked = x[index].reshape(-1, micro, *x.shape[1:])
        spec = P(None, sharding.BATCH, *([None] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(picked, NamedSharding(mesh, spec))

    return full.map(take)
