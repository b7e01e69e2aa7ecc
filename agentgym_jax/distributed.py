"""Multi-process runs on JAX's own multi-controller runtime (``jax.distributed``): one process per host, one
global mesh, each process feeding its own rows.

* :func:`initialize` connects the processes (from launcher flags, ``JAX_COORDINATOR_ADDRESS`` /
  ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or JAX's cluster auto-detection on SLURM, Open MPI and TPU pods)
  before anything touches a device. A process that dies or stops answering makes the others stop within the
  heartbeat timeout (JAX's coordination service aborts them, naming the task that went silent).
* :func:`allgather` and :func:`barrier` exchange small host objects (rollout summaries, row counts) through the
  coordination service's key-value store, with a timeout and an error that says which process did not answer.
* :func:`local_mesh` and :func:`local_view` give each process a view of the global parameters on its own devices
  (no copy), so it samples its episodes without talking to the other hosts.
* :func:`global_rows` and :func:`local_rows` turn a process's host rows into the global row-sharded array and
  back (``jax.make_array_from_process_local_data``).

With one process every helper is the identity (or a no-op).
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from agentgym_jax.errors import ConfigError

DEFAULT_TIMEOUT_S = 300  # a host exchange waits this long for the slowest process (rollouts can be uneven)
DEFAULT_HEARTBEAT_S = 30  # a dead or unreachable process stops the others within about this long

_exchanges = 0  # numbers the host exchanges; every process makes the same calls in the same order


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_main() -> bool:
    """True on the process that writes logs, reports, plots and exports (process 0)."""
    return jax.process_index() == 0


def _cluster_detected() -> bool:
    """A multi-process launch JAX can configure itself (SLURM with several tasks, Open MPI, a TPU pod)."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return True
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    return bool(os.environ.get("TPU_WORKER_HOSTNAMES", "").count(","))  # more than one TPU worker


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_S,
               initialization_timeout_s: int = 300) -> bool:
    """Connects this process to the others; returns True for a multi-process run.

    Arguments left None are read from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``;
    with none of them set, a detected cluster (SLURM, Open MPI, TPU pod) is configured by JAX itself, and
    otherwise the run stays one process. Must run before any device is used.
    """
    env = os.environ
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    count = num_processes if num_processes is not None else _int_env("JAX_NUM_PROCESSES")
    index = process_id if process_id is not None else _int_env("JAX_PROCESS_ID")
    given = [name for name, value in (("coordinator_address", address), ("num_processes", count),
                                      ("process_id", index)) if value is not None]
    if not given and not _cluster_detected():
        return False
    if given and len(given) < 3 and not _cluster_detected():
        missing = sorted({"coordinator_address", "num_processes", "process_id"} - set(given))
        raise ConfigError(f"a multi-process run needs all of --coordinator_address, --num_processes and "
                          f"--process_id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); "
                          f"missing {', '.join(missing)}")
    if count is not None and index is not None and not 0 <= index < count:
        raise ConfigError(f"--process_id={index} must be in [0, {count}) for --num_processes={count}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    # if the coordinator cannot be reached, JAX's runtime aborts this process after the timeout: say what it tried
    print(f"process {index if index is not None else '?'}/{count if count is not None else '?'}: connecting to the "
          f"coordinator {address or '(auto-detected)'} for up to {initialization_timeout_s} s", file=sys.stderr,
          flush=True)
    try:
        jax.distributed.initialize(address, count, index, heartbeat_timeout_seconds=int(heartbeat_timeout_s),
                                   initialization_timeout=int(initialization_timeout_s))
    except (RuntimeError, ValueError) as error:  # unreachable coordinator, a process that never came, bad address
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"could not connect the processes (coordinator {address or 'auto-detected'}, "
                          f"{count} processes, this is {index}) within {initialization_timeout_s} s: {first_line}; "
                          "start every process with the same --coordinator_address and --num_processes and a "
                          "distinct --process_id") from None
    return jax.process_count() > 1


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


# ---------------------------------------------------------------------------------------------- host exchanges


def _client() -> Any:
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return global_state.client


def allgather(value: Any, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Every process's ``value`` (picklable), in process order; ``[value]`` in a one-process run.

    ``what`` names the exchange in the error raised when a process does not answer within ``timeout_s``.
    """
    if jax.process_count() == 1:
        return [value]
    global _exchanges
    _exchanges += 1
    client, me = _client(), jax.process_index()
    prefix = f"agentgym/{_exchanges}"
    client.key_value_set_bytes(f"{prefix}/{me}", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    values = []
    for other in range(jax.process_count()):
        if other == me:
            values.append(value)
            continue
        try:
            payload = client.blocking_key_value_get_bytes(f"{prefix}/{other}", int(timeout_s * 1000))
        except Exception as error:  # noqa: BLE001 - the runtime raises its own error type
            raise RuntimeError(f"process {other} did not send its {what} within {timeout_s:.0f} s: it may have "
                               f"died or be stuck; restart all processes with --resume ({error})") from None
        values.append(pickle.loads(payload))
    barrier(f"{what} read", timeout_s)  # everyone has read every key: each process deletes its own
    client.key_value_delete(f"{prefix}/{me}")
    return values


def barrier(what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Waits until every process reaches the same barrier (a no-op in a one-process run)."""
    if jax.process_count() == 1:
        return
    global _exchanges
    _exchanges += 1
    try:
        _client().wait_at_barrier(f"agentgym/barrier/{_exchanges}", int(timeout_s * 1000))
    except Exception as error:  # noqa: BLE001
        raise RuntimeError(f"not every process reached '{what}' within {timeout_s:.0f} s: one may have died or be "
                           f"stuck; restart all processes with --resume ({error})") from None


def share(items: Sequence[Any], what: str = "items") -> list[Any]:
    """This process's contiguous, equal share of ``items`` (all of them in a one-process run)."""
    count, index = jax.process_count(), jax.process_index()
    if len(items) % count:
        raise ConfigError(f"{len(items)} {what} cannot be split evenly over {count} processes; use a multiple "
                          f"of {count}")
    size = len(items) // count
    return list(items[index * size: (index + 1) * size])


# ---------------------------------------------------------------------------------------------- meshes and arrays


def check_mesh(mesh: Mesh) -> None:
    """A multi-process mesh must give each process whole ``data`` slices: its devices then hold a full replica
    of every parameter (the fsdp and tensor axes stay within a host)."""
    if jax.process_count() == 1:
        return
    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    for row in procs:
        if len(set(row.ravel().tolist())) != 1:
            raise ConfigError(
                f"mesh {tuple(mesh.shape.values())} spreads one (fsdp, tensor) slice over several processes; in "
                f"a multi-process run fsdp x tensor must divide the devices of one process "
                f"({jax.local_device_count()}) and data must be a multiple of the process count "
                f"({jax.process_count()})")


def local_mesh(mesh: Mesh | None) -> Mesh | None:
    """This process's part of ``mesh``: its ``data`` slices, with the same axis names (``mesh`` itself in a
    one-process run)."""
    if mesh is None or jax.process_count() == 1:
        return mesh
    check_mesh(mesh)
    mine = [i for i in range(mesh.devices.shape[0]) if mesh.devices[i].ravel()[0].process_index == jax.process_index()]
    return Mesh(mesh.devices[mine], mesh.axis_names)


def local_view(tree: Any, mesh: Mesh | None) -> Any:
    """The arrays of ``tree`` (sharded over the global ``mesh``) as arrays over :func:`local_mesh` built from this
    process's shards: no copy. Identity in a one-process run."""
    if mesh is None or jax.process_count() == 1:
        return tree
    local = local_mesh(mesh)

    def view(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        if any(_names(part) & {"data"} for part in spec):
            raise ConfigError("a parameter sharded over the mesh's 'data' axis cannot be viewed per process")
        shards = [s.data for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(local, spec), shards)

    return jax.tree.map(view, tree)


def _names(part: Any) -> set[str]:
    if part is None:
        return set()
    return set(part) if isinstance(part, tuple) else {part}


def global_rows(local: np.ndarray, mesh: Mesh, spec: P) -> jax.Array:
    """The global array whose rows (the sharded axis of ``spec``) are every process's ``local`` rows in process
    order; ``jax.device_put`` in a one-process run."""
    sharding = NamedSharding(mesh, spec)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local)


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a global array whose rows are every process's rows in process order (as built by
    :func:`global_rows`), whether the program left it split over its rows or replicated; the whole array in a
    one-process run."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    total, count, index = x.shape[0], jax.process_count(), jax.process_index()
    low, high = index * total // count, (index + 1) * total // count
    pieces: dict[int, tuple[int, Any]] = {}
    for shard in x.addressable_shards:
        rows, *rest = shard.index
        if any(part.start not in (None, 0) or part.stop not in (None, size) for part, size in zip(rest, x.shape[1:])):
            raise ValueError("local_rows reads arrays split over their first axis only")
        pieces.setdefault(rows.start or 0, (total if rows.stop is None else rows.stop, np.asarray(shard.data)))
    out, position = [], low
    while position < high:
        start = max(s for s in pieces if s <= position)
        stop, data = pieces[start]
        if stop <= position:
            raise ValueError(f"rows {position}..{high} of this process are not on its devices")
        end = min(stop, high)
        out.append(data[position - start: end - start])
        position = end
    return np.concatenate(out) if out else np.zeros((0, *x.shape[1:]), x.dtype)


def replicated_value(x: Any) -> Any:
    """The host value of an array every device holds whole (e.g. a loss), in any run."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(x.addressable_shards[0].data)
