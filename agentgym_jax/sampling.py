"""Batched multi-turn generation: one jitted program that prefills new tokens and decodes, per-row KV cache.

Each row (one episode) owns a slice of the KV cache and its own filled length. A call to
:meth:`Sampler.generate` appends every active row's new tokens (the environment observation plus chat-template
glue) to that row's cache, then decodes in a ``lax.while_loop`` until every row has stopped (or, with
``stop_after``, until that many have: the others go on in the next call, :mod:`agentgym_jax.partial_turns`). The
history is never recomputed: a multi-turn episode costs one prefill of its new tokens per turn.

The sampler reads the policy parameters exactly as the trainer holds them (the ``nnx.split`` state), so
sampling and training share one set of sharded arrays.

Returned log-probs are the model's own (unfiltered) ``log_softmax`` of each sampled token at
``SamplerConfig.logprob_temperature`` (1 unless set to the learner's temperature), i.e.
what a teacher-forced forward over the whole sequence gives.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from agentgym_jax import compile_stats, native_kernels, prefill, sharding
from agentgym_jax.buckets import bucket
from agentgym_jax.errors import ConfigError
from agentgym_jax.generate_program import PROGRAM_NAME, StopReason, pack_program
from agentgym_jax.generate_program import generate_program as _generate_program
from agentgym_jax.model import DecoderLM, KVCache, decodes_natively, to_dtype
from agentgym_jax.partial_turns import PartialTurn, moved, without


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling rule. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those filters."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64

    def validate(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclasses.dataclass
class GenerateResult:
    """Per-row output of one :meth:`Sampler.generate` call (rows in the order given)."""

    tokens: list[list[int]]  # sampled ids, including a final stop token when there is one
    logprobs: list[list[float]]  # model log-prob of each sampled id
    stop_reasons: list[StopReason]


@dataclasses.dataclass
class SamplerState:
    """The KV cache of a batch of episodes, plus a host copy of each row's filled length."""

    cache: KVCache | None  # None once consumed by Sampler.generate (its buffers were donated)
    lengths: np.ndarray  # [B] host mirror of cache.lengths
    partial: dict[int, PartialTurn] = dataclasses.field(default_factory=dict)  # rows mid-turn (stop_after)
    unfed: dict[int, int] = dataclasses.field(default_factory=dict)  # a finished turn's last id, not yet in the cache

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])




@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Static settings of a sampler: cache size and dtype, stop rules, shape buckets."""

    cache_length: int = 2048
    cache_dtype: str | None = None  # default: the model's compute dtype
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    logprob_temperature: float = 1.0  # returned log-probs are of logits / this (the learner's temperature)
    # New tokens per row of a call. A row continuing from a cached prompt brings one token (its last): padding it
    # to 16 would run the model over 16x the positions, so the small buckets matter.
    token_buckets: tuple[int, ...] = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    new_token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    # Live-window attention (off when empty): each call attends over only the first W cache slots, W the
    # smallest bucket >= the longest length any row can reach in that call (else the whole cache). Decode
    # reads and scores W slots instead of cache_length, at the cost of one program per window bucket used.
    window_buckets: tuple[int, ...] = ()
    # agentgym_jax.prefill: rows of very different lengths are prefilled in length-sorted parts when that computes
    # fewer positions, an extra part priced as this many (0: never split); prompts longer than prefill_chunk (one
    # of token_buckets; 0: no chunks) go in chunks of it: 300 tokens compute 128 + 128 + 64, not a 512 bucket;
    # a partial chunk goes in smaller buckets where that saves positions (199 tokens: 128 + 64 + 16 positions).
    prefill_call_cost: int = 256
    prefill_chunk: int = 128


class Sampler:
    """Generates for a batch of episodes, extending each episode's KV cache turn after turn."""

    def __init__(self, model: DecoderLM, config: SamplerConfig, mesh: Mesh | None = None):
        self.config = config
        self.mesh = mesh
        self.graphdef, self.state = nnx.split(model)
        self._packed: dict[str, jax.Array] | None = None  # the decode loop's packed weights (pack_program), once made
        self.model_config = model.config
        to_dtype(config.cache_dtype or model.config.dtype)
        if config.prefill_chunk and config.prefill_chunk not in config.token_buckets:
            raise ConfigError(f"SamplerConfig.prefill_chunk={config.prefill_chunk} is not one of token_buckets "
                              f"{config.token_buckets}; use one of them, or 0 to prefill in one block")
        compile_stats.install()

    def update_params(self, model_or_state: Any) -> None:
        """Points the sampler at new parameters (the trainer's arrays themselves: no copy)."""
        self.state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
        self._packed = None  # packed again from the new parameters at the next generate call

    def release_packed(self) -> None:
        """Frees the decode loop's packed weights (a copy of the projections in the kernels' layouts: 212 MB for
        SmolLM2-135M in bf16, 538 MB in fp32) until the next generate call packs them again; e.g. before a
        training update, whose peak memory need not hold them."""
        self._packed = None

    def _packed_weights(self, batch: int) -> dict[str, jax.Array]:
        """The decode loop's weights packed for the native kernels (generate_program.pack_program), made once per
        parameter update; none where the loop's products do not read packed weights (more rows than
        :func:`native_kernels.packed_max_rows`)."""
        if batch > native_kernels.packed_max_rows(self.model_config.dtype):
            return {}
        if self._packed is None:
            with sharding.use_mesh(self.mesh):  # no native kernels on meshes of several devices: nothing to pack
                self._packed = {} if not native_kernels.enabled() else pack_program(
                    self.state, graphdef=self.graphdef, cache_dtype=self.config.cache_dtype)
        return self._packed

    def _prefill_packs(self) -> dict[str, jax.Array]:
        """The decode loop's packs, which a prefill reads too: on AMX CPUs its bf16 products of many rows take the
        AMX panels (native_kernels.amx_gemm), and its products of few positions (a piece of at most
        native_kernels.packed_max_rows rows x tokens) take the strips that the decode loop's fp32 products (and
        bf16 ones on CPUs with AVX512-BF16 and no AMX) read, at 1.2-2.5x the rate of XLA's dots there; on AVX-512
        CPUs without AVX512-BF16 its bf16 products of any number of rows do (native_kernels.widened_strip_matmul). Made once
        per parameter update by the first prefill or generate call that needs them, held until release_packed."""
        return self._packed_weights(1)

    @property
    def compilations(self) -> int:
        """XLA compilations of the generation program so far in this process."""
        return compile_stats.compilations(PROGRAM_NAME)

    def batch_bucket(self, batch: int) -> int:
        """Padded batch size for ``batch`` rows (a multiple of the mesh's batch axes)."""
        size = bucket(batch, self.config.batch_buckets)
        multiple = sharding.batch_rows(self.mesh)
        return -(-size // multiple) * multiple

    def window(self, lengths: np.ndarray, new_lengths: np.ndarray, max_new_tokens: Sequence[int],
               powers_of_two: bool = False) -> int:
        """Cache slots a call attends over: a window bucket covering every active row's final length
        (``powers_of_two``: only the buckets that are powers of two, for prefill chunks, whose reach moves by a
        chunk per call and would otherwise compile a program per bucket passed)."""
        capacity = self.config.cache_length
        active = new_lengths > 0
        if not self.config.window_buckets or not active.any():
            return capacity
        reach = int(np.max((lengths + new_lengths + np.asarray(max_new_tokens))[active]))
        fitting = [w for w in self.config.window_buckets
                   if reach <= w < capacity and not (powers_of_two and w & (w - 1))]
        return min(fitting) if fitting else capacity

    def _check_context(self, ends: np.ndarray) -> None:
        """Refuses prompts that end beyond the model's positions (its output there is undefined)."""
        limit = self.model_config.max_position_embeddings
        if np.any(ends > limit):
            raise ConfigError(f"a prompt reaches position {int(ends.max())}, beyond the model's context of {limit} "
                              "tokens (max_position_embeddings in its config.json); shorten the prompt or the "
                              "token budget")

    def new_state(self, batch: int) -> SamplerState:
        """Empty caches for ``batch`` episodes (padded to a batch bucket; extra rows stay inactive)."""
        padded = self.batch_bucket(batch)
        with sharding.use_mesh(self.mesh):
            cache = _empty_cache_program(self.model_config, padded, self.config.cache_length, self.config.cache_dtype)
        return SamplerState(cache=cache, lengths=np.zeros((padded,), np.int64))

    def generate(
        self,
        state: SamplerState,
        new_tokens: Sequence[Sequence[int] | None],
        rng: jax.Array,
        params: SamplingParams | Sequence[SamplingParams],
        row_keys: jax.Array | None = None,
        stop_after: int = 0,
    ) -> tuple[SamplerState, GenerateResult]:
        """Appends ``new_tokens[b]`` to row b's cache and samples its continuation.

        ``new_tokens[b]`` empty or None leaves row b untouched (an inactive row). ``params`` may differ per
        row. ``rng`` is one PRNG key; each row draws from its own key split from it, folded with its token
        index, so a row's sample does not depend on the other rows. ``row_keys`` (one key per entry of
        ``new_tokens``) replaces the per-row split: a caller that keys each episode itself gets the same samples
        whichever row, batch or process plays it.

        ``stop_after=n`` returns once ``n`` rows finished their turn (0: once every row has); a row still decoding
        then reports ``StopReason.RUNNING`` with its ids so far, and the next call given no tokens for it goes on
        with its turn (same ids as one uninterrupted call; its result then holds the whole turn). A turn that
        finished in the call's last step has its last id written ahead of the row's next tokens (``unfed``).
        """
        if state.cache is None:
            raise ConfigError(
                "this SamplerState was consumed by an earlier generate() call (its cache buffers are reused "
                "in place); pass the state that call returned"
            )
        batch = state.batch_size
        if len(new_tokens) > batch:
            raise ConfigError(f"{len(new_tokens)} rows given, but the sampler state holds {batch}")
        per_row = list(params) if isinstance(params, Sequence) else [params] * len(new_tokens)
        if len(per_row) != len(new_tokens):
            raise ConfigError(f"got {len(per_row)} SamplingParams for {len(new_tokens)} rows")
        for p in per_row:
            p.validate()
        resumed = self._check_resumed(state, new_tokens)
        state, given = _with_unfed(state, new_tokens)
        rows = [[resumed[b].feed] if b in resumed else given[b] for b in range(batch)]
        per_row = [resumed[b].params if b in resumed else p for b, p in enumerate(per_row)]
        per_row += [SamplingParams()] * (batch - len(per_row))
        drawn = np.array([len(resumed[b].tokens) if b in resumed else 0 for b in range(batch)], np.int32)
        lengths = np.array([len(t) for t in rows], np.int64)
        reasons_before = np.full((batch,), StopReason.RUNNING)
        self._check_context(state.lengths + lengths)
        no_room = (state.lengths + lengths > self.config.cache_length) & (lengths > 0)
        reasons_before[no_room] = StopReason.CACHE_FULL
        lengths[no_room] = 0
        heads = np.maximum(lengths - 1, 0)
        in_call = batch * self._token_bucket(int(lengths.max(initial=0)))  # the prompt part of one program
        with sharding.use_mesh(self.mesh):  # the kernel runs outside meshes of several devices
            native = decodes_natively(state.cache.dtype)
        if heads.any() and (native or self._prefill_plan(heads, batch)[0] + self.config.prefill_call_cost + batch
                            < in_call):
            # all but each row's last token in length-sorted parts; the call below then brings one token a row
            # (with the native decode attention always: that call then needs no window, and its program is the
            # same for every prompt length and window, see below; prefill programs take power-of-two windows)
            state = self.prefill(state, [ids[: heads[b]] if lengths[b] else None for b, ids in enumerate(rows)])
            rows = [ids[heads[b]:] if lengths[b] else [] for b, ids in enumerate(rows)]
            lengths = np.minimum(lengths, 1)
        token_array = self._right_padded(rows, lengths)
        remaining = [p.max_new_tokens - int(d) for p, d in zip(per_row, drawn)]
        max_new = bucket(max(remaining), self.config.new_token_buckets)
        if token_array.shape[1] == 1 and native:
            # every position is a decode step, whose native attention reads each row's own slots: a window would
            # only copy the cache out and back, and build a program per window bucket
            window = self.config.cache_length
        else:
            window = self.window(state.lengths, lengths, remaining)
        filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in per_row)
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(batch))
        if row_keys is not None:
            if len(row_keys) != len(new_tokens):
                raise ConfigError(f"got {len(row_keys)} row keys for {len(new_tokens)} rows")
            keys = keys.at[: len(new_tokens)].set(row_keys)
        if resumed:
            keys = keys.at[np.array(sorted(resumed))].set(jnp.stack([resumed[b].key for b in sorted(resumed)]))
        tail = max([len(s) for s in self.config.stop_sequences] + [1])
        recent = np.full((batch, tail), -1, np.int32)
        for b, turn in resumed.items():
            recent[b] = turn.recent
        arrays = dict(
            new_tokens=token_array,
            new_lengths=lengths.astype(np.int32),
            temperature=np.array([p.temperature for p in per_row], np.float32),
            top_p=np.array([p.top_p for p in per_row], np.float32),
            top_k=np.array([p.top_k for p in per_row], np.int32),
            max_new_tokens=np.array([p.max_new_tokens for p in per_row], np.int32),
            drawn=drawn,
            recent=recent,
        )
        with sharding.use_mesh(self.mesh):
            if self.mesh is not None:
                arrays = {
                    k: jax.device_put(v, sharding.named_sharding(self.mesh, "tokens" if v.ndim == 2 else "rows"))
                    for k, v in arrays.items()
                }
            cache, tokens, logprobs, count, reason, feed, recent, feeding = _generate_program(
                self.state, state.cache, keys=keys, stop_after=np.int32(stop_after), graphdef=self.graphdef,
                max_new=max_new, stop_ids=tuple(self.config.stop_token_ids),
                stop_sequences=tuple(self.config.stop_sequences), filtered=filtered, window=window,
                packed=self._packed_weights(batch),
                logprob_temperature=float(self.config.logprob_temperature), **arrays,
            )
        state.cache = None  # donated to the program above
        tokens, logprobs, count, reason, cache_lengths = jax.device_get(
            (tokens, logprobs, count, reason, cache.lengths)
        )
        reason = np.where(reasons_before == StopReason.CACHE_FULL, StopReason.CACHE_FULL, reason)
        earlier = lambda b, field: getattr(resumed[b], field) if b in resumed else ()  # noqa: E731
        result = GenerateResult(
            tokens=[list(earlier(b, "tokens")) + tokens[b, : count[b]].tolist() for b in range(len(new_tokens))],
            logprobs=[list(earlier(b, "logprobs")) + logprobs[b, : count[b]].tolist() for b in range(len(new_tokens))],
            stop_reasons=[StopReason(int(r)) for r in reason[: len(new_tokens)]],
        )
        partial, unfed = {}, dict(state.unfed)
        if stop_after:  # rows still decoding, and turns whose last id the call did not feed
            feed, recent, feeding = jax.device_get((feed, recent, feeding))
            for b in np.flatnonzero(feeding[: len(new_tokens)]):
                if reason[b] == StopReason.RUNNING:
                    partial[int(b)] = PartialTurn(int(feed[b]), tuple(result.tokens[b]), tuple(result.logprobs[b]),
                                                  tuple(int(i) for i in recent[b]), per_row[b], keys[b])
                else:
                    unfed[int(b)] = int(feed[b])
        return SamplerState(cache=cache, lengths=np.asarray(cache_lengths, np.int64), partial=partial,
                            unfed=unfed), result

    def _check_resumed(self, state: SamplerState, new_tokens: Sequence[Sequence[int] | None]
                       ) -> dict[int, PartialTurn]:
        """The rows whose turn goes on in this call (mid-turn rows given no tokens)."""
        for b in state.partial:
            if b >= len(new_tokens):
                raise ConfigError(f"row {b} is mid-turn (an earlier call returned early, stop_after): pass an "
                                  f"entry for it in new_tokens (None goes on with its turn)")
            if new_tokens[b]:
                raise ConfigError(f"row {b} is mid-turn (an earlier call returned early, stop_after); give it no "
                                  f"tokens to go on with its turn, or clear_rows([{b}]) to end it first")
        return dict(state.partial)

    def prefill(self, state: SamplerState, new_tokens: Sequence[Sequence[int] | None]) -> SamplerState:
        """Appends ``new_tokens[b]`` to row b's cache without sampling (e.g. a prompt shared by several episodes,
        forked afterwards with :meth:`select_rows`). Rows given no tokens are untouched."""
        if state.cache is None:
            raise ConfigError("this SamplerState was consumed by an earlier call; pass the state that call returned")
        batch = state.batch_size
        if len(new_tokens) > batch:
            raise ConfigError(f"{len(new_tokens)} rows given, but the sampler state holds {batch}")
        busy = sorted(b for b in state.partial if b < len(new_tokens) and new_tokens[b])
        if busy:
            raise ConfigError(f"rows {busy} are mid-turn (a generate call returned early, stop_after): finish their "
                              "turn first, or clear_rows them")
        state, rows = _with_unfed(state, new_tokens)
        lengths = np.array([len(t) for t in rows], np.int64)
        self._check_context(state.lengths + lengths)
        if np.any(state.lengths + lengths > self.config.cache_length):
            raise ConfigError(f"prefill of {int(lengths.max())} tokens does not fit the sampler cache of "
                              f"{self.config.cache_length} slots; raise the cache length or shorten the prompt")
        _, parts = self._prefill_plan(lengths, batch)
        if parts:
            for part in parts:
                state = self._prefill_part(state, part, [rows[r] for r in part])
            return state
        return self._prefill_block(state, rows)

    def _token_bucket(self, length: int) -> int:
        return bucket(max(1, length), self.config.token_buckets)

    def _right_padded(self, rows: Sequence[Sequence[int]], lengths: np.ndarray) -> np.ndarray:
        """[B, token bucket] int32: row b's first ``lengths[b]`` ids, zeros after (a row of length 0 is empty)."""
        array = np.zeros((len(rows), self._token_bucket(int(lengths.max(initial=0)))), np.int32)
        for b, ids in enumerate(rows):
            array[b, : lengths[b]] = ids[: lengths[b]]
        return array

    def _prefill_pieces(self, length: int) -> list[int]:
        """Tokens per program call when prefilling ``length`` tokens (:func:`prefill.plan_pieces`)."""
        return prefill.plan_pieces(length, self.config.prefill_chunk, self._token_bucket, self.config.token_buckets)

    def _prefill_positions(self, length: int) -> int:
        """Positions per row that prefilling ``length`` tokens computes (each piece padded to its bucket)."""
        return sum(self._token_bucket(piece) for piece in self._prefill_pieces(length) or [0])

    def _prefill_plan(self, lengths: np.ndarray, batch: int) -> tuple[int, list[list[int]] | None]:
        """Positions computed to prefill ``lengths`` into ``batch`` rows, and how: one block over every row
        (None), or length-sorted parts of the rows with tokens (agentgym_jax.prefill) when those compute fewer."""
        block = batch * self._prefill_positions(int(lengths.max(initial=0)))
        if not self.config.prefill_call_cost or not lengths.any():
            return block, None
        parts, cost = prefill.plan_parts(lengths.tolist(), self._prefill_positions, self.batch_bucket,
                                         self.config.prefill_call_cost)
        return (cost, parts) if cost < block else (block, None)  # one part too: the rows without tokens idle

    def _prefill_part(self, state: SamplerState, part: Sequence[int], rows: list[list[int]]) -> SamplerState:
        """Prefills ``rows`` into rows ``part`` of ``state`` (consumed) as a batch of their own: only the slots
        those rows reach after it (a window bucket) are copied out, and written back in place."""
        lengths = np.array([len(ids) for ids in rows], np.int64)
        window = self.window(state.lengths[list(part)], lengths, [0] * len(part), powers_of_two=True)
        index = self._padded_rows(part, state.batch_size)
        with sharding.use_mesh(self.mesh):
            block = SamplerState(cache=prefill.take_rows_program(state.cache, jnp.asarray(index), window=window),
                                 lengths=np.append(state.lengths[list(part)], [0] * (len(index) - len(part))))
            block = self._prefill_block(block, rows)
            cache = prefill.put_rows_program(state.cache, block.cache, jnp.asarray(index))
        state.cache = None  # donated
        lengths = state.lengths.copy()
        lengths[list(part)] = block.lengths[: len(part)]
        return SamplerState(cache=cache, lengths=lengths, partial=without(state.partial, part),
                            unfed=without(state.unfed, part))

    def _prefill_block(self, state: SamplerState, rows: list[list[int]]) -> SamplerState:
        """Every row of ``state`` prefilled together, in the program calls :meth:`_prefill_pieces` gives for the
        longest row."""
        start = 0
        for piece in self._prefill_pieces(max((len(ids) for ids in rows), default=0)):
            state = self._prefill_call(state, [ids[start: start + piece] for ids in rows])
            start += piece
        return state

    def _prefill_call(self, state: SamplerState, rows: list[list[int]]) -> SamplerState:
        """One prefill program over every row of ``state``, padded to the longest of ``rows``."""
        rows = rows + [[]] * (state.batch_size - len(rows))
        lengths = np.array([len(t) for t in rows], np.int64)
        token_array = self._right_padded(rows, lengths)
        window = self.window(state.lengths, lengths, [0] * state.batch_size, powers_of_two=True)
        with sharding.use_mesh(self.mesh):
            tokens, counts = jnp.asarray(token_array), jnp.asarray(lengths.astype(np.int32))
            if self.mesh is not None:
                tokens = jax.device_put(tokens, sharding.named_sharding(self.mesh, "tokens"))
                counts = jax.device_put(counts, sharding.named_sharding(self.mesh, "rows"))
            cache = prefill.prefill_program(self.state, state.cache, tokens, counts, packed=self._prefill_packs(),
                                            graphdef=self.graphdef, window=window)
        state.cache = None  # donated
        return dataclasses.replace(state, cache=cache, lengths=state.lengths + lengths)

    def clear_rows(self, state: SamplerState, rows: Sequence[int]) -> SamplerState:
        """Empties ``rows`` for new episodes (their next tokens are written from slot 0; what the old episode
        left in the cache is never attended to again). The other rows keep their caches."""
        if not rows:
            return state
        clear = np.zeros((state.batch_size,), bool)
        clear[list(rows)] = True
        with sharding.use_mesh(self.mesh):
            cache = _clear_rows_program(state.cache, jnp.asarray(clear))
        state.cache = None  # donated
        return SamplerState(cache=cache, lengths=np.where(clear, 0, state.lengths),
                            partial=without(state.partial, rows), unfed=without(state.unfed, rows))

    def copy_row(self, source: SamplerState, row: int, state: SamplerState, rows: Sequence[int]) -> SamplerState:
        """Copies ``source``'s cache row ``row`` (e.g. a prefilled shared prompt) into ``rows`` of ``state``."""
        into = np.zeros((state.batch_size,), bool)
        into[list(rows)] = True
        with sharding.use_mesh(self.mesh):
            cache = _copy_row_program(source.cache, jnp.int32(row), state.cache, jnp.asarray(into))
        state.cache = None  # donated
        return SamplerState(cache=cache, lengths=np.where(into, source.lengths[row], state.lengths),
                            partial=without(state.partial, rows), unfed=without(state.unfed, rows))

    def select_rows(self, state: SamplerState, rows: Sequence[int]) -> SamplerState:
        """Keeps only ``rows`` (e.g. drops finished episodes), compacting into a smaller batch bucket; a row
        listed twice is copied (forking a shared prompt into several episodes)."""
        index = self._padded_rows(rows, state.batch_size)
        keep = index < state.batch_size
        with sharding.use_mesh(self.mesh):
            cache = prefill.take_rows_program(state.cache, jnp.asarray(index), window=state.cache.capacity)
        lengths = np.append(state.lengths[list(rows)], [0] * (len(index) - len(rows)))
        return SamplerState(cache=cache, lengths=lengths, partial=moved(state.partial, index, keep),
                            unfed=moved(state.unfed, index, keep))

    def _padded_rows(self, rows: Sequence[int], batch: int) -> np.ndarray:
        """``rows`` padded to their batch bucket with ``batch`` (out of range: an empty row when gathered,
        skipped when written back)."""
        index = np.full((self.batch_bucket(len(rows)),), batch, np.int32)
        index[: len(rows)] = rows
        return index


def _with_unfed(state: SamplerState, new_tokens: Sequence[Sequence[int] | None]
                ) -> tuple[SamplerState, list[list[int]]]:
    """Every row's new ids (``[]`` for rows given none), a row's unfed last id (a turn that finished in an
    early-returning call's last step) written ahead of them; the state without the unfed ids now given."""
    rows = [list(t or ()) for t in new_tokens] + [[]] * (state.batch_size - len(new_tokens))
    given = [b for b in state.unfed if rows[b]]
    if not given:
        return state, rows
    for b in given:
        rows[b] = [state.unfed[b]] + rows[b]
    return dataclasses.replace(state, unfed=without(state.unfed, given)), rows


@partial(jax.jit, donate_argnames=("cache",))
def _copy_row_program(source: KVCache, row: jax.Array, cache: KVCache, into: jax.Array) -> KVCache:
    put = lambda whole, part: jnp.where(into[:, None, None, None], part[row][None], whole)
    return dataclasses.replace(cache, keys=[put(k, s) for k, s in zip(cache.keys, source.keys)],
                               values=[put(v, s) for v, s in zip(cache.values, source.values)],
                               lengths=jnp.where(into, source.lengths[row], cache.lengths))


@partial(jax.jit, donate_argnames=("cache",))
def _clear_rows_program(cache: KVCache, clear: jax.Array) -> KVCache:
    return dataclasses.replace(cache, lengths=jnp.where(clear, 0, cache.lengths))


@partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty_cache_program(config: Any, batch: int, length: int, dtype: Any) -> KVCache:
    # Module-level so repeated rollouts of the same shape reuse one compiled program.
    return KVCache.zeros(config, batch, length, dtype)
