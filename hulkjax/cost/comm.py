"""Alpha-beta times of collectives over mesh axes, and what a layout change costs.

A collective over several axes runs hierarchically (NCCL, TPUs), one axis at a time: reduce-scatter
over the fast axes first (full data on fast links), all-reduce over the slowest on the reduced
piece, then all-gather back; or as one flat ring over all its devices (XLA:CPU's gloo,
``hierarchical=False``), at the slowest link's bandwidth and latency (charged to that axis). Per
axis, with ``n`` devices, bandwidth ``bw`` (bytes/s per device per direction) and latency ``a``, a
ring moves:

* all-reduce ``B`` bytes: ``2 (n-1)/n B / bw + 2 (n-1) a``
* reduce-scatter ``B`` (full operand) and all-gather ``B`` (full result): ``(n-1)/n B / bw + (n-1) a``
* all-to-all of a ``B``-byte block: ``(n-1)/n B / bw + (n-1) a``
* collective-permute of a ``B``-byte block (one exchange step): ``B / bw + a``

>>> from hulkjax.topology import Topology
>>> topo = Topology.grid((4,), ("x",), bandwidth=1e9, latency=0.0)
>>> collective_time("all-reduce", 4e9, ("x",), topo)   # 2 * 3/4 * 4 GB / 1 GB/s
{'x': 6.0}
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from hulkjax.plan.collectives import Comm
from hulkjax.plan.specs import Spec, dim_of, local_shape
from hulkjax.trace.graph import dtype_size


def _order(axes, topology, fast_first: bool):
    return sorted(axes, key=lambda a: topology.axis_bandwidth(a), reverse=fast_first)


def _flat(axes, topology):
    """One ring over several axes: its size, bottleneck bandwidth and latency, and the axis
    charged (the slowest)."""
    n = 1
    for a in axes:
        n *= topology.axis_size(a)
    slowest = min(axes, key=lambda a: (topology.axis_bandwidth(a), -topology.axis_latency(a)))
    return n, topology.axis_bandwidth(slowest), max(topology.axis_latency(a) for a in axes), slowest


def collective_time(kind: str, nbytes: float, axes, topology, *, hierarchical: bool = True,
                    latency_scale: float = 1.0) -> dict[str, float]:
    """Seconds spent on each mesh axis by one collective (see the module docstring).

    ``latency_scale`` scales the latency terms (a collective combined with others pays its share).
    """
    out: dict[str, float] = {}
    axes = [a for a in axes if topology.axis_size(a) > 1]
    if not axes or nbytes <= 0:
        return out

    def ring(a, b, passes=1):
        n = topology.axis_size(a)
        return passes * ((n - 1) / n * b / topology.axis_bandwidth(a)
                         + (n - 1) * topology.axis_latency(a) * latency_scale)

    if len(axes) > 1 and not hierarchical and kind != "collective-permute":
        n, bw, lat, slowest = _flat(axes, topology)
        passes = 2 if kind == "all-reduce" else 1
        return {slowest: passes * ((n - 1) / n * nbytes / bw + (n - 1) * lat * latency_scale)}

    if kind == "all-reduce":
        order = _order(axes, topology, fast_first=True)
        b = nbytes
        for a in order[:-1]:
            out[a] = out.get(a, 0.0) + ring(a, b, passes=2)  # reduce-scatter + all-gather
            b /= topology.axis_size(a)
        out[order[-1]] = out.get(order[-1], 0.0) + ring(order[-1], b, passes=2)
    elif kind == "reduce-scatter":
        b = nbytes
        for a in _order(axes, topology, fast_first=True):
            out[a] = ring(a, b)
            b /= topology.axis_size(a)
    elif kind == "all-gather":
        total = 1
        for a in axes:
            total *= topology.axis_size(a)
        b = nbytes / total
        for a in _order(axes, topology, fast_first=False):  # slow links carry the small pieces
            b *= topology.axis_size(a)
            out[a] = ring(a, b)
    elif kind == "all-to-all":
        for a in axes:
            out[a] = ring(a, nbytes)
    elif kind == "collective-permute":  # one exchange step: every device sends its block once
        for a in axes:
            out[a] = nbytes / topology.axis_bandwidth(a) + topology.axis_latency(a) * latency_scale
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    return out


def axis_bytes(kind: str, nbytes: float, axes, topology, *,
               hierarchical: bool = True) -> dict[str, float]:
    """Bytes each device sends over each axis's links for one collective (same ring model; a flat
    ring's are charged to its slowest axis)."""
    out: dict[str, float] = {}
    axes = [a for a in axes if topology.axis_size(a) > 1]
    if len(axes) > 1 and not hierarchical and kind != "collective-permute":
        n, _, _, slowest = _flat(axes, topology)
        return {slowest: (2 if kind == "all-reduce" else 1) * (n - 1) / n * nbytes}
    if kind == "all-reduce":
        order = _order(axes, topology, fast_first=True)
        b = nbytes
        for a in order:
            n = topology.axis_size(a)
            out[a] = 2 * (n - 1) / n * b
            b /= n
    elif kind == "reduce-scatter":
        b = nbytes
        for a in _order(axes, topology, fast_first=True):
            n = topology.axis_size(a)
            out[a] = (n - 1) / n * b
            b /= n
    elif kind == "all-gather":
        total = 1
        for a in axes:
            total *= topology.axis_size(a)
        b = nbytes / total
        for a in _order(axes, topology, fast_first=False):
            n = topology.axis_size(a)
            b *= n
            out[a] = (n - 1) / n * b
    elif kind == "collective-permute":
        for a in axes:
            out[a] = float(nbytes)
    else:
        for a in axes:
            n = topology.axis_size(a)
            out[a] = (n - 1) / n * nbytes
    return out


def _tiles(spec: Spec, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Blocks per dimension."""
    return tuple(int(np.prod([sizes[a] for a in axes], dtype=np.int64)) for axes in spec)


def _tile_coords(spec: Spec, sizes: Mapping[str, int]) -> dict[tuple[int, ...], tuple[int, ...]]:
    """``{device coordinates: (block per dimension..., replica index)}`` as XLA numbers a
    ``NamedSharding``'s tiles: the axes on a dimension major to minor, the unused axes (the
    replicated ones) in mesh order."""
    names = list(sizes)
    used = [a for axes in spec for a in axes]
    rest = [a for a in names if a not in used]
    out = {}
    for coords in np.ndindex(*[sizes[a] for a in names]):
        at = dict(zip(names, coords))
        index = []
        for axes in (*spec, rest):
            k = 0
            for a in axes:
                k = k * sizes[a] + at[a]
            index.append(k)
        out[tuple(coords)] = tuple(index)
    return out


def _permute_axes(src: Spec, dst: Spec, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes along which a collective-permute from ``src`` to ``dst`` moves blocks.

    With the same blocks per dimension on both sides, XLA pairs the device at each tile index of
    ``dst`` with the device at the same index of ``src`` (replicas included): the axes are those
    along which a pair's coordinates differ. Otherwise (``dst`` refines ``src``): the axes on the
    dimensions that change."""
    names = list(sizes)
    if _tiles(src, sizes) == _tiles(dst, sizes):
        by_index = {i: c for c, i in _tile_coords(src, sizes).items()}
        moved: set[str] = set()
        for c, i in _tile_coords(dst, sizes).items():
            moved.update(a for a, x, y in zip(names, c, by_index[i]) if x != y)
    else:
        moved = {a for s, d in zip(src, dst) if s != d for a in (*s, *d)}
    return tuple(sorted(moved))


def _move_and_fill(src: Spec, dst: Spec) -> tuple[int, int, str, tuple[str, ...]] | None:
    """``(i, j, a, fill)`` when ``dst`` is ``src`` with the one axis ``a`` of dimension ``i`` moved
    to the unsharded dimension ``j`` and axes ``fill`` (none of them in ``src``) taking dimension
    ``i``; otherwise None."""
    changed = [d for d in range(len(src)) if src[d] != dst[d]]
    if len(changed) != 2:
        return None
    for i, j in (changed, changed[::-1]):
        if len(src[i]) == 1 and not src[j] and dst[j] == src[i] and dst[i] \
                and src[i][0] not in dst[i] and not set(dst[i]) & {x for axes in src for x in axes}:
            return i, j, src[i][0], dst[i]
    return None


def reshard_comms(shape, dtype: str, src: Spec, dst: Spec, sizes: Mapping[str, int]) -> tuple[Comm, ...]:
    """Collectives that turn layout ``src`` into ``dst``, as XLA's SPMD partitioner reshards.

    * Every ``dst`` block inside one ``src`` block (``dst`` refines ``src`` on every dimension):
      free where each device already holds its block (``(a,)`` to ``(a, b)``: a local slice),
      else one collective-permute of the ``dst`` block (``(a,)`` to ``(b,)`` on a ``2 x 4``
      mesh, ``(a, b)`` to ``(b, a)``: blocks dealt to other devices).
    * All the blocks of one dimension moving to another, where other axes wait (``(a,), ()`` to
      ``(), (b,)``): an all-to-all of the local block onto the new dimension, then a
      collective-permute of the ``dst`` block to the devices that want it.
    * Coarser blocks on one dimension, made of other axes (``(b,)`` to ``(a,)`` on a ``2 x 4``
      mesh): a collective-permute of the ``src`` block, then an all-gather of the ``dst`` block
      over the major source axes.
    * One axis moving to an unsharded dimension while new axes fill the one it leaves
      (``(a,), ()`` to ``(b,), (a,)`` on a ``2 x 4`` mesh): a local slice by the new axes, an
      all-to-all of the ``dst`` block, then a collective-permute of it; from the last dimension to
      the one before it, one all-to-all of the ``src`` block.
    * Otherwise per axis: only in ``src``, an all-gather (first: an all-to-all moves the gathered
      block); on different dimensions, an all-to-all per pair of dimensions; only in ``dst``, a
      local slice (free).

    Checked against XLA:CPU's compiled reshards (``tests/cost/test_reshard.py``). Known
    differences: on a ``2 x 2 x 2`` mesh a permute's axes in some reshards (its bytes are right),
    and two axes leaving one dimension together while another fills it (XLA exchanges one, permutes
    the other).

    >>> reshard_comms((8, 8), "float32", (("a", "b"), ()), (("b", "a"), ()), {"a": 2, "b": 2})
    (Comm(kind='collective-permute', axes=('a', 'b'), bytes=64, deferred=False),)
    """
    if src == dst:
        return ()
    item = dtype_size(dtype)

    def block(spec):
        return int(np.prod(local_shape(shape, spec, sizes), dtype=np.int64)) * item

    if all(d[:len(s)] == s for s, d in zip(src, dst)):
        return ()  # a local slice
    ns, nd = _tiles(src, sizes), _tiles(dst, sizes)
    if all(b % a == 0 for a, b in zip(ns, nd)):
        return (Comm("collective-permute", _permute_axes(src, dst, sizes), block(dst)),)
    changed = [d for d in range(len(ns)) if src[d] != dst[d]]
    if len(changed) == 1 and ns[changed[0]] % nd[changed[0]] == 0:
        d = changed[0]
        if dst[d] != src[d][:len(dst[d])]:
            # Coarser blocks on one dimension, from other axes: the blocks are dealt so that a
            # group along the major source axes holds each result block, then gathered there.
            ratio, group = ns[d] // nd[d], []
            for a in src[d]:
                if int(np.prod([sizes[x] for x in group], dtype=np.int64)) >= ratio:
                    break
                group.append(a)
            return (Comm("collective-permute", _permute_axes(src, dst, sizes), block(src)),
                    Comm("all-gather", tuple(sorted(group)), block(dst)))
    grow = [d for d in range(len(ns)) if nd[d] > ns[d]]
    shrink = [d for d in range(len(ns)) if nd[d] < ns[d]]
    if len(grow) == 1 and len(shrink) == 1 and nd[shrink[0]] == 1 \
            and nd[grow[0]] == ns[grow[0]] * ns[shrink[0]] \
            and all(ns[d] == nd[d] for d in range(len(ns)) if d not in (grow[0], shrink[0])):
        i, j = shrink[0], grow[0]
        moved = list(src)
        moved[j], moved[i] = (*src[j], *src[i]), ()
        moved = tuple(moved)
        if moved != dst and all(b % a == 0 for a, b in zip(_tiles(moved, sizes), nd)):
            return (Comm("all-to-all", tuple(sorted(src[i])), block(src)),
                    Comm("collective-permute", _permute_axes(moved, dst, sizes), block(dst)))
    gather, a2a = [], []
    for a in {x for axes in src for x in axes}:
        i, j = dim_of(src, a), dim_of(dst, a)
        if j is None:
            gather.append(a)
        elif i != j:
            a2a.append(a)
    moves = _move_and_fill(src, dst)
    if moves is not None and not gather:
        # One axis leaving dimension i for an empty dimension j while new axes fill i: the
        # partitioner slices i by the new axes first, exchanges the dst-sized block, and deals the
        # blocks to their devices, except when i is the last dimension and j the one before it
        # (there it exchanges the source block and slices after: no permute).
        i, j, a, fill = moves
        if i == len(shape) - 1 and j == i - 1:
            return (Comm("all-to-all", (a,), block(src)),)
        return (Comm("all-to-all", (a,), block(dst)),
                Comm("collective-permute", tuple(sorted({a, *fill})), block(dst)))
    permute: list[str] = []
    for s_axes, d_axes in zip(src, dst):
        stay = tuple(a for a in s_axes if a not in gather and a not in a2a)
        if stay and d_axes[:len(stay)] != stay:
            permute.extend(a for a in d_axes if a in stay or a not in s_axes)
    comms = []
    kept = tuple(tuple(a for a in axes if a not in gather) for axes in src)
    if a2a:
        # The gathers come first (the exchange moves the gathered block), and axes moving between
        # different pairs of dimensions are exchanged one pair at a time.
        pairs: dict[tuple[int, int], list[str]] = {}
        for a in sorted(a2a):
            pairs.setdefault((dim_of(src, a), dim_of(dst, a)), []).append(a)
        comms.extend(Comm("all-to-all", tuple(axes), block(kept)) for axes in pairs.values())
    if gather:
        comms.append(Comm("all-gather", tuple(sorted(gather)), block(kept)))
    if permute:
        nb = int(np.prod(local_shape(shape, dst, sizes), dtype=np.int64)) * item
        comms.append(Comm("collective-permute", tuple(sorted(set(permute))), nb))
    return tuple(comms)
