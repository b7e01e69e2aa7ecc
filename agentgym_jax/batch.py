"""The trajectory batch the learner trains on: right-padded token rows with their loss mask and outcome.

One row per trajectory, ``[B, T]`` right-padded:

* ``tokens`` int32 ``[B, T]``: the whole conversation (prompt, agent turns, environment observations);
* ``loss_mask`` float32 ``[B, T]``: 1 where token t was sampled by the agent (its end-of-turn token included),
  0 on the system prompt, environment observations, chat-template glue and padding. The log-prob of token t
  comes from the logits at position t-1, so ``loss_mask[:, 0]`` must be 0;
* ``old_logp`` float32 ``[B, T]``: the sampler's log-prob of each agent token (0 elsewhere);
* ``scores`` float32 ``[B]``: the outcome reward of each trajectory (estimators needing a per-token reward place
  it on the row's last agent token);
* ``group_ids`` int32 ``[B]``: trajectories sampled for the same task share an id (GRPO/RLOO groups);
* ``valid`` float32 ``[B]``: 0 for padding rows added to fill a shape bucket; they take part in no statistic.

Optional, for step-level estimators (GiGPO), ``S`` the most turns of any row:

* ``turn_ids`` int32 ``[B, T]``: the turn each agent token belongs to (0-based), -1 elsewhere;
* ``step_rewards`` float32 ``[B, S]``: the reward each turn earned (increments of the outcome score);
* ``step_states`` int32 ``[B, S]``: an id of the environment state each turn acted in, -1 past the last turn.

Attention is causal over each row; since rows are right-padded, a real token never attends to padding, so no
separate attention mask is needed. Reference log-probs and critic values are computed by the learner itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from agentgym_jax.errors import AgentGymError


class BatchError(AgentGymError, ValueError):
    """A trajectory batch has the wrong shapes, dtypes or mask values, or nothing to train on."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrajectoryBatch:
    """Right-padded trajectories and their outcomes (numpy or jax arrays; see the module docstring)."""

    tokens: Any
    loss_mask: Any
    old_logp: Any
    scores: Any
    group_ids: Any
    valid: Any
    turn_ids: Any = None
    step_rewards: Any = None
    step_states: Any = None

    @classmethod
    def create(
        cls,
        tokens: Any,
        loss_mask: Any,
        scores: Any,
        group_ids: Any,
        old_logp: Any | None = None,
        valid: Any | None = None,
        turn_ids: Any | None = None,
        step_rewards: Any | None = None,
        step_states: Any | None = None,
    ) -> "TrajectoryBatch":
        """A validated numpy batch; ``old_logp`` defaults to zeros and ``valid`` to all ones."""
        tokens = np.asarray(tokens)
        rows = tokens.shape[0] if tokens.ndim else 0
        optional = lambda x, dtype: None if x is None else np.asarray(x, dtype)  # noqa: E731
        batch = cls(
            tokens=tokens.astype(np.int32),
            loss_mask=np.asarray(loss_mask, np.float32),
            old_logp=np.zeros(tokens.shape, np.float32) if old_logp is None else np.asarray(old_logp, np.float32),
            scores=np.asarray(scores, np.float32),
            group_ids=np.asarray(group_ids).astype(np.int32),
            valid=np.ones((rows,), np.float32) if valid is None else np.asarray(valid, np.float32),
            turn_ids=optional(turn_ids, np.int32), step_rewards=optional(step_rewards, np.float32),
            step_states=optional(step_states, np.int32),
        )
        batch.validate()
        return batch

    @classmethod
    def from_rows(
        cls,
        token_rows: Sequence[Sequence[int]],
        mask_rows: Sequence[Sequence[float]],
        scores: Sequence[float],
        group_ids: Sequence[int],
        logp_rows: Sequence[Sequence[float]] | None = None,
        seq_len: int | None = None,
        num_rows: int | None = None,
        pad_id: int = 0,
    ) -> "TrajectoryBatch":
        """Right-pads ragged rows to ``seq_len`` (default: the longest row) and ``num_rows`` (valid=0 rows)."""
        if not (len(token_rows) == len(mask_rows) == len(scores) == len(group_ids)):
            raise BatchError(
                f"from_rows needs one entry per trajectory in every argument; got {len(token_rows)} token rows, "
                f"{len(mask_rows)} mask rows, {len(scores)} scores and {len(group_ids)} group ids"
            )
        lengths = [len(r) for r in token_rows]
        longest = max(lengths, default=0)
        seq_len = longest if seq_len is None else seq_len
        if longest > seq_len:
            raise BatchError(f"a row has {longest} tokens, more than seq_len={seq_len}; raise seq_len")
        num_rows = len(token_rows) if num_rows is None else num_rows
        if num_rows < len(token_rows):
            raise BatchError(f"num_rows={num_rows} is smaller than the {len(token_rows)} trajectories given")
        tokens = np.full((num_rows, seq_len), pad_id, np.int32)
        mask = np.zeros((num_rows, seq_len), np.float32)
        logp = np.zeros((num_rows, seq_len), np.float32)
        for b, row in enumerate(token_rows):
            if len(mask_rows[b]) != len(row):
                raise BatchError(f"row {b} has {len(row)} tokens but {len(mask_rows[b])} mask values")
            tokens[b, : len(row)] = row
            mask[b, : len(row)] = mask_rows[b]
            if logp_rows is not None:
                if len(logp_rows[b]) != len(row):
                    raise BatchError(f"row {b} has {len(row)} tokens but {len(logp_rows[b])} log-probs")
                logp[b, : len(row)] = logp_rows[b]
        padded = num_rows - len(token_rows)
        return cls.create(
            tokens, mask,
            scores=np.concatenate([np.asarray(scores, np.float32), np.zeros((padded,), np.float32)]),
            group_ids=np.concatenate([np.asarray(group_ids, np.int32), np.full((padded,), -1, np.int32)]),
            old_logp=logp,
            valid=np.concatenate([np.ones((len(token_rows),), np.float32), np.zeros((padded,), np.float32)]),
        )

    @property
    def num_rows(self) -> int:
        """Rows ``B`` (padding rows included)."""
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        """Token positions per row ``T``."""
        return int(self.tokens.shape[1])

    def to_numpy(self) -> "TrajectoryBatch":
        """The same batch with every field as a host numpy array."""
        return jax.tree.map(np.asarray, self)

    def validate(self) -> None:
        """Raises :class:`BatchError` naming the field for a wrong shape, dtype or mask value."""
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 2 or tokens.shape[1] < 2:
            raise BatchError(f"tokens must be [B, T] with T >= 2, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise BatchError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        rows, length = tokens.shape
        for name in ("loss_mask", "old_logp"):
            shape = np.shape(getattr(self, name))
            if shape != (rows, length):
                raise BatchError(f"{name} must have the shape of tokens {(rows, length)}, got {shape}")
        for name in ("scores", "group_ids", "valid"):
            shape = np.shape(getattr(self, name))
            if shape != (rows,):
                raise BatchError(f"{name} must be [B] = ({rows},), got {shape}")
        mask = np.asarray(self.loss_mask)
        if not np.isin(mask, (0.0, 1.0)).all():
            raise BatchError("loss_mask must hold only 0 and 1")
        if (mask[:, 0] != 0).any():
            raise BatchError(
                "loss_mask[:, 0] must be 0: the log-prob of token t comes from the logits at t-1, so the first "
                "token of a row cannot be trained on; start every row with the prompt"
            )
        valid = np.asarray(self.valid)
        if not np.isin(valid, (0.0, 1.0)).all():
            raise BatchError("valid must hold only 0 (padding row) and 1 (real trajectory)")
        steps = [name for name in ("turn_ids", "step_rewards", "step_states") if getattr(self, name) is not None]
        if steps and len(steps) != 3:
            raise BatchError(f"turn_ids, step_rewards and step_states go together; got only {steps}")
        if steps:
            if np.shape(self.turn_ids) != (rows, length):
                raise BatchError(f"turn_ids must have the shape of tokens {(rows, length)}, "
                                 f"got {np.shape(self.turn_ids)}")
            if np.ndim(self.step_rewards) != 2 or np.shape(self.step_rewards) != np.shape(self.step_states) \
                    or np.shape(self.step_rewards)[0] != rows:
                raise BatchError(f"step_rewards and step_states must both be [B, S] with B={rows}, got "
                                 f"{np.shape(self.step_rewards)} and {np.shape(self.step_states)}")
            if int(np.max(self.turn_ids, initial=-1)) >= np.shape(self.step_rewards)[1]:
                raise BatchError("turn_ids refer to turns beyond step_rewards' S columns")

    def effective_loss_mask(self) -> np.ndarray:
        """``loss_mask`` with padding rows (``valid == 0``) zeroed, as a numpy array."""
        return np.asarray(self.loss_mask, np.float32) * np.asarray(self.valid, np.float32)[:, None]

    def num_agent_tokens(self) -> int:
        """Agent tokens in real rows."""
        return int(self.effective_loss_mask().sum())

    def pad_rows(self, num_rows: int) -> "TrajectoryBatch":
        """Appends ``valid == 0`` padding rows up to ``num_rows`` (e.g. a multiple of the minibatch size)."""
        batch = self.to_numpy()
        extra = num_rows - batch.num_rows
        if extra < 0:
            raise BatchError(f"cannot pad a batch of {batch.num_rows} rows down to {num_rows}")
        if extra == 0:
            return batch

        def grow(x: np.ndarray, fill: float) -> np.ndarray:
            return np.concatenate([x, np.full((extra,) + x.shape[1:], fill, x.dtype)])

        fills = dict(tokens=0, loss_mask=0, old_logp=0, scores=0, group_ids=-1, valid=0, turn_ids=-1,
                     step_rewards=0, step_states=-1)
        return TrajectoryBatch(**{name: None if getattr(batch, name) is None else grow(getattr(batch, name), fill)
                                  for name, fill in fills.items()})

    def select(self, rows: Sequence[int] | np.ndarray) -> "TrajectoryBatch":
        """The rows at ``rows`` (numpy indexing), as a new numpy batch."""
        index = np.asarray(rows)
        return jax.tree.map(lambda x: np.asarray(x)[index], self)
