"""LoRA adapters: exact base outputs when fresh, the base as reference, merged and PEFT exports that load."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from agentgym_jax import hf, lora, sharding
from agentgym_jax.errors import ConfigError
from tests.tiny_models import make_hf_model

ALL = lora.PROJECTIONS
IDS = np.random.RandomState(0).randint(0, 256, (2, 24))


@pytest.fixture(scope="module", params=["llama-gqa-tied", "qwen3-gqa-tied"])
def base_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(directory)
    return directory


def _trained(directory, targets=ALL, rank=4, alpha=8.0):
    """A LoRA policy whose adapters hold non-zero values, as after training."""
    model = hf.load_model(directory, lora_rank=rank, lora_alpha=alpha, lora_targets=targets)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(1)
    flat = []
    for key, variable in nnx.to_flat_state(state):
        if key[-1] in ("lora_a", "lora_b"):
            variable = variable.replace(jnp.asarray(rng.normal(0, 0.2, variable.shape), jnp.float32))
        flat.append((key, variable))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _logits(model, ids=IDS) -> np.ndarray:
    return np.asarray(model(jnp.asarray(ids)))


def test_fresh_adapters_give_exactly_the_base_logits(base_dir):
    base = _logits(hf.load_model(base_dir))
    fresh = hf.load_model(base_dir, lora_rank=4, lora_targets=ALL)
    assert np.array_equal(_logits(fresh), base)
    adapters = [k for k, _ in nnx.to_flat_state(nnx.state(fresh, lora.LoRAParam))]
    layers = fresh.config.num_hidden_layers
    assert len(adapters) == 2 * len(ALL) * layers


def test_reference_without_adapters_is_the_base_model_sharing_its_arrays(base_dir):
    base = _logits(hf.load_model(base_dir))
    trained = _trained(base_dir)
    assert np.abs(_logits(trained) - base).max() > 1e-3  # the adapters do change the outputs
    graphdef, state = nnx.split(trained)
    reference_state = lora.without_adapters(state)
    assert np.array_equal(_logits(nnx.merge(graphdef, reference_state)), base)
    kernel = ("model", "layers", 0, "self_attn", "q_proj", "kernel")
    same = dict(nnx.to_flat_state(reference_state))[kernel][...] is dict(nnx.to_flat_state(state))[kernel][...]
    assert same  # no second copy of the base weights


def test_merged_export_loads_in_transformers_with_our_logits(base_dir, tmp_path):
    trained = _trained(base_dir, targets=("q_proj", "v_proj", "down_proj"))
    hf.export_model(trained, tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    with torch.no_grad():
        theirs = reloaded(torch.tensor(IDS)).logits.numpy()
    assert np.abs(theirs - _logits(trained)).max() <= 1e-4


def test_peft_export_loads_with_peft_and_matches(base_dir, tmp_path):
    import peft  # pinned in requirements-dev.txt
    trained = _trained(base_dir, targets=("q_proj", "k_proj", "o_proj", "up_proj"), rank=3, alpha=6.0)
    hf.export_model(trained, tmp_path / "adapter", tokenizer_dir=base_dir, adapter_only=True)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 3
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = with_adapter(torch.tensor(IDS)).logits.numpy()
    assert np.abs(theirs - _logits(trained)).max() <= 1e-4


def test_adapters_are_sharded_like_their_projections(base_dir):
    trained = _trained(base_dir)
    mesh = sharding.make_mesh((4, 2, 1))
    sharded = hf.load_model(base_dir, mesh=mesh, lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
    _, trained_state = nnx.split(trained)
    graphdef, state = nnx.split(sharded)
    values = dict(nnx.to_flat_state(trained_state))
    flat = []
    for key, variable in nnx.to_flat_state(state):
        if key[-1] in ("lora_a", "lora_b"):
            path = ".".join(map(str, key))
            placed = jax.device_put(values[key][...], sharding.param_sharding(mesh, path, variable.shape))
            variable = variable.replace(placed)
        flat.append((key, variable))
    rows = np.random.RandomState(2).randint(0, 256, (8, 24))  # the batch splits over the 8 devices
    with sharding.use_mesh(mesh):
        got = _logits(nnx.merge(graphdef, nnx.from_flat_state(flat)), rows)
    assert np.abs(got - _logits(trained, rows)).max() <= 1e-5
    spec = sharding.param_spec("model.layers.0.mlp.down_proj.lora_b")
    assert tuple(spec) == (None, "fsdp")


@pytest.mark.parametrize("kwargs,match", [
    (dict(lora_rank=4, lora_targets=("qkv",)), "not projections of this model"),
    (dict(lora_rank=4, lora_targets=()), "needs lora_targets"),
    (dict(lora_rank=4, lora_targets=("q_proj",), lora_alpha=0.0), "lora_alpha must be positive"),
])
def test_bad_adapter_settings_are_named(base_dir, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        hf.load_model(base_dir, **kwargs)


def test_lora_run_checkpoints_only_adapters_and_resumes_exactly(tmp_path):
    from agentgym_jax.trainer import Trainer
    from tests.test_trainer import tiny_config
    from tests.tiny_models import save_tiny_chat_model

    config = tiny_config(save_tiny_chat_model(tmp_path / "model"), tmp_path / "run", steps=2, checkpoint_every=1,
                         eval_before=False)
    config.model.lora_rank, config.model.lora_alpha, config.model.lora_targets = 4, 8.0, ALL
    trainer = Trainer(config)
    try:
        trainer.fit()
        saved = trainer.learner.checkpoint_state()
        final = {k: np.asarray(v) for k, v in nnx.to_flat_state(trainer.learner.policy_state)}
    finally:
        trainer.close()
    policy_keys = [k for k in saved if k.startswith("policy/")]
    assert policy_keys and all(k.endswith((".lora_a.value", ".lora_b.value")) for k in policy_keys)
    assert any(np.abs(v).max() > 0 for k, v in final.items() if k[-1] == "lora_b")  # the adapters trained
    resumed = Trainer(config)
    try:
        assert resumed.maybe_resume() and resumed.step == 2
        again = {k: np.asarray(v) for k, v in nnx.to_flat_state(resumed.learner.policy_state)}
    finally:
        resumed.close()
    assert again.keys() == final.keys() and all(np.array_equal(again[k], final[k]) for k in final)
    # The same checkpoints read with a config without adapters: a clear error, not orbax's tree dump.
    from agentgym_jax.errors import CheckpointError

    config.model.lora_rank, config.model.lora_targets = 0, ()
    full = Trainer(config)
    try:
        with pytest.raises(CheckpointError, match=r"different learner state.*lora_a.*model\.lora_"):
            full.maybe_resume()
    finally:
        full.close()


def test_bf16_base_with_fp32_adapters(base_dir):
    base = hf.load_model(base_dir, param_dtype="bfloat16", dtype="bfloat16")
    adapted = hf.load_model(base_dir, param_dtype="bfloat16", dtype="bfloat16", lora_rank=4, lora_targets=ALL)
    q_proj = adapted.model.layers[0].self_attn.q_proj
    assert q_proj.kernel[...].dtype == jnp.bfloat16 and q_proj.lora_a[...].dtype == jnp.float32
    assert np.array_equal(_logits(adapted), _logits(base))


def _random_batch(seed: int, rows: int, length: int, prompt: int, groups: int):
    """A rollout-shaped batch: random tokens, the first ``prompt`` positions masked out, ``groups`` groups."""
    from agentgym_jax.batch import TrajectoryBatch

    rs = np.random.RandomState(seed)
    mask = np.ones((rows, length), np.float32)
    mask[:, :prompt] = 0
    return TrajectoryBatch.create(
        tokens=rs.randint(0, 256, (rows, length)).astype(np.int32), loss_mask=mask,
        old_logp=np.where(mask > 0, -5.5, 0.0).astype(np.float32), scores=rs.rand(rows).round().astype(np.float32),
        group_ids=np.repeat(np.arange(groups), rows // groups).astype(np.int32))


def test_lora_update_with_remat_equals_without(base_dir):
    from agentgym_jax.learner import Learner, LearnerConfig

    batch = _random_batch(0, rows=8, length=24, prompt=4, groups=2)
    adapters = []
    for remat in (False, True):
        model = hf.load_model(base_dir, lora_rank=4, lora_alpha=8.0, lora_targets=ALL)
        learner = Learner(model, LearnerConfig(learning_rate=1e-2, use_reference=False, kl_coef=0.0, remat=remat,
                                               minibatch_size=8, microbatch_size=4))
        learner.update(batch, jax.random.PRNGKey(0))
        adapters.append({k: np.asarray(v) for k, v in nnx.to_flat_state(learner.policy_state) if k[-1] == "lora_b"})
    assert any(np.abs(v).max() > 0 for v in adapters[0].values())
    gaps = {k: float(np.abs(adapters[0][k] - adapters[1][k]).max()) for k in adapters[0]}
    assert max(gaps.values()) <= 1e-4, gaps  # one Adam step of 1e-2: float noise in near-zero gradients only


def test_learner_reference_log_probs_are_the_base_models(base_dir):
    from agentgym_jax.learner import Learner, LearnerConfig, token_logprobs

    batch = _random_batch(3, rows=4, length=20, prompt=5, groups=1)
    mask = batch.loss_mask
    learner = Learner(_trained(base_dir), LearnerConfig(learning_rate=1e-2, kl_coef=0.01, minibatch_size=4))
    learner.update(batch, jax.random.PRNGKey(0))  # the adapters move further; the reference must not
    assert learner.reference_state is None  # no copy of the weights is kept
    reference = np.asarray(learner.prepare(batch).ref_logp)
    base = hf.load_model(base_dir)
    expected = np.asarray(token_logprobs(base, jnp.asarray(batch.tokens))[0])
    on = mask > 0
    assert np.abs(reference[on] - expected[on]).max() <= 1e-5
