"""Processes on a topology: which devices each process of a job holds.

Processes map onto the topology's hierarchy: with ``P`` processes of ``L`` local devices each
(``P * L == topology.num_devices``), process ``p`` holds topology devices ``p*L .. (p+1)*L - 1``.
Topology devices are ordered region > node > device, so that block is whole nodes (one process per
node, or per region); a layout that would split a node across processes is refused. The mesh is the
device order reshaped row-major (:meth:`Topology.mesh`), so the mesh axes along which the process
index changes are the ones whose collectives cross process boundaries (gloo over TCP on CPU).

>>> import hulkjax as hj
>>> layout = process_layout(hj.Topology.grid((2, 2), ("proc", "dev")), 2)
>>> layout.blocks, layout.process_axes, layout.local_axes
(((0, 1), (2, 3)), ('proc',), ('dev',))
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hulkjax.errors import ProcessLayoutError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProcessLayout:
    """Which topology devices each process of a job holds.

    Attributes:
      processes: number of processes.  # int
      local_devices: devices per process; ``processes * local_devices == topology.num_devices``.
      blocks: per process, the topology device ids it holds (contiguous).  # tuple[tuple[int, ...]]
      level: what one process is in the topology's hierarchy: ``"node"``, ``"region"``,
        ``"nodes"`` (several whole nodes of one or more regions) or ``"mesh block"`` (topologies
        with per-axis links, whose hierarchy names no hosts).  # str
      process_axes: mesh axes along which the process index changes: their collectives cross
        processes.  # tuple[str, ...]
      local_axes: mesh axes whose collectives stay inside one process.  # tuple[str, ...]
    """

    processes: int
    local_devices: int
    blocks: tuple[tuple[int, ...], ...]
    level: str
    process_axes: tuple[str, ...]
    local_axes: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"processes": self.processes, "local_devices": self.local_devices,
                "blocks": [list(b) for b in self.blocks], "level": self.level,
                "process_axes": list(self.process_axes), "local_axes": list(self.local_axes)}


def process_layout(topology, processes: int, local_devices: int | None = None) -> ProcessLayout:
    """Map ``processes`` processes onto ``topology``: process ``p`` holds the ``p``-th block.

    Args:
      topology: a :class:`hulkjax.Topology`.
      processes: number of processes (hosts) in the job.
      local_devices: devices per process; default ``topology.num_devices // processes``.

    Raises:
      ProcessLayoutError: ``processes * local_devices != topology.num_devices``, or a block would
        split one of the topology's nodes across processes.

    >>> import hulkjax as hj
    >>> process_layout(hj.Topology.preset("hetero"), 2).level
    'node'
    """
    n = topology.num_devices
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ProcessLayoutError(f"processes={processes!r} must be a positive integer.")
    if local_devices is None:
        if n % processes:
            raise ProcessLayoutError(
                f"topology '{topology.name}' has {n} devices, which {processes} processes cannot "
                f"share equally. Use a process count that divides {n} "
                f"({_divisors_hint(topology)}), or a topology with {processes} x k devices.")
        local_devices = n // processes
    if processes * local_devices != n:
        raise ProcessLayoutError(
            f"topology '{topology.name}' has {n} devices, but the job has {processes} processes x "
            f"{local_devices} local devices = {processes * local_devices}. Every topology device "
            f"must be one device of one process: use {n // local_devices if n % local_devices == 0 else '?'}"
            f" processes of {local_devices} devices, {processes} processes of "
            f"{n / processes:g} devices, or a topology of {processes * local_devices} devices.")
    blocks = tuple(tuple(range(p * local_devices, (p + 1) * local_devices))
                   for p in range(processes))
    owner = np.repeat(np.arange(processes), local_devices)
    if topology.axis_links is not None:
        level = "mesh block"
    else:
        for node, ids in zip(topology.nodes, topology.groups("node")):
            owners = sorted({int(owner[i]) for i in ids})
            if len(owners) > 1:
                raise ProcessLayoutError(
                    f"{processes} processes of {local_devices} devices would split node "
                    f"{node!r} ({len(ids)} devices, topology ids {ids[0]}..{ids[-1]}) across "
                    f"processes {owners}; a node is one host, and its devices talk over the "
                    f"node's links, not the network. Launch one process per node "
                    f"(--processes {len(topology.nodes)}) or per region "
                    f"(--processes {len(topology.regions)}).")
        nodes = {tuple(g) for g in topology.groups("node")}
        regions = {tuple(g) for g in topology.groups("region")}
        level = ("node" if set(blocks) <= nodes else "region" if set(blocks) <= regions
                 else "nodes")
    grid = owner.reshape(topology.shape)
    varies = [bool(np.any(np.diff(grid, axis=k) != 0)) for k in range(grid.ndim)]
    return ProcessLayout(
        processes=processes, local_devices=local_devices, blocks=blocks, level=level,
        process_axes=tuple(a for a, v in zip(topology.axis_names, varies) if v),
        local_axes=tuple(a for a, v in zip(topology.axis_names, varies) if not v))


def _divisors_hint(topology) -> str:
    n = topology.num_devices
    counts = [d for d in range(1, n + 1) if n % d == 0]
    if topology.axis_links is None:
        counts = [d for d in counts if d <= len(topology.nodes)
                  and len(topology.nodes) % d == 0] or counts
    return "e.g. " + ", ".join(map(str, counts))


def ordered_devices(layout: ProcessLayout) -> list:
    """The job's global devices in topology order: process ``p``'s devices form block ``p``.

    ``jax.devices()`` of a multi-process job lists every process's devices; they are sorted by
    (process index, device id) here so that ``Topology.mesh(devices)`` puts process ``p`` on the
    ``p``-th node / region block whatever order the platform lists them in.

    Raises:
      ProcessLayoutError: the job's process count or some process's device count differs from the
        layout.
    """
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    want = {p: layout.local_devices for p in range(layout.processes)}
    if per_process != want:
        raise ProcessLayoutError(
            f"the job's devices per process are {per_process}, the topology needs "
            f"{layout.processes} processes x {layout.local_devices} devices ({want}). Start "
            f"{layout.processes} processes, each with {layout.local_devices} local devices "
            f"(on CPU: --local-devices {layout.local_devices}; on GPU hosts: that many visible "
            f"GPUs, e.g. CUDA_VISIBLE_DEVICES).")
    return devices


def check_stages(plan, layout: ProcessLayout) -> None:
    """A staged plan runs each stage in one process: refuse a layout that splits a stage.

    Raises:
      ProcessLayoutError: a stage's devices belong to several processes (which, and how to launch
        instead).

    >>> import types, hulkjax as hj
    >>> from hulkjax.plan import Stage
    >>> split = Stage(devices=(1, 2), layers=(), axis_names=("d",), mesh_shape=(2,))
    >>> try:
    ...     check_stages(types.SimpleNamespace(stages=(split,)),
    ...                  process_layout(hj.Topology.grid((2, 2), ("proc", "dev")), 2))
    ... except ProcessLayoutError as e:
    ...     print(str(e)[:77])
    stage 0 of the staged plan runs on topology devices [1, 2], which 2 processes
    """
    if plan.stages is None:
        return
    owner = {d: p for p, block in enumerate(layout.blocks) for d in block}
    for k, st in enumerate(plan.stages):
        procs = sorted({owner[d] for d in st.devices if d in owner})
        if len(procs) > 1:
            sizes = sorted({len(s.devices) for s in plan.stages})
            groups = len({tuple(s.devices) for s in plan.stages})  # interleaved chunks share one
            raise ProcessLayoutError(
                f"stage {k} of the staged plan runs on topology devices {list(st.devices)}, "
                f"which {layout.processes} processes of {layout.local_devices} devices split "
                f"across processes {procs}. Launch runs each stage in one process (values cross "
                f"processes only between stages): use as many processes as the plan's device "
                f"groups hold whole stages (stage sizes {sizes}; e.g. --processes "
                f"{groups} for one process per device group), or plan stages for these "
                f"processes' {layout.local_devices}-device blocks.")
