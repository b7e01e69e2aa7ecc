"""What a rollout is configured with and what it produces: its limits (:class:`RolloutConfig`), the episodes as
token ids with loss masks and behaviour log-probs (:class:`Trajectory`), and its timings (:class:`RolloutStats`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from agentgym_jax.errors import ConfigError
from agentgym_jax.sampling import SamplingParams

END_DONE, END_HORIZON, END_BUDGET, END_ENV_ERROR = "done", "horizon", "budget", "env_error"
END_REASONS = (END_DONE, END_HORIZON, END_BUDGET, END_ENV_ERROR)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Limits and prompt layout of a rollout."""

    max_turn_tokens: int = 64  # generated tokens per agent turn
    max_trajectory_tokens: int = 2048  # whole sequence: prompt, observations and actions
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    system_prompt: str | None = None  # None: the chat template's default
    canned_reply: str = ""  # the original answers the instruction with a canned assistant turn; "" = none
    # Text that opens every agent turn (e.g. "Action:\n"): template glue the model continues from, never trained
    # on (loss mask 0), part of the action the environment sees and of the recorded conversation.
    response_prefix: str = ""
    compact_below: float = 0.5  # drop finished rows from the sampler batch when active/batch falls below this
    # Sampler rows: 0 = every episode at once. Lock-step rounds play max_rows episodes at a time, a round waiting
    # for the slowest; continuous=True refills a finished episode's row with the next queued episode instead.
    max_rows: int = 0
    continuous: bool = False
    # continuous only: the rows' two halves take turns, one sampling while the environments step the other's
    # actions (continuous_rollout.play_continuous); for environments whose steps take about as long as a sampler call
    async_env_steps: bool = False
    # continuous only: a sampler call returns once this share of its rows finished their turn; those take their
    # environment step and next turn (or a queued episode) while the others go on decoding. 1: calls run until
    # every row has finished its turn.
    refill_after: float = 0.5

    def validate(self) -> None:
        if self.max_turn_tokens < 1:
            raise ConfigError(f"rollout.max_turn_tokens must be >= 1, got {self.max_turn_tokens}")
        if self.max_trajectory_tokens <= self.max_turn_tokens:
            raise ConfigError("rollout.max_trajectory_tokens must exceed rollout.max_turn_tokens")
        SamplingParams(self.temperature, self.top_p, self.top_k, self.max_turn_tokens).validate()
        if self.max_rows < 0:
            raise ConfigError(f"rollout.max_rows must be >= 0 (0: every episode at once), got {self.max_rows}")
        if not 0 < self.refill_after <= 1:
            raise ConfigError(f"rollout.refill_after must be in (0, 1] (a share of a call's rows), got "
                              f"{self.refill_after}")
        if self.async_env_steps and not self.continuous:
            raise ConfigError("rollout.async_env_steps needs rollout.continuous=True (lock-step rounds wait for "
                              "every episode's answer anyway)")


@dataclasses.dataclass
class Trajectory:
    """One episode as token ids with per-token loss mask and behaviour log-probs."""

    task_id: int
    group_id: int
    subtask: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)  # 1 on agent-sampled tokens
    logprobs: list[float] = dataclasses.field(default_factory=list)  # sampler log-prob (0 off the mask)
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)  # readable conversation
    score: float = 0.0
    success: bool = False
    turns: int = 0
    end_reason: str = ""
    error: str | None = None
    episode_id: int = -1
    judged_actions: int = 0  # turns whose info said whether the environment understood the action
    valid_actions: int = 0  # of those, turns whose action the environment understood
    turn_ids: list[int] = dataclasses.field(default_factory=list)  # per token: its agent turn, -1 elsewhere
    step_rewards: list[float] = dataclasses.field(default_factory=list)  # per turn: the score it added
    state_keys: list[str] = dataclasses.field(default_factory=list)  # per turn: the state it acted in

    def append(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None, turn: int = -1) -> None:
        self.tokens.extend(int(i) for i in ids)
        self.loss_mask.extend([mask] * len(ids))
        self.logprobs.extend(list(logprobs) if logprobs is not None else [0.0] * len(ids))
        self.turn_ids.extend([turn] * len(ids))

    @property
    def num_agent_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def record_action_validity(self, info: dict[str, Any] | None) -> None:
        """Counts ``info["action_valid"]`` when the environment reports it (None: it did not judge)."""
        valid = (info or {}).get("action_valid")
        if valid is not None:
            self.judged_actions += 1
            self.valid_actions += int(bool(valid))


@dataclasses.dataclass
class RolloutStats:
    """Timing and counts of one rollout."""

    sampling_s: float = 0.0  # sampler work: generate calls, and prefills, forks and row moves of prompts and rows
    env_s: float = 0.0
    host_s: float = 0.0
    generated_tokens: int = 0
    env_steps: int = 0
    rounds: int = 0


def state_key(info: dict[str, Any] | None, observation: str) -> str:
    """The environment state an agent turn acts in: the env's ``info["state_key"]``, else the observation text."""
    key = (info or {}).get("state_key")
    return str(key) if key is not None else "observation:" + observation

