"""The value model for PPO: the policy's backbone with a scalar head, initialized from the policy checkpoint.

Parameter names are the policy's (``model.layers.3.mlp.up_proj.kernel``, ...) plus ``value_head.kernel`` [D, 1]
and ``value_head.bias`` [1], so :mod:`agentgym_jax.sharding`'s rules place the critic on the same mesh.

``values[b, t]`` estimates the return from the state *before* token t, read from the hidden state at t-1,
exactly where the log-prob of token t is read; ``values[:, 0]`` is 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import sharding
from agentgym_jax.model import Backbone, DecoderLM, ModelConfig, to_dtype


class Critic(nnx.Module):
    """Backbone (``model.*``) plus ``value_head`` (a float32 linear map to one value per position)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs | None = None):
        config.validate()
        rngs = rngs or nnx.Rngs(0)
        self.config = config
        self.model = Backbone(config, rngs)
        self.value_head = nnx.Linear(
            config.hidden_size, 1, use_bias=True, dtype=jnp.float32, param_dtype=to_dtype(config.param_dtype),
            kernel_init=nnx.initializers.zeros_init(), rngs=rngs,
        )

    # The backbone pass is the policy's own (it reads only ``self.config`` and ``self.model``).
    forward = DecoderLM.forward
    _positions = DecoderLM._positions
    _layers = DecoderLM._layers

    def values(self, tokens: jax.Array) -> jax.Array:
        """Float32 values [B, T] for right-padded ``tokens`` [B, T], aligned with token positions."""
        hidden, _ = self.forward(tokens)
        per_position = self.value_head(hidden.astype(jnp.float32))[..., 0]  # V(prefix up to and including t)
        return jnp.pad(per_position[:, :-1], ((0, 0), (1, 0)))

    @classmethod
    def from_policy(cls, policy: DecoderLM, mesh: Mesh | None = None, config: ModelConfig | None = None) -> "Critic":
        """A critic whose backbone is a copy (fresh buffers) of ``policy``'s and whose head starts at zero.

        ``config`` overrides the numerics (compute dtype, remat); it must describe the same architecture.
        """
        config = config or policy.config
        graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(config, nnx.Rngs(0))))
        flat = dict(nnx.to_flat_state(state))
        policy_flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(policy, nnx.Param))}
        for key, variable in flat.items():
            path = ".".join(map(str, key))
            if path.startswith("value_head."):
                value = jnp.zeros(variable.shape, variable.dtype)
                if mesh is not None:
                    value = jax.device_put(value, sharding.param_sharding(mesh, path, variable.shape))
            else:
                source = policy_flat[path][...]
                value = copy_array(source)
            variable.set_value(value)
        return nnx.merge(graphdef, nnx.from_flat_state(flat))


def copy_array(x: jax.Array) -> jax.Array:
    """A new buffer holding ``x``, with ``x``'s sharding (so donating one never deletes the other)."""
    return jax.jit(jnp.copy, out_shardings=x.sharding)(x) if isinstance(x, jax.Array) else jnp.array(x)


def copy_tree(tree: Any) -> Any:
    """:func:`copy_array` on every array leaf of ``tree``."""
    return jax.tree.map(copy_array, tree)

