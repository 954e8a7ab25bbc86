"""Values of a staged step moving between stages, in one process or across the processes of a job.

Where this sits::

    emit.mpmd.StagedStep (every process runs the same host schedule)
        |   move(x, want): a value to the next stage's NamedSharding
        v
    one process: jax.device_put          several processes: cross-host jax.device_put
                                         (JAX's transfer server, TCP between the processes)

A staged step runs multi-controller under ``jax.distributed``: every process runs the same host
loop over (stage, phase, microbatch), runs the programs of the stages whose devices it holds, and
stands in for the others' values with *placeholders* (``jax.Array`` s with no shards on this
process). A value that crosses processes goes with one cross-host ``jax.device_put``.

What JAX 0.10.2 does across processes (probed on CPU, two and three processes on loopback):

- ``jax.device_put(x, sharding)`` from one process's devices to another's works only when the CPU
  client has a transfer server: ``jax_cross_host_transfer_socket_address`` set (``HOST:PORT`` of
  this process, a real port) before ``jax.distributed.initialize``; the servers find each other
  through the job's key-value store and send the bytes over their own TCP sockets. Without it:
  ``ValueError: The backend ... does not support cross-host device transfers. Please set
  jax_cross_host_transfer_socket_address ...``. ``hulkjax launch`` sets it (:func:`enable`).
- Source and destination must tile the array the same way on the same number of devices;
  otherwise ``NotImplementedError: Cannot reshard an input that is not fully addressable`` (same
  count, another tiling) or ``INVALID_ARGUMENT: CopyArrays only supports destination device list
  of the same size as the array device lists``. So the source first lays the value out, on its
  own devices, as the destination will hold it (the *wire* layout: the destination's mesh shape,
  axis names and spec over the source's devices), and the transfer then copies shard ``i`` to
  destination device ``i``. Where the source has fewer devices than the destination, the value
  crosses replicated onto as many destination devices and is laid out there.
- Every process must call every cross-host ``device_put``, in the same order, also processes that
  hold neither end (they pass a placeholder): the transfers are matched by a per-process
  sequence. A process skipping one pairs the next transfers wrongly (observed: a hang, and a
  receiver handed another transfer's data). The staged step's host loop is the same on every
  process, so its order is.
- The send reads the source buffer after ``device_put`` has returned, and a program that donates
  that buffer meanwhile breaks it (``CopyRawSubBufferToHost() called on deleted or donated
  buffer``): the source sends a copy of its own.
- The sender's part of a transfer runs on the CPU client's worker threads after ``device_put``
  has returned. A job-wide collective entered meanwhile (``multihost_utils.process_allgather``,
  gloo) holds those threads while it waits for the receiver, which waits for the data: a
  deadlock (observed within a few iterations of send-then-allgather on 2 devices per process).
  :func:`settle` waits until every process holds what it was sent (a barrier of the job's
  coordination service, which holds no XLA thread); a staged step settles before it returns.
- A process dispatches ahead: its programs and sends are queued without waiting for values that
  are still to come from another process. XLA:CPU holds at most 32 computations in flight per
  device (the CPU client's ``max_inflight_computations_per_device``), and computations waiting
  for such values fill that queue; the dispatch of the send the other process waits for then
  blocks too, and the job deadlocks (observed: GPT-2 over two processes of two devices each,
  1F1B with 4 microbatches, both on loopback and between network namespaces; GPipe and 2
  microbatches were fine; ``py-spy`` / ``gdb`` show the receiver's threads in
  ``xla::Semaphore::ScopedAcquire`` under ``ExecuteLaunch``). So in a job a process dispatches
  a program only once its inputs *from other processes* have arrived (``StagedStep`` waits for
  them first, :func:`move` before re-laying out a received value): nothing waiting for another
  process is ever queued, while the transfers themselves go on in the background, overlapped
  with the programs already running (waiting at each receive instead also ends the deadlock,
  but holds back the dispatch of programs that do not need the value). Its own programs'
  values are not waited for: every queued program then depends only on work this process can
  finish alone. Waiting for them too (as ``StagedStep`` did until 2026-11-27) blocks the host
  on its own compute, and with it the receives it posts next (below), so a transfer into the
  process cannot start before the process's earlier programs have finished. Measured on the
  2-region WAN testbed (8-layer GPT, 1F1B): 2,074 -> 2,002 ms (2 stages x 4 microbatches) and
  1,840 -> 1,826 ms (x 8), within the run-to-run noise there: its 1F1B stages wait for each
  other's round trips (the cost model's discrete-event schedule predicts those stalls), not
  for their hosts.
- A transfer starts only once the receiving process has called its ``device_put``: the bytes
  are pulled (measured between shaped namespaces: a receiver asking 100 ms after the send got
  128 kB 12 ms after asking, the link's time). So a staged step sends each value as soon as
  its producer has been dispatched, and walks its programs in their predicted start order
  (``StagedStep``): sent at its reader instead, a value waited for both processes' host loops
  to reach the reader, and each send added to the step.
- XLA:CPU reads a send from the sender's device in the device's queue order, at the time both
  ends have posted it: programs the sender dispatched before that run first, and the send waits
  for them (measured, ``benchmarks/wan/transfer_time.py``: ~0.3 s of matmuls queued on the
  sender delay a 4 kB send to 254 ms; the receiver's own compute delays nothing). So a send
  goes at the link's time only when the receiver had posted before the sender dispatched its
  next program (on the WAN testbed most receives were posted first; a few, up to 37-130 ms
  late). A receive also takes CPU time from the receiving device's compute when they share a
  core (a quarter to a third of the transfer's time there): most of the testbed's send time
  beyond the link's alpha-beta time.
- Across hosts (or network namespaces) the bulk transports that carry the bytes must listen on a
  reachable address too (:func:`enable`).
- A ``jax.jit`` whose input lives on one process's devices and whose output sharding is on
  another's is refused (``Received incompatible devices for jitted computation``); a
  ``shard_map`` with ``ppermute`` over a mesh spanning both processes works (a collective-permute
  over gloo) but makes every transfer a program on every device of the job.

>>> import jax, numpy as np
>>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
>>> mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
>>> y = move(np.arange(4.0), NamedSharding(mesh, P("d")))
>>> [s.data.tolist() for s in y.addressable_shards]
[[0.0, 1.0], [2.0, 3.0]]
"""

from __future__ import annotations

import dataclasses
import itertools
import socket

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hulkjax.errors import ProcessLayoutError

SOCKET_FLAG = "jax_cross_host_transfer_socket_address"
"""JAX's flag for this process's transfer server address (``HOST:PORT``)."""

TRANSPORT_FLAG = "jax_cross_host_transport_addresses"
"""JAX's flag for the addresses its bulk transports listen on (comma-separated ``HOST:PORT``)."""

TRANSPORTS = 4
"""Bulk transports per process: JAX's default count (``0.0.0.0:0`` four times)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Crossing:
    """One value sent from one process's devices to another's.

    Attributes:
      src / dst: the processes holding the value before and after.  # tuple[int, ...]
      nbytes: bytes that crossed (one copy per destination device the wire layout fills).  # int
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]
    nbytes: int


def processes(sharding) -> frozenset[int]:
    """The processes whose devices hold some shard of ``sharding``."""
    return frozenset(d.process_index for d in sharding.device_set)


def holds(sharding) -> bool:
    """Whether this process holds a device of ``sharding``."""
    return jax.process_index() in processes(sharding)


def placeholder(shape, dtype, sharding) -> jax.Array:
    """A ``jax.Array`` laid out as ``sharding`` with no shards on this process: what a process
    holds of a value that lives on other processes' devices."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def enable(host: str) -> str:
    """Turn on cross-host ``device_put`` for this process: a transfer server at ``host`` and a
    free port, and the bulk transports that carry the bytes listening on ``host`` too. Call
    before ``jax.distributed.initialize`` (JAX reads the flags when it creates the CPU client).
    Returns the server's address.

    ``host`` must be an address of this machine that the other processes reach
    (:func:`reachable_address`). The transports matter once the processes are on different
    hosts (or network namespaces): JAX's default, ``0.0.0.0:0``, is published as such, and a
    peer then connects to *its own* host (observed: ``socket_bulk_transport.cc: Check failed:
    connect ... Connection refused``, which kills the process). On loopback both are the same
    machine and the default happens to work. A user's own setting of either flag (e.g. the
    environment variable ``JAX_CROSS_HOST_TRANSFER_SOCKET_ADDRESS``) is kept.
    """
    if not jax.config.read(TRANSPORT_FLAG):
        jax.config.update(TRANSPORT_FLAG, ",".join([f"{host}:0"] * TRANSPORTS))
    current = jax.config.read(SOCKET_FLAG)
    if current:
        return current
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))  # port 0 itself does not work: the server publishes the port it is given
        port = s.getsockname()[1]
    address = f"{host}:{port}"
    jax.config.update(SOCKET_FLAG, address)
    return address


def reachable_address(coordinator: str) -> str:
    """This machine's address on the route to ``coordinator`` (``HOST:PORT``): where the other
    processes of the job reach this one (``127.0.0.1`` on loopback)."""
    host, _, port = coordinator.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host.strip("[]"), int(port or 1)))  # UDP: no packet is sent
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def check_enabled(what: str) -> None:
    """Raise unless this process can send values to other processes' devices."""
    if jax.process_count() == 1 or jax.config.read(SOCKET_FLAG):
        return
    from jax.extend.backend import get_backend

    backend = get_backend()
    if getattr(backend, "supports_cross_host_transfers", False):
        return
    raise ProcessLayoutError(
        f"{what} sends values between the {jax.process_count()} processes of this job, but "
        f"JAX's cross-host transfers are off on this {backend.platform} backend. Start every "
        f"process with jax.config.update({SOCKET_FLAG!r}, 'THIS_HOST:FREE_PORT') (or the "
        f"environment variable {SOCKET_FLAG.upper()}) before jax.distributed.initialize; "
        f"hulkjax launch does this for you.")


def move(x, want: NamedSharding, crossings: list | None = None):
    """``x`` laid out as ``want``; called by every process of the job with the same arguments
    (placeholders where a process holds no shard).

    Within the processes that hold it, a ``jax.device_put``; a process holding no device of
    ``want`` gets a placeholder. Between processes, a cross-host ``jax.device_put`` through the
    wire layout (module docstring), appended to ``crossings`` as a :class:`Crossing`.

    Args:
      x: a ``jax.Array`` (or placeholder), or a host value that is the same on every process.
      want: the layout to move it to.
      crossings: where to record a transfer between processes.
    """
    if not isinstance(x, jax.Array):  # a host value, the same on every process
        if holds(want):
            return jax.device_put(x, want)
        return placeholder(np.shape(x), jax.dtypes.canonicalize_dtype(np.result_type(x)), want)
    src, dst = processes(x.sharding), processes(want)
    me = jax.process_index()
    if src == dst:
        return jax.device_put(x, want) if me in dst else placeholder(x.shape, x.dtype, want)
    src_devices = sorted(x.sharding.device_set, key=lambda d: d.id)
    dst_devices = list(want.mesh.devices.flat)
    n = len(dst_devices)
    if len(src_devices) >= n:  # the destination's tiling, on as many of the source's devices
        grid = np.empty(n, dtype=object)
        grid[:] = src_devices[:n]
        wire_src = NamedSharding(Mesh(grid.reshape(want.mesh.devices.shape), want.mesh.axis_names,
                                      axis_types=want.mesh.axis_types), want.spec)
        wire_dst = want
    else:  # replicated onto as many destination devices, laid out there
        m = len(src_devices)
        wire_src = _replicated(src_devices)
        wire_dst = _replicated(dst_devices[:m])
    # The send reads its buffer after device_put returns, and does not keep a later program
    # from donating it (observed: "CopyRawSubBufferToHost() called on deleted or donated
    # buffer"): send a copy of its own.
    sent = jax.device_put(jax.numpy.copy(x), wire_src) if me in src else \
        placeholder(x.shape, x.dtype, wire_src)
    y = jax.device_put(sent, wire_dst)
    if crossings is not None:
        shard = int(np.prod(wire_dst.shard_shape(x.shape), dtype=np.int64))
        crossings.append(Crossing(tuple(sorted(src)), tuple(sorted(dst)),
                                  shard * x.dtype.itemsize * len(wire_dst.device_set)))
    if wire_dst is not want:  # a copy on the received value: not queued before it is here
        y = jax.device_put(y.block_until_ready(), want) if me in dst else \
            placeholder(x.shape, x.dtype, want)
    return y


def relayout_on_arrival(x, want: NamedSharding) -> bool:
    """Whether :func:`move` of ``x`` to ``want`` waits, on the receiving process, for the value
    to arrive (it crosses replicated and is laid out again there: fewer source devices than
    destination devices)."""
    if not isinstance(x, jax.Array):
        return False
    src, dst = processes(x.sharding), processes(want)
    return src != dst and len(x.sharding.device_set) < len(want.mesh.devices.flat)


_settled = itertools.count()
SETTLE_TIMEOUT_MS = 600_000


def settle(arrays) -> None:
    """Wait until ``arrays`` (this process's results) are computed and every process of the job
    has done the same: afterwards every cross-host transfer they consumed has been delivered, so
    a job-wide collective cannot deadlock against a pending send (module docstring).

    Every process calls it the same number of times in the same order (the barrier's name is
    the count). One process: only the wait for ``arrays``.
    """
    jax.block_until_ready(arrays)
    if jax.process_count() == 1:
        return
    # JAX 0.10 has no public barrier outside XLA (multihost_utils.sync_global_devices is a
    # collective); its own array serialization uses the coordination client the same way.
    from jax._src import distributed

    client = distributed.global_state.client
    if client is not None:
        client.wait_at_barrier(f"hulkjax-transfers-{next(_settled)}", SETTLE_TIMEOUT_MS)


def _replicated(devices) -> NamedSharding:
    grid = np.empty(len(devices), dtype=object)
    grid[:] = list(devices)
    return NamedSharding(Mesh(grid, ("wire",), axis_types=(jax.sharding.AxisType.Auto,)),
                         PartitionSpec())


def gather(tree, device, crossings: list | None = None):
    """Every leaf of ``tree`` as a host numpy array on the process holding ``device``
    (``None`` on the others); every process calls it with its own view of the same tree, and
    it returns once every process has (:func:`settle`).

    Leaves that are not ``jax.Array`` s are host values, the same on every process.
    """
    target = _replicated([device])
    mine = device.process_index == jax.process_index()

    def one(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x) if mine else None
        y = move(x, target, crossings)
        return np.asarray(y) if mine else None

    out = jax.tree_util.tree_map(one, tree)
    settle(())
    return out
