"""Weights packed for the decode kernels once per parameter update instead of once per generate call.

Inside :func:`agentgym_jax.native_kernels.packed_projections` the decode loop's products read their weights packed
into the kernels' layouts (AMX panels, AVX-512 strips). Packed inside the generate program, every call repacked all
of them and faulted the packed copy's fresh pages in: in a profile, ~180 ms of a ~250 ms one-token fp32 call of
SmolLM2-135M (538 MB packed, 131,000 page faults a call), paid again by each turn of a multi-turn rollout.

A program that packs (the sampler's pack program) traces its products under :func:`recording` and returns what each
pack call produced, keyed by what was packed (the kind of packing and the paths of its operands in the parameter
state); a program that samples traces under :func:`replaying` with those arrays as an argument and
takes a pack from them where its key matches. A pack whose operands are not parameter leaves (e.g. weights computed
in the program) is packed in the program as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax


class _Memo:
    """The parameter leaves of the program being traced (by identity), and the packs given to it or made in it."""

    def __init__(self, state: Any, given: dict[str, jax.Array] | None):
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        self.paths = {id(leaf): jax.tree_util.keystr(path) for path, leaf in leaves}
        self.given = given
        self.made: dict[str, jax.Array] = {}

    def key(self, kind: str, operands: tuple[jax.Array, ...]) -> str | None:
        paths = [self.paths.get(id(operand)) for operand in operands]
        return None if None in paths else f"{kind}:{'+'.join(paths)}"


_memo: contextvars.ContextVar[_Memo | None] = contextvars.ContextVar("agentgym_jax_prepacked", default=None)


def packed(kind: str, operands: tuple[jax.Array, ...], pack: Callable[[], jax.Array]) -> jax.Array:
    """``pack()``, or the array given for the same key (:func:`replaying`); records what it packs
    (:func:`recording`)."""
    memo = _memo.get()
    key = None if memo is None else memo.key(kind, operands)
    if key is None:
        return pack()
    if memo.given is not None and key in memo.given:
        return memo.given[key]
    if key not in memo.made:
        memo.made[key] = pack()
    return memo.made[key]


def given(kind: str, operands: tuple[jax.Array, ...]) -> jax.Array | None:
    """The array given for packing ``operands`` as ``kind`` (:func:`replaying`), or None: for products that would
    otherwise reorder their weights themselves (the prefill's products of many rows read the decode loop's packs)."""
    memo = _memo.get()
    key = None if memo is None or memo.given is None else memo.key(kind, operands)
    return None if key is None else memo.given.get(key)


@contextlib.contextmanager
def recording(state: Any) -> Iterator[dict[str, jax.Array]]:
    """Within it, packs of ``state``'s leaves are recorded into the dict it yields (key -> packed array)."""
    memo = _Memo(state, None)
    token = _memo.set(memo)
    try:
        yield memo.made
    finally:
        _memo.reset(token)


@contextlib.contextmanager
def replaying(state: Any, given: dict[str, jax.Array]) -> Iterator[None]:
    """Within it, a pack of ``state``'s leaves whose key is in ``given`` is taken from it rather than computed."""
    token = _memo.set(_Memo(state, given))
    try:
        yield
    finally:
        _memo.reset(token)
