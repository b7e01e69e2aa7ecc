"""Training only the top decoder layers: the lower layers get neither a backward pass nor an optimizer update.

On hardware where the backward pass dominates (a CPU, or a large model on few accelerators), training the top
``N`` layers (plus the final norm and the output head) keeps most of what RL fine-tuning changes at a fraction of
the cost: the model's forward ``stop_gradient`` after the last frozen layer removes the lower layers' backward from
the compiled program, and :func:`freeze_layers` zeroes their updates (weight decay included) and keeps no
optimizer state for them. With tied embeddings the shared table still trains through the output head.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import optax

from agentgym_jax.errors import ConfigError

_LAYER_PATH = re.compile(r"(?:^|/)layers/(\d+)(?:/|$)")


def frozen_layer_count(num_layers: int, trainable_layers: int) -> int:
    """Layers to freeze when training the top ``trainable_layers`` of ``num_layers`` (0: train all)."""
    if trainable_layers < 0:
        raise ConfigError(f"trainable_layers must be >= 0 (0 trains every layer), got {trainable_layers}")
    if trainable_layers > num_layers:
        raise ConfigError(f"trainable_layers={trainable_layers} exceeds the model's {num_layers} decoder layers; "
                          "use a value up to that, or 0 for all")
    return 0 if trainable_layers == 0 else num_layers - trainable_layers


def _path_names(path: tuple[Any, ...]) -> list[str]:
    """A parameter path's parts as text (dict keys, sequence indices or plain strings)."""
    return [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]


def layer_index(path: tuple[Any, ...]) -> int | None:
    """The decoder-layer index of a parameter path (``model/layers/3/...``), or None outside the layers."""
    match = _LAYER_PATH.search("/".join(_path_names(path)))
    return int(match.group(1)) if match else None


def is_embedding(path: tuple[Any, ...]) -> bool:
    """Whether a parameter path is the token embedding table (``model/embed_tokens/...``)."""
    return "embed_tokens" in _path_names(path)


def labels(params: Any, frozen_layers: int, freeze_embeddings: bool = False) -> Any:
    """``"frozen"`` for parameters of decoder layers below ``frozen_layers`` (and the embeddings with
    ``freeze_embeddings``), ``"train"`` for the rest."""

    def label(path: tuple[Any, ...], _: Any) -> str:
        index = layer_index(path)
        frozen = (index is not None and index < frozen_layers) or (freeze_embeddings and is_embedding(path))
        return "frozen" if frozen else "train"

    return jax.tree_util.tree_map_with_path(label, params)


def freeze_layers(optimizer: optax.GradientTransformation, frozen_layers: int,
                  freeze_embeddings: bool = False) -> optax.GradientTransformation:
    """``optimizer`` on the trainable parameters; zero updates and no state for the first ``frozen_layers`` (and
    the embeddings with ``freeze_embeddings``)."""
    return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()},
                                 lambda params: labels(params, frozen_layers, freeze_embeddings))
