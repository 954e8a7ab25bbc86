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

import math
from collections.abc import Mapping
from functools import lru_cache

import numpy as np

from hulkjax.errors import InvalidPlanError, UncompilableLayoutChangeError
from hulkjax.plan.collectives import Comm
from hulkjax.plan.specs import Spec
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
    The devices' fixed cost per call (``Topology.collective_overhead``) is a latency term too,
    charged once to the axis that takes the longest.
    """
    out = _link_time(kind, nbytes, axes, topology, hierarchical, latency_scale)
    overhead = topology.collective_overhead() * latency_scale
    if overhead and out:
        a = max(out, key=out.get)
        out[a] += overhead
    return out


def _link_time(kind: str, nbytes: float, axes, topology, hierarchical: bool,
               latency_scale: float) -> dict[str, float]:
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


# ------------------------------------------------------------------------------------------------
# XLA's SPMD partitioner, replayed on tile assignments (PartitionedHlo::ReshardNoCache)
# ------------------------------------------------------------------------------------------------

class _Sh:
    """An ``HloSharding``: a device array, one dimension per array dimension plus, when
    ``partial``, a last dimension of replicas; ``tile is None``: replicated.

    Partially replicated ones are built as ``HloSharding::PartialTile`` builds those the
    partitioner makes (``PartiallyReplicateTiledShardingOnDims``, ``GetAllToAllSharding``,
    ``UngroupSharding``, ``AlignGroupsWith``, ``Split``/``MergeShardingDimension``): each group
    of replicas sorted by device id, whatever order the source's axes left it in. The permute
    that ends an all-to-all pairs that sorted order with ``dst``'s."""

    __slots__ = ("tile", "partial")

    def __init__(self, tile, partial=False):
        if tile is not None and partial and tile.shape[-1] == 1:
            tile, partial = tile.reshape(tile.shape[:-1]), False
        if tile is not None and partial and tile.shape[-1] == tile.size:
            tile, partial = None, False
        if tile is not None and partial:
            tile = np.sort(tile, axis=-1)
        self.tile, self.partial = tile, partial

    @property
    def rep(self):
        return self.tile is None

    def dims(self, rank):
        return (1,) * rank if self.tile is None else tuple(self.tile.shape[:rank])

    def __eq__(self, other):
        if self.tile is None or other.tile is None:
            return self.tile is None and other.tile is None
        return self.partial == other.partial and self.tile.shape == other.tile.shape \
            and bool((self.tile == other.tile).all())


class _Replay:
    """What the partitioner emits: ``(kind, device sets, bytes)``; ``trans`` maps the ids of
    the current (per-group) partitioning to real devices, one table per group."""

    def __init__(self, n, item):
        self.ops, self.item = [], item
        self.trans = [np.arange(n)]

    def emit(self, kind, sets, nbytes):
        if sets and len({len(s) for s in sets}) == 1:  # one array per table: [set, member]
            ids = np.asarray(sets)
            real = [t[ids] for t in self.trans]
        else:
            real = [t[np.asarray(s)][None, :] for t in self.trans for s in sets]
        self.ops.append((kind, real, int(nbytes)))


def _local(base, sh):
    rank = len(base)
    return tuple(-(-b // t) for b, t in zip(base, sh.dims(rank)))


def _nbytes(shape, item):
    return math.prod(int(x) for x in shape) * item


def _can_cp(s, t):
    return not s.rep and not t.rep and s.tile.shape == t.tile.shape and s.partial == t.partial \
        and not (s.tile == t.tile).all()


def _cp(s, t, base, rp):
    if s == t:
        return t
    pairs = list(zip(s.tile.ravel().tolist(), t.tile.ravel().tolist()))
    rp.emit("collective-permute", pairs, _nbytes(_local(base, s), rp.item))
    return t


def _num_tiles(sh, rank):
    return math.prod(sh.dims(rank))


def _a2a_dims(s, t, rank):
    """GetReshardAllToAllSourceTargetDims."""
    if s.rep or t.rep or s.tile.ndim != t.tile.ndim or _num_tiles(s, rank) != _num_tiles(t, rank):
        return None
    src, tgt = {}, {}
    for i in range(s.tile.ndim):
        if s.tile.shape[i] != t.tile.shape[i]:
            src.setdefault(s.tile.shape[i], []).append(i)
            tgt.setdefault(t.tile.shape[i], []).append(i)
    if not src or len(src) != len(tgt) or any(len(tgt.get(k, ())) != len(v) for k, v in src.items()):
        return None

    def remove(size, dim, table):
        table[size] = [a for a in table[size] if a != dim]
        if not table[size]:
            del table[size]

    out = []
    while src:
        size = min(src)
        i = src[size][-1]
        ti = t.tile.shape[i]
        if ti == size:
            remove(size, i, src)
            remove(size, i, tgt)
            continue
        cands = src[ti]
        k = 0
        if size == 1:
            while t.tile.shape[cands[k]] == 1 and k + 1 < len(cands):
                k += 1
        elif ti % size == 0:
            while t.tile.shape[cands[k]] != size and k + 1 < len(cands):
                k += 1
        else:
            return None
        j = cands[k]
        out.append((j, i))
        remove(ti, i, tgt)
        src[size][-1] = j
        remove(ti, j, src)
    return out


def _a2a_sharding(s, sdims, tdims):
    """GetAllToAllSharding."""
    tile = s.tile
    for sd, td in zip(sdims, tdims):
        if tile.shape[sd] % tile.shape[td]:
            # XLA CHECKs this only in debug builds; a release jaxlib divides by zero further on
            # and the process dies of SIGFPE (two pairs of dimensions swapped at once, the
            # second seeing the first's result: TryMultipleSourceTargetDims).
            raise UncompilableLayoutChangeError(
                f"XLA's partitioner would all-to-all tile dimension {sd} ({tile.shape[sd]} "
                f"tiles) onto dimension {td} ({tile.shape[td]} tiles), not a multiple: it divides "
                f"by zero there (GetAllToAllSharding)")
        shape1, added_s, added_t = [], 0, 0
        for i, n in enumerate(tile.shape):
            if i == sd:
                shape1 += [tile.shape[td], n // tile.shape[td]]
                added_s = len(shape1) - 1
            elif i == td:
                shape1 += [n, 1]
                added_t = len(shape1) - 1
            else:
                shape1.append(n)
        perm = list(range(len(shape1)))
        perm[added_s], perm[added_t] = perm[added_t], perm[added_s]
        shape2 = list(tile.shape)
        shape2[sd], shape2[td] = shape2[td], shape2[sd]
        tile = tile.reshape(shape1).transpose(perm).reshape(shape2)
    return _Sh(tile, s.partial)


def _a2a_groups(temp, tdims, sizes):
    """The all-to-all's device groups: devices whose tile indices agree except within the
    ``sizes[i]`` consecutive tiles of each target dimension ``tdims[i]``, in tile order."""
    shape = temp.tile.shape
    idx = np.indices(shape).reshape(len(shape), -1)  # row-major, as np.ndindex walks
    gid = np.zeros(idx.shape[1], dtype=np.int64)
    for d in range(len(shape)):
        if d in tdims:
            g = sizes[tdims.index(d)]
            gid = gid * (shape[d] // g) + idx[d] // g
        else:
            gid = gid * shape[d] + idx[d]
    order = np.argsort(gid, kind="stable")
    members = temp.tile.reshape(-1)[order]
    _, starts = np.unique(gid[order], return_index=True)
    return [m.tolist() for m in np.split(members, starts[1:])]


def _a2a(s, t, pairs, base, rp, multi=True):
    """ReshardWithAllToAll (with TryMultipleSourceTargetDims)."""
    if s == t:
        return t
    if not pairs:
        return _cp(s, t, base, rp)
    if multi:
        seen, src, tgt, sizes, rest = set(), [], [], [], []
        for sd, td in sorted(pairs, key=lambda p: p[1]):
            ok = sd not in seen and td not in seen and base[sd] % s.tile.shape[sd] == 0 \
                and base[td] % t.tile.shape[td] == 0
            if ok:
                src.append(sd)
                tgt.append(td)
                sizes.append(s.tile.shape[sd] // s.tile.shape[td])
                seen |= {sd, td}
            else:
                rest.append((sd, td))
        if len(src) >= 2:
            temp = _a2a_sharding(s, src, tgt)
            rp.emit("all-to-all", _a2a_groups(temp, tgt, sizes), _nbytes(_local(base, s), rp.item))
            return _a2a(temp, t, rest, base, rp, multi=False)
        return _a2a(s, t, pairs, base, rp, multi=False)
    sd, td = pairs[0]
    temp = _a2a_sharding(s, [sd], [td])
    size = s.tile.shape[sd] // s.tile.shape[td]
    rp.emit("all-to-all", _a2a_groups(temp, [td], [size]), _nbytes(_local(base, s), rp.item))
    return _a2a(temp, t, pairs[1:], base, rp)


def _is_subtiling(sub, sh, rank):
    """IsSubTilingOrEqualSharding: every device's ``sub`` tile lies inside its ``sh`` tile."""
    for d in range(rank):
        if sub.tile.shape[d] % sh.tile.shape[d]:
            return False
    where = np.empty((int(sh.tile.max()) + 1, sh.tile.ndim), dtype=np.int64)
    where[sh.tile.reshape(-1)] = np.indices(sh.tile.shape).reshape(sh.tile.ndim, -1).T
    idx = np.indices(sub.tile.shape).reshape(sub.tile.ndim, -1)
    j = where[sub.tile.reshape(-1)]
    for d in range(rank):
        n, m = sub.tile.shape[d], sh.tile.shape[d]
        if np.any(idx[d] * m // n != j[:, d]):
            return False
    return True


def _compatible(partial, target, rank):
    """PartialReplicateReshardCompatibleSharding."""
    if partial.rep or not partial.partial or target.rep:
        return None
    if partial.tile.size != target.tile.size:
        return None
    expand, sizes = [-1] * rank, []
    for d in range(rank):
        p, q = partial.tile.shape[d], target.tile.shape[d]
        if q % p:
            return None
        if q > p:
            expand[d] = len(sizes)
            sizes.append(q // p)
    if _is_subtiling(target, partial, rank):
        return target
    reshape = list(partial.tile.shape[:rank]) + sizes
    perm = []
    for d in range(rank):
        perm.append(d)
        if expand[d] > -1:
            perm.append(expand[d] + rank)
    if target.partial:
        reshape.append(target.tile.shape[-1])
        perm.append(len(reshape) - 1)
    tile = partial.tile.reshape(reshape).transpose(perm).reshape(target.tile.shape)
    return _Sh(tile, target.partial)


def _replication_groups(sh, dims):
    """GetPartitionGroupsForReplication: devices that differ only in their index on ``dims``."""
    tile = sh.tile
    keep = [d for d in range(tile.ndim) if d not in dims]
    moved = np.moveaxis(tile, list(dims), list(range(tile.ndim - len(dims), tile.ndim)))
    del keep
    return moved.reshape(-1, math.prod(tile.shape[d] for d in dims)).tolist()


def _gather_dims(sh, dims, shape, rp):
    """ReplicatePartial's all-gathers: one per dimension, the last first."""
    shape = list(shape)
    for d in reversed(dims):
        n = sh.tile.shape[d]
        if n == 1:
            continue
        shape[d] *= n
        rp.emit("all-gather", _replication_groups(sh, [d]), _nbytes(shape, rp.item))


def _replicate(s, base, rp):
    rank = len(base)
    local = _local(base, s)
    dims = [d for d in range(rank) if s.tile.shape[d] > 1 and base[d] != local[d]]
    _gather_dims(s, dims, local, rp)
    return _Sh(None)


def _group(sh, dims, shards=None):
    """GroupShardingOnDims: ``(device groups, in-group sharding)``."""
    tile = sh.tile
    shards = shards or [1] * len(dims)
    inner = list(tile.shape)
    gsizes = []
    for d, k in zip(dims, shards):
        gsizes.append(tile.shape[d] // k)
        inner[d] = k
    reshape, where = list(inner), {}
    for i, d in enumerate(sorted(dims)):
        where[d] = d + i
        reshape.insert(d + i, gsizes[dims.index(d)])
    perm = list(range(len(reshape)))
    for i, d in enumerate(dims):
        perm.remove(where[d])
        perm.insert(i, where[d])
    arr = tile.reshape(reshape).transpose(perm)
    groups = arr.reshape(math.prod(gsizes), -1)
    if math.prod(inner) == 1 or (sh.partial and math.prod(inner) == inner[-1]):
        return groups, _Sh(None), gsizes
    partial = sh.partial
    if partial and inner[-1] == 1:
        inner = inner[:-1]
        partial = False
    return groups, _Sh(np.arange(math.prod(inner)).reshape(inner), partial), gsizes


def _align(groups, inner, ref_groups):
    """AlignGroupsWith: the in-group sharding renumbered to the reference's groups."""
    owner = {int(d): g for g, row in enumerate(ref_groups) for d in row}
    for g, row in enumerate(groups):
        ref = {owner[int(d)] for d in row}
        if len(ref) != 1 or ref.pop() != g:
            return inner
    if inner.rep:
        return inner
    pos = {int(d): i for i, d in enumerate(ref_groups[0])}
    perm = np.array([pos[int(d)] for d in groups[0]])
    return _Sh(perm[inner.tile], inner.partial)


def _ungroup(groups, gsizes, dims, inner, rank):
    """UngroupSharding of ``inner`` over device groups ``groups`` split on ``dims``."""
    per = groups.shape[1]
    if inner.rep:
        itile = np.arange(per).reshape((1,) * rank + ((per,) if per != 1 or rank in dims else ()))
        partial = itile.ndim > rank
    else:
        itile, partial = inner.tile, inner.partial
        if rank in dims and itile.ndim == rank:
            itile, partial = itile[..., None], True
    full = groups[:, itile.ravel()].reshape(tuple(gsizes) + itile.shape)
    ng = len(dims)
    order, shape = [], []
    for k in range(itile.ndim):
        if k in dims:
            order += [dims.index(k), ng + k]
            shape.append(gsizes[dims.index(k)] * itile.shape[k])
        else:
            order.append(ng + k)
            shape.append(itile.shape[k])
    return _Sh(full.transpose(order).reshape(shape), partial)


def _from_partial_slice(s, t, base, rp):
    """ReshardFromPartialReplicateWithDynamicSlice: a local slice, then a permute if needed."""
    temp = _compatible(s, t, len(base))
    if temp is None:
        return None
    return _cp(temp, t, base, rp) if _can_cp(temp, t) else temp


def _partial_a2a(s, t, base, rp):
    """ReshardPartialReplicateWithAllToAll."""
    from_partial = s.partial
    p, tl = (s, t) if from_partial else (t, s)
    if p.rep or not p.partial or tl.rep or tl.partial:
        return None
    reps = p.tile.shape[-1]
    if tl.tile.ndim + 1 != p.tile.ndim or p.tile.shape[0] != 1:
        return None
    dim = -1
    for i in range(tl.tile.ndim - 1, -1, -1):
        if tl.tile.shape[i] > 1 and dim == -1:
            if tl.tile.shape[i] != reps:
                return None
            dim = i
        if tl.tile.shape[i] != p.tile.shape[i + 1]:
            return None
    if dim == -1 or not (p.tile.reshape(tl.tile.shape) == tl.tile).all():
        return None
    shape = list(tl.tile.shape)
    shape[dim] = 1
    tmp = _Sh(tl.tile.reshape(shape + [reps]), True)
    rank = len(base)
    if from_partial:
        pairs = _a2a_dims(s, tmp, rank)
        if pairs is None:
            return None
        return _reshard(_a2a(s, tmp, pairs, base, rp), t, base, rp)
    mid = _reshard(s, tmp, base, rp)
    pairs = _a2a_dims(mid, t, rank)
    if pairs is None:
        return None
    return _a2a(mid, t, pairs, base, rp)


def _to_partial_gather(s, t, base, rp):
    """ReshardToPartialReplicateWithAllGather."""
    rank = len(base)
    temp = _compatible(t, s, rank)
    if temp is None:
        return None
    if _can_cp(s, temp):
        _cp(s, temp, base, rp)
    dims = [d for d in range(rank) if temp.tile.shape[d] // t.tile.shape[d] > 1]
    factors = [temp.tile.shape[d] // t.tile.shape[d] for d in dims]
    groups, inner, _ = _group(temp, dims, factors)
    saved = rp.trans
    rp.trans = [tr[groups[g]] for tr in saved for g in range(len(groups))]
    _gather_dims(inner, dims, _local(base, temp), rp)
    rp.trans = saved
    return t


def _split(sh, i, k):
    shape = list(sh.tile.shape)
    shape[i:i + 1] = [k, shape[i] // k]
    return _Sh(sh.tile.reshape(shape), sh.partial)


def _merge(sh, i):
    shape = list(sh.tile.shape)
    shape[i:i + 2] = [shape[i] * shape[i + 1]]
    return _Sh(sh.tile.reshape(shape), sh.partial)


def _transpose(sh, perm):
    """TransposeSharding; ``perm`` over the data dimensions or over all tile dimensions."""
    perm = list(perm) + list(range(len(perm), sh.tile.ndim))
    return _Sh(sh.tile.transpose(perm), sh.partial)


def _replicate_dims(sh, dims, rank):
    """PartiallyReplicateTiledShardingOnDims."""
    dims = [d for d in dims if d < rank]
    count = math.prod(sh.tile.shape[d] for d in dims)
    if count == 1:
        return sh
    if count == _num_tiles(sh, rank):
        return _Sh(None)
    perm = sorted(range(rank), key=lambda d: d in dims)
    tile = _transpose(sh, perm).tile
    shape = list(sh.tile.shape)
    for d in dims:
        shape[d] = 1
    if sh.partial:
        shape[-1] *= count
    else:
        shape.append(count)
    return _Sh(tile.reshape(shape), True)


def _split_match(base, s, t):
    """PatternMatchMergeOrSplitSharding: ``(before, after, i)``, both shardings with dimension
    ``i``'s tiles split in two. The dimensions whose tile counts differ are those where one side
    has 1 and those where both have more, one a multiple of the other (and of the dimension,
    rounded up); the first of the latter that, with one of the former, keeps the pair's tile
    count (``[X, Y] <-> [X*Y, 1]``) splits at the smaller count; failing that, the first whose
    count shrinks splits at ``dst``'s (``[X*Y] -> [X]``, ``Y`` anywhere else in ``dst``)."""
    rank = len(base)
    if s.rep or t.rep or s.partial != t.partial:
        return None
    if s.partial and s.tile.shape[-1] != t.tile.shape[-1]:
        return None
    a, b = s.tile.shape, t.tile.shape
    one, both = [], []
    for d in range(rank):
        if a[d] == b[d]:
            continue
        lo, hi = min(a[d], b[d]), max(a[d], b[d])
        if lo == 1:
            one.append(d)
        elif hi % lo == 0 and -(-base[d] // lo) * lo % hi == 0:
            both.append(d)
    for i in both:
        for j in one:
            if a[i] * a[j] == b[i] * b[j]:
                size = min(a[i], b[i])
                return _split(s, i, size), _split(t, i, size), i
    for i in both:
        if a[i] > b[i]:
            return _split(s, i, b[i]), _split(t, i, b[i]), i
    return None


def _try(rp, fn):
    """Runs ``fn``; on failure drops what it emitted (dead code the partitioner's DCE removes)."""
    mark = len(rp.ops)
    out = fn()
    if out is None:
        del rp.ops[mark:]
    return out


def _complex(s, t, base, rp):
    """TryComplexReshardHandling."""
    rank = len(base)
    m = _split_match(base, s, t)
    if m is not None:
        before, after, i = m
        local = _local(base, s)
        nb = list(base)
        nb[i:i + 1] = [base[i] // (local[i] * before.tile.shape[i + 1]),
                       local[i] * before.tile.shape[i + 1]]
        nb = tuple(nb)

        def run():
            got = _reshard(before, after, nb, rp, full=False)
            if not got == after:
                return None
            merged = _merge(got, i)
            if not merged == t:
                merged = _reshard(merged, t, base, rp, full=False)
                if not merged == t:
                    return None
            return merged
        return _try(rp, run)
    if t.partial:
        srep = s.tile.shape[-1] if s.partial else 1
        for i in range(rank):
            if s.tile.shape[i] == 1 or s.tile.shape[i] * srep != t.tile.shape[-1]:
                continue
            mid = _replicate_dims(s, [i], rank)

            def run(mid=mid):
                got = _reshard(_reshard(s, mid, base, rp), t, base, rp, full=False)
                return got if got == t else None
            return _try(rp, run)
    if s.partial and not t.partial:
        reps = s.tile.shape[-1]
        for i in range(t.tile.ndim):
            if t.tile.shape[i] != s.tile.shape[i] and s.tile.shape[i] == 1 \
                    and t.tile.shape[i] % reps == 0:
                perm = list(range(s.tile.ndim))
                perm[i], perm[-1] = perm[-1], perm[i]
                mid = _Sh(s.tile.transpose(perm), True)

                def run(mid=mid):
                    got = _reshard(_reshard(s, mid, base, rp), t, base, rp, full=False)
                    return got if got == t else None
                return _try(rp, run)
    return None


def _reshard(s, t, base, rp, full=True):
    """PartitionedHlo::ReshardNoCache: returns the sharding reached (``t`` unless ``full`` is off
    and only a full rematerialization would do)."""
    rank = len(base)
    if s == t:
        return t
    if _can_cp(s, t):
        return _cp(s, t, base, rp)
    pairs = _a2a_dims(s, t, rank)
    if pairs is not None:
        return _a2a(s, t, pairs, base, rp)
    if not t.rep and s.partial:
        for fn in (_from_partial_slice, _partial_a2a):
            got = _try(rp, lambda fn=fn: fn(s, t, base, rp))
            if got is not None:
                return got
    if not s.rep and t.partial:
        for fn in (_to_partial_gather, _partial_a2a):
            got = _try(rp, lambda fn=fn: fn(s, t, base, rp))
            if got is not None:
                return got
    if not s.rep:
        if not t.rep:
            got = _complex(s, t, base, rp)
            if got is not None:
                return got
            same = [d for d in range(rank) if s.tile.shape[d] != 1
                    and t.tile.shape[d] == s.tile.shape[d]]
            if same:
                groups, inner_s, gsizes = _group(s, same)
                tgroups, inner_t, _ = _group(t, same)
                inner_t = _align(tgroups, inner_t, groups)
                local = _local(base, s)
                ib = tuple(local[d] if d in same else base[d] for d in range(rank))
                saved = rp.trans
                rp.trans = [tr[groups[g]] for tr in saved for g in range(len(groups))]
                _reshard(inner_s, inner_t, ib, rp)
                rp.trans = saved
                return _reshard(_ungroup(groups, gsizes, same, inner_t, rank), t, base, rp)
        if not full:
            return s
        _replicate(s, base, rp)
    return t


def _hlo_sharding(spec: Spec, sizes: Mapping[str, int]) -> _Sh:
    """A ``NamedSharding``'s tile assignment: the mesh's devices (row-major ids) transposed to
    the axes of each dimension, major to minor, then the unused axes (the replicas)."""
    tile, partial = _tile_assignment(tuple(spec), tuple(sizes.items()))
    return _Sh(tile, partial)


@lru_cache(maxsize=4096)
def _tile_assignment(spec: Spec, sizes: tuple[tuple[str, int], ...]):
    """``(device array or None, partial)`` of :func:`_hlo_sharding` (read-only: shared)."""
    names = [a for a, _ in sizes]
    size = dict(sizes)
    used = [a for axes in spec for a in axes]
    if not used:
        return None, False
    rest = [a for a in names if a not in used]
    mesh = np.arange(math.prod(size[a] for a in names)).reshape([size[a] for a in names])
    tile = mesh.transpose([names.index(a) for a in (*used, *rest)])
    shape = [math.prod(size[a] for a in axes) for axes in spec]
    if rest:
        shape.append(math.prod(size[a] for a in rest))
    tile = tile.reshape(shape).copy()
    tile.flags.writeable = False
    return tile, bool(rest)


@lru_cache(maxsize=64)
def _mesh_coords(shape: tuple[int, ...]) -> np.ndarray:
    """``[device, axis]``: each device's coordinates on a mesh of ``shape`` (row-major ids)."""
    out = np.stack(np.unravel_index(np.arange(math.prod(shape)), shape), axis=1)
    out.flags.writeable = False
    return out


def _varying(sets, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of some set (replica group, or permute pair)
    differ; ``sets``: arrays ``[set, member]`` of device ids."""
    names = list(sizes)
    coords = _mesh_coords(tuple(sizes[a] for a in names))
    moved = np.zeros(len(names), dtype=bool)
    for group in sets:
        if group.shape[1] >= 2:
            c = coords[group]  # [set, member, axis]
            moved |= (c != c[:, :1]).any(axis=(0, 1))
    return tuple(a for a, v in zip(names, moved) if v)


def reshard_comms(shape, dtype: str, src: Spec, dst: Spec, sizes: Mapping[str, int]) -> tuple[Comm, ...]:
    """Collectives that turn layout ``src`` into ``dst``, as XLA's SPMD partitioner reshards.

    Both layouts become the ``HloSharding`` a ``NamedSharding`` lowers to (the mesh's devices
    transposed to each dimension's axes, major to minor, the unused axes as the last, replicated
    tile dimension), and ``PartitionedHlo::ReshardNoCache`` is replayed on those device arrays; each
    collective it emits becomes a :class:`Comm` over the mesh axes its groups (or pairs) span, with
    the bytes XLA's HLO shows (the local block; an all-gather's result). The cases, in the order
    the partitioner tries them:

    * Same tile counts, other devices (``CanReshardWithCollectivePermute``): one
      collective-permute of the block.
    * Tile counts that swap between dimensions (``GetReshardAllToAllSourceTargetDims``,
      ``ReshardWithAllToAll``, ``TryMultipleSourceTargetDims``): one all-to-all per pair of
      dimensions (one for all of them when they are disjoint), then a permute if the devices end
      up elsewhere.
    * From a partially replicated layout: a local slice where ``dst`` subdivides it
      (``ReshardFromPartialReplicateWithDynamicSlice``, then a permute if needed), or
      ``ReshardPartialReplicateWithAllToAll``.
    * To a partially replicated layout: all-gathers over the axes that leave, one per dimension
      (``ReshardToPartialReplicateWithAllGather``), or ``ReshardPartialReplicateWithAllToAll``.
    * ``TryComplexReshardHandling``: split a dimension's tiles in two and reshard that
      (``PatternMatchMergeOrSplitSharding``: e.g. an axis joining another dimension: a local slice,
      an all-to-all of the ``dst``-sized block, a permute; or a dimension's tiles shrinking to
      ``dst``'s count, its major axes then kept as groups within which the rest reshards, a full
      rematerialization within a group allowed); replicate one dimension first
      (``PatternMatchPartiallyReplicateDim``); or turn the replicas into a dimension first. Each is
      kept only if it reaches ``dst`` without a full replication.
    * Dimensions with equal tile counts on both sides: reshard within each group of devices
      sharing those tiles (``GroupShardingOnDims``, ``AlignGroupsWith``), then a permute to
      ``dst``'s devices.
    * Otherwise the "involuntary full rematerialization": ``Replicate`` (one all-gather per
      sharded dimension, the last dimension first, each of its result), then a local slice.

    Checked against XLA:CPU's compiled reshards (``tests/cost/test_reshard.py``). Not modelled:
    uneven shapes' halo exchanges and padding, and XLA's later passes (CSE, combiners).

    Raises :class:`~hulkjax.errors.UncompilableLayoutChangeError` where the partitioner fails:
    two pairs of dimensions swapped in one all-to-all whose second tile count no longer divides
    (jaxlib 0.10 dies of SIGFPE compiling it; e.g. ``(y, z, -, -) -> (-, x, z, y)`` on a 2x2x4
    mesh).

    >>> reshard_comms((8, 8), "float32", (("a", "b"), ()), (("b", "a"), ()), {"a": 2, "b": 2})
    (Comm(kind='collective-permute', axes=('a', 'b'), bytes=64, deferred=False),)
    """
    if src == dst:
        return ()
    for spec in (src, dst):
        if len(spec) != len(shape):
            raise InvalidPlanError(f"layout {spec} has {len(spec)} dimensions; the value's shape "
                                   f"{tuple(shape)} has {len(shape)}. Give one entry per dimension.")
        for axes in spec:
            for a in axes:
                if a not in sizes:
                    raise InvalidPlanError(f"layout {spec} names mesh axis {a!r}, not one of "
                                           f"{list(sizes)}. Use the mesh's axis names.")
    if 0 in tuple(shape):
        # An empty array (a zero-length piece of a split, its gradient) has nothing to move:
        # XLA compiles no collective for it (checked on XLA:CPU: a (8, 0, 64) array's
        # (-, x*y, -) -> (-, y, x) change compiles to none). The replay would divide by its
        # empty tiles.
        return ()
    try:
        return _scaled_replay(tuple(int(n) for n in shape), dtype_size(dtype),
                              tuple(tuple(axes) for axes in src),
                              tuple(tuple(axes) for axes in dst), tuple(sizes.items()))
    except UncompilableLayoutChangeError as e:
        raise UncompilableLayoutChangeError(
            f"the layout change {src} -> {dst} of a {tuple(shape)} array on mesh {dict(sizes)}: "
            f"{e}. Make it in two steps (CostModel.reshard_via finds them; the emitter "
            f"constrains each) or choose other layouts.") from None


def _scaled_replay(base, item, src, dst, sizes) -> tuple[Comm, ...]:
    """:func:`_replayed` of ``base``, replayed on a smaller array of the same kind: each
    dimension that the mesh's device count ``P`` divides taken as ``P`` long, one byte an
    element, and the bytes scaled back.

    Every tile count of a layout on the mesh (a product of axis sizes) divides ``P``, so on
    such a dimension each block the partitioner cuts is the dimension over a divisor of ``P``:
    an exact division, the same tests of divisibility and of a dimension staying whole, a block
    ``d / P`` times as long. The collectives are then the same, each moving ``d / P`` times
    the bytes (and ``item`` times: bytes count elements times their size). Dimensions ``P``
    does not divide are replayed as they are (a padded block's size is not proportional).
    Batches, sequences and widths divisible by the device count take one replay whatever their
    size: the microbatches of the staged search and repeated shapes of other widths share it
    (``tests/cost/test_reshard.py`` checks the two replays agree on every change of several
    meshes)."""
    P = math.prod(n for _, n in sizes)
    small = tuple(P if d % P == 0 else d for d in base)
    scale = math.prod(d // s for d, s in zip(base, small)) * item
    if scale == 1:
        return _replayed(base, 1, src, dst, sizes)
    return tuple(Comm(c.kind, c.axes, c.bytes * scale)
                 for c in _replayed(small, 1, src, dst, sizes))


@lru_cache(maxsize=1 << 16)
def _replayed(base, item, src, dst, sizes) -> tuple[Comm, ...]:
    """:func:`reshard_comms`'s replay, shared by every cost model (the staged search's and the
    loop bodies' price the same changes again)."""
    sizes = dict(sizes)
    rp = _Replay(math.prod(sizes.values()), item)
    _reshard(_hlo_sharding(src, sizes), _hlo_sharding(dst, sizes), base, rp)
    out = []
    for kind, sets, nbytes in rp.ops:
        axes = _varying(sets, sizes)
        if axes:
            out.append(Comm(kind, axes, nbytes))
    return tuple(out)


def reshard_intermediates(src: Spec, dst: Spec) -> tuple[Spec, ...]:
    """Layouts a change from ``src`` to ``dst`` may pass through, each splitting it into two
    changes the partitioner makes directly (the caller prices ``src -> mid -> dst`` with
    :func:`reshard_comms` and keeps the cheapest, with the direct change):

    * the moves first: every axis that ``dst`` puts on another dimension moved there (after
      ``dst``'s axes of that dimension that stay), axes that ``dst`` drops left where they are,
      as the minor or the major axes of their dimension (then gathered);
    * where several axes move: one of them first;
    * the gathers first: the axes ``dst`` drops gathered, the others left;
    * the slices first: ``dst``'s new axes taken (a local slice) where their dimension in
      ``src`` is a prefix of ``dst``'s, so that what moves next is the smaller block.

    A ``src`` that XLA can only bring to ``dst`` by rematerializing the whole value (one axis
    leaving a dimension while another moves from it to another one) reaches it through the
    first: an all-to-all of the moved axis, then an all-gather of the dropped one.

    >>> reshard_intermediates((("a", "b"), (), ()), ((), (), ("b",)))
    ((('a',), (), ('b',)), (('b',), (), ()))
    """
    rank = len(src)
    src_dim = {a: d for d in range(rank) for a in src[d]}
    dst_dim = {a: d for d in range(rank) for a in dst[d]}
    dropped = [a for a in src_dim if a not in dst_dim]
    moved = [a for a in src_dim if a in dst_dim and dst_dim[a] != src_dim[a]]
    out: list[Spec] = []
    if moved:
        for minor in (True, False):
            mid = []
            for d in range(rank):
                here = [a for a in dst[d] if a in src_dim and (src_dim[a] == d or a in moved)]
                left = [a for a in src[d] if a in dropped]
                mid.append(tuple(here + left if minor else left + here))
            out.append(tuple(mid))
    if len(moved) > 1:  # one axis at a time
        for a in moved:
            mid = [tuple(x for x in axes if x != a) for axes in src]
            d = dst_dim[a]
            mid[d] = tuple(x for x in dst[d] if x == a or x in mid[d]) + tuple(
                x for x in mid[d] if x not in dst[d])
            out.append(tuple(mid))
    if dropped and (moved or any(a not in src_dim for a in dst_dim)):
        out.append(tuple(tuple(a for a in axes if a not in dropped) for axes in src))
    new = [a for a in dst_dim if a not in src_dim]
    if new:
        mid = []
        for d in range(rank):
            if dst[d][:len(src[d])] == src[d]:
                mid.append(tuple(src[d]) + tuple(a for a in dst[d][len(src[d]):] if a in new))
            else:
                mid.append(tuple(src[d]))
        out.append(tuple(mid))
    return tuple(dict.fromkeys(m for m in out if m != src and m != dst))
