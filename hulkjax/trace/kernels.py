"""Pallas kernels (``pallas_call``) as operators: what they compute, read, and can be split along.

A ``pallas_call`` runs a kernel body once per point of its *grid*; each operand and result is
cut into blocks, and a block's *index map* says which block a grid point reads or writes. The
tracer keeps a kernel as one node (its body is not inlined: it runs on chip, so its internal
values never reach HBM) and describes it with a :class:`Kernel`, read from the equation alone:

* **FLOPs**: the body's, summed over the grid. Loops inside the body count their trips *at
  each grid point*: a ``fori_loop`` whose bounds the body computes from ``program_id`` (a causal
  attention kernel visits only the key blocks up to its query block) is evaluated over the whole
  grid, so a causal kernel costs about half a full one, as it runs.
* **HBM bytes**: per operand and result, the fewer of what the block schedule moves and what the
  body loads or stores through that reference (loads inside loops times their trips). A TPU
  kernel (Mosaic compiler parameters) runs the grid in row-major order and its pipeline copies a
  block only when its index changes (queries once per query block while the key blocks
  stream); a GPU kernel's programs each load what they index.
* **Branches** (``pl.when``) whose condition the body computes from its grid position take, at
  each grid point, the branch taken there (a causal TPU kernel skips the blocks above the
  diagonal).
* **Split dimensions**: a grid axis along which the kernel may run as independent pieces, one per
  device (what ``jax.shard_map`` around the kernel does, as MaxText runs its attention kernels):
  every result's block index follows that grid axis one for one (each result block is written by
  one grid point along it: nothing accumulates across it), operands use the axis only that way
  (or not at all: then every piece reads them whole), the array's dimension is exactly
  ``grid[axis]`` blocks, and the body never asks for its ``program_id`` or ``num_programs``
  along it (a causal mask's query-block index does; a batch or head index does not).

Limits: a grid size known only at run time counts as 1 and splits nothing; a kernel over a
device mesh of its own (``mesh=``: TPU cores, Mosaic GPU) is never split; loop bounds the body
reads from memory (not computed from its grid position) count one trip.

>>> import jax, jax.numpy as jnp
>>> from jax.experimental import pallas as pl
>>> def add(x_ref, y_ref, o_ref):
...     o_ref[...] = x_ref[...] + y_ref[...]
>>> x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
>>> f = pl.pallas_call(add, out_shape=x, grid=(8,), interpret=True,
...                    in_specs=[pl.BlockSpec((1, 128), lambda i: (i, 0))] * 2,
...                    out_specs=pl.BlockSpec((1, 128), lambda i: (i, 0)))
>>> eqn = jax.make_jaxpr(f)(x, x).eqns[0]
>>> k = describe(eqn.params, [v.aval.shape for v in eqn.invars])
>>> k.grid, k.operand_axes, k.result_axes, sorted(k.parallel), k.flops, k.bytes
((8,), ((0, None), (0, None)), ((0, None),), [0], 1024.0, 12288.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from jax.extend import core as jex_core
from jax.extend.core import primitives as P

from hulkjax.trace.flops import flops_of

LOADS = frozenset({"get", "masked_load", "load"})
"""Reads through a kernel's reference (the first operand is the reference)."""
STORES = frozenset({"swap", "masked_swap", "addupdate", "atomic_rmw"})
"""Writes through a kernel's reference (the first operand is the reference, the second the
value)."""
GRID_QUERIES = frozenset({"program_id", "num_programs"})
"""Where a kernel body asks where on the grid it is (``axis`` parameter)."""


@dataclass(frozen=True)
class Kernel:
    """What hulkjax knows of one ``pallas_call``.

    Attributes:
      name: the kernel's name (its Python function's).  # str
      grid: the grid (static sizes).  # tuple of int
      operand_axes: per operand of the equation, per dimension, the grid axis whose index is that
        dimension's block index one for one (``None``: any other index map).  # tuple of tuple
      result_axes: the same per result.  # tuple of tuple
      parallel: grid axes the kernel may be split along (see the module docstring).  # frozenset
      flops: floating-point operations of the whole kernel (every grid point).  # float
      bytes: HBM bytes it reads and writes.  # float
    """

    name: str
    grid: tuple[int, ...]
    operand_axes: tuple[tuple[int | None, ...], ...]
    result_axes: tuple[tuple[int | None, ...], ...]
    parallel: frozenset[int]
    flops: float
    bytes: float

    def split_dims(self, axis: int) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
        """Per operand and per result, the dimension that grid axis ``axis`` splits (or None)."""
        def dim(axes):
            return next((d for d, g in enumerate(axes) if g == axis), None)
        return (tuple(dim(a) for a in self.operand_axes),
                tuple(dim(a) for a in self.result_axes))


def _block_sizes(bm) -> tuple[int | None, ...]:
    """Per dimension of a block mapping, the block's extent (1 for a squeezed dimension; ``None``
    for block kinds that are not plain tiles: elements, bounded slices)."""
    out = []
    for b in bm.block_shape:
        name = type(b).__name__
        if name == "Squeezed" or b is None:
            out.append(1)
        elif name == "Blocked":
            out.append(int(b.block_size))
        elif isinstance(b, int):
            out.append(int(b))
        else:
            out.append(None)
    return tuple(out)


def _index_axes(bm, n_grid: int) -> tuple[tuple[int | None, ...], frozenset[int]]:
    """Per dimension, the grid axis the index map returns as is; and the grid axes the map uses
    any other way (computed indices)."""
    jaxpr = bm.index_map_jaxpr.jaxpr
    grid_of = {v: g for g, v in enumerate(jaxpr.invars[:n_grid])}
    deps: dict = {v: frozenset({g}) for v, g in grid_of.items()}
    for e in jaxpr.eqns:
        d = frozenset().union(*(deps.get(v, frozenset()) for v in e.invars
                                if not isinstance(v, jex_core.Literal)))
        for o in e.outvars:
            deps[o] = d
    axes, other = [], set()
    for o in jaxpr.outvars:
        if isinstance(o, jex_core.Literal):
            axes.append(None)
        elif o in grid_of:
            axes.append(grid_of[o])
        else:
            axes.append(None)
            other |= deps.get(o, frozenset())
    return tuple(axes), frozenset(other)


def describe(params: dict, operand_shapes) -> Kernel:
    """The :class:`Kernel` of a ``pallas_call`` equation, from its parameters and its operands'
    shapes."""
    gm = params["grid_mapping"]
    static = all(isinstance(g, (int, np.integer)) for g in gm.grid)
    grid = tuple(int(g) if isinstance(g, (int, np.integer)) else 1 for g in gm.grid)
    n = len(grid)
    maps = [_index_axes(bm, n) for bm in gm.block_mappings]
    blocks = [_block_sizes(bm) for bm in gm.block_mappings]
    shapes = [tuple(bm.array_aval.shape) for bm in gm.block_mappings]
    n_in, n_out = gm.num_inputs, gm.num_outputs
    lead = len(operand_shapes) - n_in  # dynamic grid sizes and scalar-prefetch operands first
    operand_axes = tuple((None,) * len(operand_shapes[k]) for k in range(lead))
    operand_axes += tuple(m[0] for m in maps[:n_in])
    result_axes = tuple(m[0] for m in maps[n_in:n_in + n_out])
    body = params["jaxpr"]
    queried = _grid_queries(body)
    parallel = set()
    for g in range(n if static and params.get("mesh") is None else 0):
        if g in queried:
            continue
        ok = True
        for k, ((axes, other), bs, shape) in enumerate(zip(maps, blocks, shapes)):
            hits = [d for d, a in enumerate(axes) if a == g]
            if g in other or len(hits) > 1 or (k >= n_in and not hits):
                ok = False
                break
            if hits and (bs[hits[0]] is None or bs[hits[0]] * grid[g] != shape[hits[0]]):
                ok = False
                break
        if ok:
            parallel.add(g)
    flops, loads = _body_cost(body, grid)
    traffic = 0.0
    points = float(math.prod(grid))
    pipelined = _pipelined(params.get("compiler_params"))
    for k, ((axes, other), bm, bs) in enumerate(zip(maps, gm.block_mappings, blocks)):
        item = np.dtype(bm.array_aval.dtype).itemsize
        whole = float(math.prod(bm.array_aval.shape)) * item
        # A pipelined kernel runs the grid in row-major order and moves a block again only when
        # its index changes: as often as the grid axes up to the innermost one it uses advance.
        used = {a for a in axes if a is not None} | set(other)
        moves = (float(math.prod(grid[:max(used) + 1])) if used else 1.0) if pipelined else points
        scheduled = (moves * float(math.prod(bs)) * item if all(b is not None for b in bs)
                     else whole)
        ref = gm.num_index_operands + k  # the body's reference for this block
        traffic += min(scheduled, loads.get(ref, scheduled))
    name = getattr(params.get("name"), "name", None) or params.get("name") or "kernel"
    return Kernel(str(name), grid, operand_axes, result_axes, frozenset(parallel), flops, traffic)


def _pipelined(compiler_params) -> bool:
    """Whether the kernel compiles for TPU (Mosaic), whose pipeline copies a block into VMEM only
    when its index changes; a GPU kernel's programs each load what they index."""
    try:
        from jax.experimental.pallas import tpu as pltpu
    except ImportError:  # pragma: no cover - Pallas ships with JAX
        return False
    params = compiler_params.values() if isinstance(compiler_params, dict) else [compiler_params]
    return any(isinstance(p, pltpu.CompilerParams) for p in params)


def _grid_queries(jaxpr) -> frozenset[int]:
    """Grid axes a kernel body asks its position or extent along (recursively)."""
    found = set()
    for e in jaxpr.eqns:
        if e.primitive.name in GRID_QUERIES:
            found.add(int(e.params["axis"]))
        for sub in jex_core.jaxprs_in_params(e.params):
            found |= _grid_queries(sub)
    return frozenset(found)


# ---- the body's cost over the grid --------------------------------------------------------------
# Integer scalars the body computes from its grid position are evaluated over the whole grid at
# once (numpy arrays broadcast against the grid), so loop bounds that depend on program_id give a
# trip count per grid point.

_INT_OPS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
    "min": np.minimum, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal, "and": np.bitwise_and,
    "or": np.bitwise_or,
}


def _int_div(a, b):
    """``lax.div`` on integers: rounds towards zero."""
    q = np.abs(a) // np.maximum(np.abs(b), 1)
    return np.where((a < 0) != (b < 0), -q, q)


def _value(env, atom):
    if isinstance(atom, jex_core.Literal):
        v = np.asarray(atom.val)
        return v if v.ndim == 0 else None
    return env.get(atom)


def _evaluate(e, env, grid) -> None:
    """Record the values of an integer scalar equation when its operands are known."""
    name = e.primitive.name
    if name == "program_id":
        ax = int(e.params["axis"])
        shape = [1] * len(grid)
        shape[ax] = grid[ax]
        env[e.outvars[0]] = np.arange(grid[ax]).reshape(shape)
        return
    if name == "num_programs":
        env[e.outvars[0]] = np.asarray(grid[int(e.params["axis"])])
        return
    if len(e.outvars) != 1 or getattr(e.outvars[0].aval, "shape", None) != ():
        return
    args = [_value(env, a) for a in e.invars]
    if any(a is None for a in args):
        return
    if name in _INT_OPS and len(args) == 2:
        env[e.outvars[0]] = _INT_OPS[name](*args)
    elif name == "div" and len(args) == 2:
        env[e.outvars[0]] = _int_div(*args)
    elif name == "rem" and len(args) == 2:
        env[e.outvars[0]] = args[0] - _int_div(*args) * args[1]
    elif name in ("neg",):
        env[e.outvars[0]] = -args[0]
    elif name in ("convert_element_type", "copy"):
        env[e.outvars[0]] = args[0]
    elif name == "select_n" and len(args) >= 2:
        env[e.outvars[0]] = np.choose(np.asarray(args[0]).astype(int), args[1:])


def _fori_trips(e, env):
    """Per grid point, the trips of a ``while`` that is a ``fori_loop`` (the condition compares
    the first two carries with ``lt`` and the body adds one to the first); ``None`` otherwise or
    when its bounds are not known."""
    cn, bn = e.params["cond_nconsts"], e.params["body_nconsts"]
    cond = e.params["cond_jaxpr"].jaxpr
    body = e.params["body_jaxpr"].jaxpr
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name != "lt":
        return None
    if list(cond.eqns[0].invars) != list(cond.invars[cn:cn + 2]):
        return None
    i_in, i_out = body.invars[bn], body.outvars[0]
    step = next((q for q in body.eqns if i_out in q.outvars), None)
    if step is None or step.primitive.name != "add" or i_in not in step.invars:
        return None
    other = [a for a in step.invars if a is not i_in]
    if len(other) != 1 or not isinstance(other[0], jex_core.Literal) or int(other[0].val) != 1:
        return None
    if body.outvars[1] is not body.invars[bn + 1]:
        return None
    lo = _value(env, e.invars[cn + bn])
    hi = _value(env, e.invars[cn + bn + 1])
    if lo is None or hi is None:
        return None
    return np.maximum(np.asarray(hi) - np.asarray(lo), 0)


def _body_cost(jaxpr, grid) -> tuple[float, dict[int, float]]:
    """FLOPs of a kernel body summed over the grid, and bytes moved through each of its
    references (by position among the body's inputs)."""
    refs = {v: k for k, v in enumerate(jaxpr.invars)}
    loads: dict[int, np.ndarray] = {}
    flops = _walk(jaxpr, {}, refs, np.ones((1,) * len(grid)), grid, loads)
    total = {k: float(np.broadcast_to(v, grid).sum()) for k, v in loads.items()}
    return float(np.broadcast_to(flops, grid).sum()), total


def _walk(jaxpr, env, refs, mult, grid, loads):
    flops = np.zeros((1,) * len(grid))
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in LOADS or name in STORES:
            ref = refs.get(e.invars[0])
            if ref is not None:
                moved = e.outvars[0].aval if name in LOADS else e.invars[1].aval
                nbytes = float(math.prod(moved.shape)) * np.dtype(moved.dtype).itemsize
                loads[ref] = loads.get(ref, 0.0) + mult * nbytes
            continue
        if e.primitive is P.while_p:
            trips = _fori_trips(e, env)
            trips = np.ones(()) if trips is None else trips
            cn, bn = e.params["cond_nconsts"], e.params["body_nconsts"]
            body = e.params["body_jaxpr"].jaxpr
            inner_env = {v: _value(env, a) for v, a in zip(body.invars[:bn], e.invars[cn:cn + bn])}
            inner_env = {v: x for v, x in inner_env.items() if x is not None}
            inner_refs = {v: refs[a] for v, a in zip(body.invars, e.invars[cn:])
                          if not isinstance(a, jex_core.Literal) and a in refs}
            flops = flops + _walk(body, inner_env, inner_refs, mult * trips, grid, loads)
            continue
        if e.primitive is P.scan_p:
            body = e.params["jaxpr"].jaxpr
            inner_refs = {v: refs[a] for v, a in zip(body.invars, e.invars)
                          if not isinstance(a, jex_core.Literal) and a in refs}
            flops = flops + _walk(body, {}, inner_refs, mult * int(e.params["length"]), grid,
                                  loads)
            continue
        if e.primitive is P.cond_p:
            # The branch each grid point takes when the index is known there (a causal kernel's
            # ``pl.when`` on blocks at or below the diagonal), else the costliest.
            branches = e.params["branches"]
            index = _value(env, e.invars[0])
            costs = []
            for b, br in enumerate(branches):
                inner_refs = {v: refs[a] for v, a in zip(br.jaxpr.invars, e.invars[1:])
                              if not isinstance(a, jex_core.Literal) and a in refs}
                taken = (mult if index is None else
                         mult * (np.clip(np.asarray(index), 0, len(branches) - 1) == b))
                costs.append(_walk(br.jaxpr, {}, inner_refs, taken, grid, loads))
            costs = np.broadcast_arrays(*costs)
            flops = flops + (np.max(costs, axis=0) if index is None else np.sum(costs, axis=0))
            continue
        subs = list(jex_core.jaxprs_in_params(e.params))
        if len(subs) == 1:  # a call (jit, run_scoped, custom_jvp): its body, inline
            sub = subs[0]
            inner = {v: x for v, a in zip(sub.invars, e.invars)
                     if (x := _value(env, a)) is not None}
            inner_refs = {v: refs[a] for v, a in zip(sub.invars, e.invars)
                          if not isinstance(a, jex_core.Literal) and a in refs}
            flops = flops + _walk(sub, inner, inner_refs, mult, grid, loads)
            for o, so in zip(e.outvars, sub.outvars):
                if (x := _value(inner, so)) is not None:
                    env[o] = x
            continue
        _evaluate(e, env, grid)
        ins = [tuple(getattr(a.aval, "shape", ())) for a in e.invars]
        outs = [tuple(getattr(o.aval, "shape", ())) for o in e.outvars]
        f = flops_of(e.primitive, ins, outs, e.params)
        if f:
            flops = flops + mult * f
    return flops


def localize(params: dict, splits: dict[int, int]) -> dict:
    """The parameters of the same kernel run on one piece: grid axis ``g`` cut into
    ``splits[g]`` pieces (each must be one of :attr:`Kernel.parallel`), the arrays' dimensions
    that follow it cut alike. What ``jax.shard_map`` around the kernel binds per device."""
    gm = params["grid_mapping"]
    n = len(gm.grid)
    grid = list(gm.grid)
    for g, s in splits.items():
        grid[g] = grid[g] // s
    mappings = []
    for bm in gm.block_mappings:
        axes, _ = _index_axes(bm, n)
        shape = list(bm.array_aval.shape)
        for d, g in enumerate(axes):
            if g in splits:
                shape[d] //= splits[g]
        mappings.append(bm.replace(array_aval=bm.array_aval.update(shape=tuple(shape))))
    new_gm = replace(gm, grid=tuple(grid), block_mappings=tuple(mappings))
    out_avals = tuple(m.array_aval for m in mappings[gm.num_inputs:])
    out = dict(params, grid_mapping=new_gm, out_avals=out_avals)
    ce = params.get("cost_estimate")
    if ce is not None:
        pieces = math.prod(splits.values())
        out["cost_estimate"] = replace(ce, flops=ce.flops // pieces,
                                       transcendentals=ce.transcendentals // pieces,
                                       bytes_accessed=ce.bytes_accessed // pieces)
    return out
