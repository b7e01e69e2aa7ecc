"""Every shipped config (and variant) validates, and the ScalingInter variants follow the original's schedules."""

import importlib.util
from pathlib import Path

import pytest

from agentgym_jax import schedule
from agentgym_jax.run_config import validate_run_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load(name, variant=None):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


@pytest.mark.parametrize("name,variant", [
    ("cpu_demo", None), ("babyai_grpo", "fixed"), ("babyai_grpo", "scaling"), ("textcraft_grpo", "fixed"),
    ("textcraft_grpo", "scaling"), ("sciworld_grpo", "fixed"), ("sciworld_grpo", "scaling"),
    ("babyai_grpo", "gpu"), ("textcraft_grpo", "gpu"), ("sciworld_grpo", "gpu"),
    ("searchqa_grpo", "fixed"), ("searchqa_grpo", "scaling"), ("searchqa_grpo", "gpu"), ("searchqa_grpo", "cpu"),
    ("webarena_grpo", "fixed"), ("webarena_grpo", "scaling"), ("webarena_grpo", "gpu"), ("miniwob_grpo", None),
    ("miniwob_grpo", "cpu"),
])
def test_config_validates(name, variant):
    validate_run_config(load(name, variant))


@pytest.mark.parametrize("name,horizons", [
    ("babyai_grpo", {1: 6, 100: 6, 101: 13, 201: 20}),
    ("textcraft_grpo", {1: 10, 101: 20, 201: 30}),
    ("sciworld_grpo", {1: 10, 101: 20, 201: 30}),
    ("searchqa_grpo", {1: 5, 100: 5, 101: 8, 201: 10}),
    ("webarena_grpo", {1: 8, 80: 8, 81: 12, 160: 12, 161: 15}),
])
def test_scaling_variants_follow_the_original_schedules(name, horizons):
    config = load(name, "scaling")
    assert {s: schedule.horizon_at(config.horizon, s) for s in horizons} == horizons


@pytest.mark.parametrize("name", ["babyai_grpo", "textcraft_grpo", "sciworld_grpo", "searchqa_grpo", "webarena_grpo"])
def test_gpu_variants_keep_the_original_episodes_on_one_device(name):
    fixed, gpu = load(name, "fixed"), load(name, "gpu")
    assert tuple(gpu.mesh.shape) == (1, 1, 1) and gpu.model.dtype == "bfloat16" and gpu.model.remat
    for section in ("data", "rollout", "horizon", "algo"):
        assert gpu[section].to_dict() == fixed[section].to_dict(), section
    assert gpu.train.workdir.endswith("_gpu")
