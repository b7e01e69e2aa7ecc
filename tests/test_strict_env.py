"""The rollout benchmark's varied-length workload (benchmarks/strict_env.py): BabyAI that ends an episode at the
first action it does not understand, and is BabyAI otherwise."""

from __future__ import annotations

import json

from benchmarks.strict_env import StrictBabyAIEnvironment


def test_an_action_babyai_does_not_understand_ends_the_episode():
    env = StrictBabyAIEnvironment()
    try:
        observation, _ = env.reset(120)
        listed = json.loads(observation.rsplit("Available actions: ", 1)[1])
        step = env.step(f"Action:\n{listed[0]}")  # a listed action: the episode goes on, as in BabyAI
        assert step.info["action_valid"] is True and not step.done
        step = env.step("Action:\nfly to the moon")
        assert step.info["action_valid"] is False and step.done and step.reward == 0.0
        env.reset(120)  # a new episode starts as usual
        assert not env.step(f"Action:\n{listed[0]}").done
    finally:
        env.close()
