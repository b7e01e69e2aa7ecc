"""Packed learner rows: a group's shared prompt once, several trajectories per row, the same loss and gradients."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from agentgym_jax import hf, packing, sharding
from agentgym_jax.batch import TrajectoryBatch
from agentgym_jax.errors import ConfigError
from agentgym_jax.learner import Learner, LearnerConfig, _accumulated_grads, loss_denominator, policy_loss

T = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import save_hf_model

    return save_hf_model("qwen2-mha-tied", tmp_path_factory.mktemp("qwen2-packing"))


def _group_batch(seed: int = 0, groups: int = 3, size: int = 4) -> TrajectoryBatch:
    """Groups whose members share a prompt of 8-10 tokens, then take one or two agent turns of their own with an
    observation between, ragged lengths and env tokens after the last turn."""
    rs = np.random.RandomState(seed)
    rows = groups * size
    tokens = rs.randint(3, 256, (rows, T))
    mask = np.zeros((rows, T), np.float32)
    for b in range(rows):
        group, member = divmod(b, size)
        prompt = 8 + group % 3
        tokens[b, :prompt] = tokens[group * size, :prompt]
        mask[b, prompt:prompt + 2 + member % 3] = 1
        if member % 2:  # a second turn after an observation
            mask[b, prompt + 9:prompt + 11 + member] = 1
    groups_ids = np.repeat(np.arange(groups), size)
    old_logp = np.where(mask > 0, -rs.rand(rows, T) * 3 - 2, 0.0)
    return TrajectoryBatch.create(tokens, mask, rs.rand(rows).astype(np.float32), groups_ids, old_logp=old_logp)


def _params(learner: Learner) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(learner.policy_state)}


def test_layout_shares_the_prompt_and_keeps_each_token_in_place():
    tokens = np.array([[5, 6, 7, 8, 20, 21, 0, 0, 0, 0],
                       [5, 6, 7, 8, 30, 31, 32, 33, 0, 0],  # 33 comes after its last agent token: cut
                       [5, 6, 9, 9, 40, 41, 0, 0, 0, 0],  # another group: its own block
                       [5, 6, 7, 8, 50, 0, 0, 0, 0, 0]])  # no agent tokens: left out
    mask = np.array([[0, 0, 0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0, 1, 0, 0, 0],
                     [0, 0, 0, 1, 1, 0, 0, 0, 0, 0], [0] * 10])
    layout = packing.plan(tokens, mask, np.array([0, 0, 1, 0]), length_buckets=(8, 16))
    # blocks: group 0 = the 4-token prompt once + [20, 21] + [30, 31, 32] (9 tokens); group 1 = [5, 6, 9] + [9, 40]
    assert layout.shape == (1, 16)
    assert layout.tokens[0].tolist() == [5, 6, 7, 8, 20, 21, 30, 31, 32, 5, 6, 9, 9, 40, 0, 0]
    assert layout.rope_positions[0, :14].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 0, 1, 2, 3, 4]
    assert layout.branches[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 0, 0, 0, 1, 1, 0, 0]
    assert layout.blocks[0].tolist() == [0] * 9 + [1] * 5 + [-1, -1]
    assert layout.cells[1, :7].tolist() == [0, 1, 2, 3, 6, 7, 8] and layout.cells[0, :4].tolist() == [0, 1, 2, 3]
    assert layout.cells[1, 7] == -1 and (layout.cells[3] == -1).all()
    assert layout.source_cols[0, :9].tolist() == [-1, 0, 1, 2, 3, 4, 3, 6, 7]  # member 2 starts from the prompt


def test_a_group_longer_than_a_row_is_split_with_its_prompt_copied():
    tokens = np.tile(np.arange(1, 9), (2, 1))
    mask = np.zeros((2, 8))
    mask[:, 4:8] = 1
    layout = packing.plan(tokens, mask, np.zeros(2, int), length_buckets=(8, 16))
    # one block would be 4 + 4 + 4 = 12 tokens, more than the 8 of a padded row: two blocks of 8, one per row
    assert layout.shape == (2, 8) and layout.tokens.tolist() == [list(range(1, 9))] * 2
    assert layout.cells.tolist() == [list(range(8)), list(range(8, 16))]
    # allowed blocks of up to 16 tokens (what the learner allows: twice the padded width), it stays one block
    layout = packing.plan(tokens, mask, np.zeros(2, int), length_buckets=(8, 16), max_block=16)
    assert layout.shape == (1, 16) and layout.tokens[0, :12].tolist() == list(range(1, 9)) + [5, 6, 7, 8]


def test_layout_packs_blocks_first_fit():
    tokens = np.arange(1, 41).reshape(4, 10)
    mask = np.zeros((4, 10))
    mask[:, 5:7] = 1  # every trajectory ends (for the loss) at 7 tokens; distinct groups: blocks of 7
    layout = packing.plan(tokens, mask, np.arange(4), length_buckets=(8, 16))
    assert layout.shape == (4, 8)  # a block of 7 per row of 8
    layout = packing.plan(tokens, mask, np.arange(4), length_buckets=(16,))
    assert layout.shape == (2, 16)  # two blocks of 7 per row of 16
    assert layout.blocks[0].tolist() == [0] * 7 + [1] * 7 + [-1, -1]


@pytest.mark.parametrize("micro", [None, 2])
def test_packed_update_equals_padded_update(model_dir, micro):
    batch = _group_batch()
    config = dict(learning_rate=1e-3, entropy_coef=0.01, kl_coef=0.05, ppo_epochs=1, microbatch_size=micro,
                  loss_aggregation="token-mean")
    padded = Learner(hf.load_model(model_dir), LearnerConfig(**config))
    packed = Learner(hf.load_model(model_dir), LearnerConfig(pack_rows=True, **config))
    padded_metrics = padded.update(batch, jax.random.PRNGKey(0))
    packed_metrics = packed.update(batch, jax.random.PRNGKey(0))
    for key in ("total_loss", "policy_loss", "kl_loss", "entropy", "grad_norm", "ratio", "ref_kl"):
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], rel=2e-5, abs=1e-7), key
    # Adam turns rounding-level differences of near-zero gradients into whole steps: compare the gradients
    fresh = Learner(hf.load_model(model_dir), LearnerConfig(pack_rows=True, **config))
    expected, _ = Learner(hf.load_model(model_dir), LearnerConfig(**config)).gradients(batch)
    prepared = fresh.prepare(batch)
    stack, _ = fresh._stack(prepared, np.arange(12), np.asarray(batch.group_ids), 12, micro or 12)
    assert (stack.tokens.shape[0] > 1) == (micro is not None)  # several micro-batches when asked
    mask = stack.loss_mask.reshape(-1, stack.loss_mask.shape[-1])
    grads, _ = _accumulated_grads(functools.partial(policy_loss, config=fresh.config), fresh._train_graphdef,
                                  fresh.policy_state, stack, loss_denominator("token-mean", mask))
    flat = lambda tree: {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(tree)}  # noqa: E731
    for key, value in flat(expected).items():
        np.testing.assert_allclose(flat(grads)[key], value, atol=1e-7 + 1e-5 * np.abs(value).max(), err_msg=key)
    # 12 trajectories of 32 padded tokens; packed: 3 shared prompts once, each row cut after its last agent token
    prepared = padded.prepare(batch)
    layout = packing.plan(prepared.tokens, prepared.loss_mask, np.asarray(batch.group_ids))
    lengths = [int(np.flatnonzero(m)[-1]) + 1 for m in prepared.loss_mask]
    prompts = [8, 9, 10]
    packed_tokens = (layout.blocks >= 0).sum()  # a group longer than 32 tokens is split, its prompt copied
    assert sum(lengths) - 3 * sum(prompts) <= packed_tokens < sum(lengths) - sum(prompts)
    assert packed_tokens < 0.4 * 12 * T


def test_packed_rows_compute_the_experience_pass_once_per_shared_prompt(model_dir):
    """With pack_rows the reference and recomputed log-probs come from the batch packed (each group's prompt
    once): the same values as the padded rows give, up to rounding, from fewer positions."""
    batch = _group_batch(groups=4)
    config = dict(learning_rate=1e-3, minibatch_size=8, microbatch_size=4, use_reference=True,
                  old_logp_source="recompute", loss_aggregation="token-mean")
    packed = Learner(hf.load_model(model_dir), LearnerConfig(pack_rows=True, group_minibatches=True, **config))
    padded = Learner(hf.load_model(model_dir), LearnerConfig(**config))
    computed = {}
    for name, learner in (("packed", packed), ("padded", padded)):
        def counting(policy, reference, critic, tokens, *rest, run=learner._experience, name=name):
            computed[name] = computed.get(name, 0) + tokens.size
            return run(policy, reference, critic, tokens, *rest)
        learner._experience = counting
    mine, theirs = packed.prepare(batch), padded.prepare(batch)
    assert computed["padded"] == 16 * T and computed["packed"] <= 0.5 * computed["padded"]
    on = np.asarray(batch.loss_mask) > 0
    for field in ("old_logp", "ref_logp"):
        value, expected = getattr(mine, field), getattr(theirs, field)
        assert np.abs(expected[on]).min() > 0.1 and not value[~on].any()
        np.testing.assert_allclose(value[on], expected[on], atol=1e-5, rtol=1e-5, err_msg=field)
    np.testing.assert_allclose(mine.advantages, theirs.advantages, atol=1e-6)


def _packed_tokens(learner, prepared, index, group_ids) -> int:
    stack, _ = learner._stack(prepared, index, group_ids, 8, 8)
    return int((np.asarray(stack.blocks) >= 0).sum())


def test_group_minibatches_deal_whole_groups_and_pack_fewer_tokens(model_dir):
    batch = _group_batch(groups=4)
    group_ids, real = np.asarray(batch.group_ids), np.ones((16,), bool)
    config = dict(learning_rate=1e-3, pack_rows=True, minibatch_size=8, microbatch_size=8,
                  loss_aggregation="token-mean", use_reference=False, kl_coef=0.0)
    by_group = Learner(hf.load_model(model_dir), LearnerConfig(group_minibatches=True, **config))
    by_row = Learner(hf.load_model(model_dir), LearnerConfig(**config))
    prepared = by_group.prepare(batch)
    pairs, held = set(), {"group": 0, "row": 0}
    for seed in range(6):
        order = by_group._minibatch_order(jax.random.PRNGKey(seed), real, group_ids, 2)
        assert sorted(np.concatenate(order).tolist()) == list(range(16))
        for index in order:
            groups, counts = np.unique(group_ids[index], return_counts=True)
            assert counts.tolist() == [4, 4]  # two whole groups of 4 per minibatch of 8
            pairs.add(tuple(groups))
            held["group"] += _packed_tokens(by_group, prepared, index, group_ids)
        for index in by_row._minibatch_order(jax.random.PRNGKey(seed), real, group_ids, 2):
            held["row"] += _packed_tokens(by_row, prepared, index, group_ids)
    assert len(pairs) >= 3  # the groups are shuffled, not dealt in a fixed order
    assert held["group"] < held["row"]  # packed tokens: one prompt copy per group, not one per group touched
    # padding rows (valid 0) go last, and every minibatch keeps its size
    real[[3, 7]] = False
    order = by_group._minibatch_order(jax.random.PRNGKey(0), real, group_ids, 2)
    assert [len(index) for index in order] == [8, 8] and {3, 7} <= set(order[1].tolist())


def test_packed_update_on_a_mesh_matches_single_device(model_dir):
    batch = _group_batch(seed=1)
    config = LearnerConfig(learning_rate=1e-3, pack_rows=True, minibatch_size=4, microbatch_size=4, ppo_epochs=2,
                           kl_coef=0.0, use_reference=False, loss_aggregation="token-mean")
    single = Learner(hf.load_model(model_dir), config)
    single.update(batch, jax.random.PRNGKey(3))
    mesh = sharding.make_mesh((2, 2, 2))
    sharded = Learner(hf.load_model(model_dir, mesh=mesh), config, mesh=mesh)
    sharded.update(batch, jax.random.PRNGKey(3))
    for key, value in _params(single).items():
        np.testing.assert_allclose(_params(sharded)[key], value, atol=2e-5, err_msg=key)


@pytest.mark.parametrize("overrides, message", [
    (dict(loss_aggregation="seq-mean-token-mean"), "pack_rows=True needs loss_aggregation='token-mean'"),
    (dict(policy_loss="gspo"), "needs a token-level policy loss; 'gspo'"),
    (dict(advantage_estimator="gae"), "works with critic-free estimators"),
])
def test_packing_refuses_objectives_that_read_whole_rows(overrides, message):
    with pytest.raises(ConfigError, match=message):
        LearnerConfig(**{"pack_rows": True, "loss_aggregation": "token-mean", **overrides}).validate()
