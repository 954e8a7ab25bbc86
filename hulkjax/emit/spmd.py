"""Emit a plan as one compiled SPMD program.

``jax.jit`` of the traced step, re-run by :func:`hulkjax.trace.interpret` so that planned operands and
intermediates get ``with_sharding_constraint`` (every result, and every operand the plan moves:
:meth:`hulkjax.cost.CostModel.pinned_layouts`; inside inlined nested jits too, and inside the
bodies of ``scan`` / ``while`` / ``cond``, re-made with the plan's :attr:`Plan.bodies`), with the
plan's in/out ``NamedSharding`` s and the state buffers donated. The program is lowered and compiled before
any argument is touched: if anything fails, the caller's arrays are untouched.

>>> import hulkjax as hj, jax.numpy as jnp
>>> topo = hj.Topology.grid((8,), ("d",))
>>> f = lambda w, x: (x @ w).sum()
>>> step = hj.emit(f, hj.plan(f, jnp.ones((4, 4)), jnp.ones((8, 4)), topology=topo, strategy="dp"))
>>> float(step(jnp.ones((4, 4)), jnp.ones((8, 4))))
128.0
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from hulkjax.emit.hlo import Collective, collectives_from_hlo
from hulkjax.errors import (
    DonatedArgumentError,
    InvalidPlanError,
    NotCompiledError,
    PlanMismatchError,
)
from hulkjax.plan.records import BodyPlan, Plan
from hulkjax.trace.graph import OpGraph, dtype_name
from hulkjax.trace.interpret import BodyHooks, interpret
from hulkjax.trace.kernels import describe as describe_kernel
from hulkjax.trace.kernels import localize as localize_kernel
from hulkjax.trace.primitives import KERNELS, TOP_K
from hulkjax.trace.tracer import leaf_aval, trace

log = logging.getLogger("hulkjax.emit")


def bind_graph(fn, plan, graph: OpGraph | None, args) -> OpGraph:
    """The graph a plan is emitted from: ``graph`` if it was traced from ``fn``, else ``fn`` traced
    on ``args``, which must have the plan's fingerprint (and is then bound to the plan:
    ``plan.graph`` and its trees). Shared by :class:`ShardedStep` and the staged step."""
    # The plan's graph is only ours if it was traced from this very function: emitting a plan
    # with another step must not silently run the step the plan was made for (the program is
    # re-run from the graph's jaxpr, not from ``fn``). Another function object (a re-built
    # closure, a functools.partial) is traced and accepted if its structure is the same.
    if graph is not None and getattr(graph, "fn", None) is not fn:
        graph = None
    if graph is None:
        g = trace(fn, *args)
        if plan.graph_fingerprint and g.fingerprint() != plan.graph_fingerprint:
            raise PlanMismatchError(
                f"the plan was made for another step (graph fingerprint "
                f"{plan.graph_fingerprint}, this step traces to {g.fingerprint()}). "
                f"Re-plan with hj.plan(fn, *args, topology=...).")
        graph = g
        plan.graph = g
        plan.in_tree, plan.out_tree = g.in_tree, g.out_tree
    return graph


def check_args(plan, args) -> list:
    """The leaves of ``args``, checked against the plan's tree, shapes and dtypes."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    if plan.in_tree is not None and tree != plan.in_tree:
        raise PlanMismatchError(f"arguments have structure {tree}, the plan expects "
                                f"{plan.in_tree}. Re-plan for these arguments.")
    if len(leaves) != len(plan.inputs):
        raise PlanMismatchError(f"got {len(leaves)} argument leaves, the plan has "
                                f"{len(plan.inputs)}. Re-plan for these arguments.")
    for leaf, t in zip(leaves, plan.inputs):
        # As JAX will compute with it: a float64 numpy array is float32 without x64 (the plan,
        # traced from it, says float32), a Python int is int32; PRNG key arrays are named by
        # str ("key<fry>").
        try:
            aval = leaf_aval(leaf)
        except OverflowError:  # an int too large for int32: name it, as plan() does
            aval = None
        shape = tuple(aval.shape) if aval is not None else ()
        dtype = dtype_name(aval.dtype) if aval is not None else type(leaf).__name__
        if shape != t.shape or dtype != t.dtype:
            raise PlanMismatchError(f"argument {t.path!r} is {dtype}{list(shape)}, the plan was "
                                    f"made for {t.dtype}{list(t.shape)}. Re-plan for new shapes "
                                    f"(hj.hulk_shard does this automatically).")
    return leaves


def node_hooks(mesh, operand_specs, result_specs, operand_paths=None):
    """``(on_operand, on_result, on_bind)`` for :func:`interpret`, placing the planned
    constraints on ``mesh`` (``None`` where there are none), and running per shard the operators
    XLA's partitioner would gather (:func:`local_binds`). An operand with a path
    (``operand_paths``: layouts before its own, ``Plan.operand_paths``) is constrained to each
    layout of the path in turn, then to its own: XLA's partitioner makes the layout change in
    those steps. Readers of one value with the same path share its steps (one constraint per
    layout, the first reader's): the partitioner makes a layout change once per source
    instruction and target (its reshard cache; XLA's CSE leaves collectives alone), so a path
    constrained per reader would repeat every step after the first, each from its own
    intermediate. Shared by the SPMD and the staged step."""
    op_specs = {k: NamedSharding(mesh, s) for k, s in operand_specs.items()}
    res_specs = {k: NamedSharding(mesh, s) for k, s in result_specs.items()}
    paths = {k: tuple(NamedSharding(mesh, s) for s in via)
             for k, via in (operand_paths or {}).items() if k in op_specs}
    result_nodes = {n for n, _ in res_specs}
    wsc = jax.lax.with_sharding_constraint

    # (id(operand), path prefix) -> (operand, its value at the prefix's last layout); the
    # operand is kept so that its id is not reused while the entry lives. A tracer is only ever
    # an operand in the trace that made it, so an entry is only found in that trace.
    steps_made: dict[tuple, tuple] = {}

    def on_operand(nid, k, x):
        s = op_specs.get((nid, k))
        if s is None:
            return x
        via = paths.get((nid, k), ())
        y = x
        for i in range(len(via)):
            key = (id(x), via[:i + 1])
            hit = steps_made.get(key)
            if hit is None or hit[0] is not x:
                hit = steps_made[key] = (x, wsc(y, via[i]))
            y = hit[1]
        return wsc(y, s)

    def on_result(nid, outs):
        if nid not in result_nodes:
            return outs
        return [x if (s := res_specs.get((nid, k))) is None else wsc(x, s)
                for k, x in enumerate(outs)]

    return ((on_operand if op_specs else None), (on_result if res_specs else None),
            local_binds(mesh, operand_specs, result_specs))


def local_binds(mesh, operand_specs, result_specs):
    """``on_bind`` for :func:`interpret`: operators XLA's SPMD partitioner would gather run per
    shard instead (``jax.shard_map`` over the planned layouts). ``None`` where the plan has none.

    * A top-k whose operand is planned split: the partitioner does not split top-k along the
      dimensions it leaves alone and all-gathers the operand (a Mixture-of-Experts router's
      logits, every step).
    * A Pallas kernel planned split along grid axes it may be split along
      (:attr:`hulkjax.trace.kernels.Kernel.parallel`): a kernel is a custom call, which the
      partitioner cannot split at all. Each device runs the kernel on its piece, with the grid
      and the arrays cut alike (:func:`hulkjax.trace.kernels.localize`), as MaxText wraps its
      attention kernels in ``shard_map``.
    """
    split = {nid for (nid, k), s in [*operand_specs.items(), *result_specs.items()]
             if any(e for e in s)}
    if not split:
        return None

    def on_bind(nid, prim, invals, params):
        if nid not in split:
            return None
        if prim in KERNELS:
            return _kernel_per_shard(mesh, nid, prim, invals, params, operand_specs,
                                     result_specs)
        if prim not in TOP_K or len(invals) != 1 or not any(
                e for e in operand_specs.get((nid, 0), ())):
            return None
        in_spec = operand_specs[(nid, 0)]
        out_specs = tuple(result_specs.get((nid, k), in_spec) for k in range(2))

        def per_shard(x):
            return tuple(prim.bind(x, **prim.get_bind_params(params)))

        return list(jax.shard_map(per_shard, mesh=mesh, in_specs=(in_spec,),
                                  out_specs=out_specs, check_vma=False)(*invals))

    return on_bind


def _kernel_per_shard(mesh, nid, prim, invals, params, operand_specs, result_specs):
    """Run a Pallas kernel once per device on its piece (see :func:`local_binds`); ``None``
    (bind it whole) when the plan splits it along no grid axis it may be split along."""
    kernel = describe_kernel(params, [tuple(x.shape) for x in invals])
    mesh_axes: dict[int, tuple] = {}  # grid axis -> the mesh axes it is split over
    specs = [(kernel.operand_axes[k], s) for (n, k), s in operand_specs.items() if n == nid]
    specs += [(kernel.result_axes[k], s) for (n, k), s in result_specs.items() if n == nid]
    for axes, spec in specs:
        for d, e in enumerate(spec):
            g = axes[d] if d < len(axes) else None
            if e and g in kernel.parallel:
                mesh_axes[g] = tuple(e) if isinstance(e, tuple) else (e,)
    if not mesh_axes:
        return None
    splits = {g: math.prod(mesh.shape[a] for a in ax) for g, ax in mesh_axes.items()}
    local = localize_kernel(params, splits)

    def spec(axes):
        return PartitionSpec(*(mesh_axes.get(g) if g is not None else None for g in axes))

    def per_shard(*xs):
        return tuple(prim.bind(*xs, **prim.get_bind_params(local)))

    return list(jax.shard_map(
        per_shard, mesh=mesh, in_specs=tuple(spec(a) for a in kernel.operand_axes),
        out_specs=tuple(spec(a) for a in kernel.result_axes), check_vma=False)(*invals))


def body_hooks(mesh, bodies: dict[int, tuple[BodyPlan, ...]]):
    """``on_body`` for :func:`interpret`: constraints inside loop bodies (``None`` if none)."""
    if not bodies:
        return None
    wsc = jax.lax.with_sharding_constraint

    def boundary(specs: dict):
        shardings = {j: NamedSharding(mesh, s) for j, s in specs.items()}
        if not shardings:
            return None
        return lambda xs: [x if (s := shardings.get(j)) is None else wsc(x, s)
                           for j, x in enumerate(xs)]

    def hooks(bp: BodyPlan) -> BodyHooks:
        on_operand, on_result, on_bind = node_hooks(mesh, bp.operand_specs, bp.result_specs,
                                                    bp.operand_paths)
        return BodyHooks(on_input=boundary(bp.inputs), on_output=boundary(bp.outputs),
                         on_operand=on_operand, on_result=on_result,
                         on_body=body_hooks(mesh, bp.bodies), on_bind=on_bind)

    table = {nid: tuple(hooks(bp) for bp in plans) for nid, plans in bodies.items()}
    return table.get


class ShardedStep:
    """A step compiled for a plan: call it like the original function.

    Attributes:
      fn: the user's step.
      plan: the :class:`Plan` it runs.
      mesh: the ``jax.sharding.Mesh`` (from ``plan.topology.mesh()``).
      compiled: the ``jax.stages.Compiled`` program (``None`` until the first call or
        :meth:`compile`).
      in_shardings / out_shardings: flat tuples of ``NamedSharding``.
    """

    def __init__(self, fn: Callable, plan: Plan, *, donate: bool = True, mesh=None):
        if not isinstance(plan, Plan):
            raise InvalidPlanError(
                f"emit needs a hulkjax.Plan, got {type(plan).__name__}. Make one with "
                f"hj.plan(fn, *args, topology=...) or read one with hj.Plan.load(path) / "
                f"hj.Plan.from_dict(d).")
        if plan.topology is None and mesh is None:
            raise InvalidPlanError("the plan has no topology to build a mesh from; pass mesh=.")
        # A plan is only meaningful on the topology it was made for: its topology must still be
        # the one it was fingerprinted on (a hand-edited plan file), and a mesh passed in must have
        # the plan's axes and sizes. Without these checks a plan for a (2, 4) mesh runs on a (4, 2)
        # mesh with the same axis names and silently lays data out differently than planned.
        if (plan.topology is not None and plan.topology_fingerprint
                and plan.topology.fingerprint() != plan.topology_fingerprint):
            raise PlanMismatchError(
                f"the plan's topology {plan.topology.name!r} has fingerprint "
                f"{plan.topology.fingerprint()}, but the plan was made for topology fingerprint "
                f"{plan.topology_fingerprint} (was the plan file edited?). Re-plan with "
                f"hj.plan(fn, *args, topology=...).")
        self.fn = fn
        self.plan = plan
        self.mesh = mesh if mesh is not None else plan.topology.mesh()
        mesh_axes = tuple(self.mesh.axis_names)
        mesh_shape = tuple(int(n) for n in self.mesh.devices.shape)
        if mesh_axes != tuple(plan.axis_names) or mesh_shape != tuple(plan.mesh_shape):
            raise PlanMismatchError(
                f"the plan was made for a mesh {dict(zip(plan.axis_names, plan.mesh_shape))}, but "
                f"the mesh is {dict(zip(mesh_axes, mesh_shape))}. Re-plan for this mesh's topology "
                f"(hj.plan(fn, *args, topology=hj.Topology.grid({mesh_shape}, {mesh_axes}))), or "
                f"pass a mesh of the plan's shape and axis names.")
        self.donate = donate
        self.compiled = None
        self._graph: OpGraph | None = plan.graph
        self.in_shardings = tuple(self._sharding(t) for t in plan.inputs)
        self.out_shardings = tuple(self._sharding(t) for t in plan.outputs)

    def __repr__(self) -> str:
        state = "compiled" if self.compiled is not None else "not compiled"
        return f"ShardedStep({getattr(self.fn, '__name__', 'step')}, strategy={self.plan.strategy!r}, {state})"

    # ---- building -------------------------------------------------------------------------
    def _sharding(self, t) -> NamedSharding:
        """An argument's or result's sharding: its planned layout, in its memory (a leaf the
        step keeps in host memory stays there)."""
        self._check_spec(t.spec, repr(t.path), t.shape, even=True)
        return NamedSharding(self.mesh, t.spec,
                             memory_kind=None if t.memory_kind == "device" else t.memory_kind)

    def _check_spec(self, spec, where: str, shape, *, even: bool) -> None:
        """Raise InvalidPlanError unless ``spec`` fits a value of ``shape`` on this mesh.

        Arguments and results must split evenly (``even``); intermediates may split unevenly
        (``with_sharding_constraint`` pads). Checked here so that a hand-edited or foreign plan
        fails with the value's name instead of a bare JAX error at compile time.
        """
        if not isinstance(spec, PartitionSpec):
            raise InvalidPlanError(f"the spec of {where} is {spec!r}, not a PartitionSpec.")
        sizes = dict(zip(self.mesh.axis_names, self.mesh.devices.shape))
        if len(spec) > len(shape):
            raise InvalidPlanError(f"spec {spec} of {where} has {len(spec)} entries but the value "
                                   f"has rank {len(shape)} (shape {shape}).")
        used: set = set()
        for dim, entry in enumerate(spec):
            if entry is None or entry is PartitionSpec.UNCONSTRAINED:
                continue
            axes = entry if isinstance(entry, tuple) else (entry,)
            n = 1
            for a in axes:
                if a not in sizes:
                    raise InvalidPlanError(f"spec {spec} of {where} names mesh axis {a!r}; the mesh "
                                           f"has {tuple(sizes)}. Re-plan for this topology.")
                if a in used:
                    raise InvalidPlanError(f"spec {spec} of {where} uses mesh axis {a!r} twice; an "
                                           f"axis can split one dimension only. Re-plan.")
                used.add(a)
                n *= sizes[a]
            if even and shape[dim] % n:
                raise InvalidPlanError(f"spec {spec} of {where} splits dim {dim} of size "
                                       f"{shape[dim]} {n} ways, which does not divide evenly.")

    def _check_intermediate_specs(self, graph: OpGraph) -> None:
        """Every planned operand/result names a real node, operand/result index and fitting spec."""
        for table, kind in ((self.plan.operand_specs, "operand"), (self.plan.result_specs, "result")):
            for (nid, k), spec in table.items():
                node = graph.nodes[nid] if 0 <= nid < len(graph.nodes) else None
                vals = () if node is None else (node.inputs if kind == "operand" else node.outputs)
                if node is None or not 0 <= k < len(vals):
                    raise InvalidPlanError(
                        f"the plan constrains {kind} {k} of node {nid}, which the traced step "
                        f"({len(graph.nodes)} nodes) does not have. Re-plan with hj.plan(...).")
                vid = vals[k]
                if vid is None:
                    continue  # a literal operand: the emitter never constrains it
                try:
                    self._check_spec(spec, f"{kind} {k} of node {nid}", graph.values[vid].shape,
                                     even=False)
                except InvalidPlanError as e:  # name the operator only when it failed (slow)
                    raise InvalidPlanError(f"{e} Node {nid} is {node.name!r} at "
                                           f"{node.source}.") from None
        for (nid, k), via in self.plan.operand_paths.items():
            if (nid, k) not in self.plan.operand_specs:
                raise InvalidPlanError(
                    f"the plan gives operand {k} of node {nid} a path of layouts "
                    f"({len(via)}) but no layout of its own (operand_specs); a path leads to an "
                    f"operand's layout. Re-plan with hj.plan(...).")
            vid = graph.nodes[nid].inputs[k]
            for spec in via:
                if vid is not None:
                    self._check_spec(spec, f"the path of operand {k} of node {nid}",
                                     graph.values[vid].shape, even=False)

    def _bind_graph(self, args) -> OpGraph:
        self._graph = bind_graph(self.fn, self.plan, self._graph, args)
        return self._graph

    def _check_args(self, args) -> list:
        return check_args(self.plan, args)

    def _flat_fn(self, graph: OpGraph):
        on_operand, on_result, on_bind = node_hooks(self.mesh, self.plan.operand_specs,
                                                    self.plan.result_specs,
                                                    self.plan.operand_paths)
        on_body = body_hooks(self.mesh, self.plan.bodies)

        def flat_fn(*flat):
            return tuple(interpret(graph.jaxpr, flat, on_operand=on_operand, on_result=on_result,
                                   on_body=on_body, on_bind=on_bind))

        return flat_fn

    def jitted(self, *args):
        """``(jitted, abstract)``: the program as a ``jax.jit`` of the flat arguments (with the
        plan's shardings, the state donated) and its abstract arguments, for these arguments
        (arrays or ShapeDtypeStructs), before anything is lowered: what :meth:`compile` compiles,
        and what ``jax.export.export(jitted, platforms=...)(*abstract)`` serializes for another
        platform (``benchmarks/gpu_sharded.py``)."""
        graph = self._bind_graph(args)
        self._check_args(args)
        self._check_intermediate_specs(graph)
        donate = tuple(sorted(graph.carried)) if self.donate else ()
        jitted = jax.jit(self._flat_fn(graph), in_shardings=self.in_shardings,
                         out_shardings=self.out_shardings, donate_argnums=donate)
        # The traced avals, not the plan's dtype names: those cannot rebuild extended dtypes. Weak
        # types too: a Python scalar's result comes back weakly typed, as from jax.jit.
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type)
                    for a, s in zip(graph.jaxpr.in_avals, self.in_shardings)]
        return jitted, abstract

    def lower(self, *args):
        """Trace (if needed) and lower for these arguments (arrays or ShapeDtypeStructs): the
        ``jax.stages.Lowered`` program that :meth:`compile` hands to XLA. Lowering runs Python;
        XLA's compile of the result does not hold the interpreter, so ``hulkjax compare`` lowers
        its plans one after another and compiles them on other threads (``compile(lowered=...)``).
        """
        jitted, abstract = self.jitted(*args)
        return jitted.lower(*abstract)

    def compile(self, *args, lowered=None):
        """Trace (if needed), lower and compile for these arguments (arrays or ShapeDtypeStructs).
        ``lowered``: this step's :meth:`lower` for them, already made (then only XLA's compile
        runs here)."""
        if self.compiled is not None:
            return self.compiled
        self.compiled = (self.lower(*args) if lowered is None else lowered).compile()
        log.info("compiled %s for strategy %s", getattr(self.fn, "__name__", "step"),
                 self.plan.strategy)
        return self.compiled

    # ---- running --------------------------------------------------------------------------
    def __call__(self, *args):
        compiled = self.compile(*args)  # before touching any argument
        leaves = self._check_args(args)
        # Arrays already in the planned layout (the previous step's state) are passed through and
        # donated. Anything else is copied into place, never aliased: a donated alias would delete
        # the caller's original buffer.
        donated = set(self._graph.carried) if self.donate else set()
        for x, t in zip(leaves, self.plan.inputs):
            if isinstance(x, jax.Array) and x.is_deleted():
                raise DonatedArgumentError(
                    f"argument {t.path!r} ({t.dtype}{list(t.shape)}) has been deleted: its buffer "
                    f"was donated to an earlier call of this step. Pass the state the step "
                    f"returned (state, metrics = step(state, batch)), or emit/hulk_shard with "
                    f"donate=False to keep inputs alive.")
        # The same array at two positions where one of them is donated makes XLA abort the
        # process ("donate the same buffer twice" / "use a buffer previously donated", a
        # segfault in jaxlib 0.10): tied or aliased state leaves (state = {"a": x, "b": x}) must
        # not crash the user's job. Later occurrences get their own copy.
        placed, first_use = [], {}
        for i, (x, s) in enumerate(zip(leaves, self.in_shardings)):
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
                j = first_use.setdefault(id(x), i)
                if j != i and (i in donated or j in donated):
                    placed.append(_place_copy(x, s, force=True))
                else:
                    placed.append(x)
            else:
                placed.append(_place_copy(x, s))
        out = compiled(*placed)
        return jax.tree_util.tree_unflatten(self.plan.out_tree, list(out))

    def hlo_text(self) -> str:
        """The compiled program after SPMD partitioning (``compiled.as_text()``)."""
        if self.compiled is None:
            raise NotCompiledError(
                f"{type(self).__name__}.hlo_text(): the step is not compiled yet (it compiles "
                "on its first call). Call it once, step(*args), or compile it without running "
                "it: step.compile(*args).")
        return self.compiled.as_text()

    def collectives(self) -> list[Collective]:
        """The collectives in the compiled program, with the mesh axes they run over."""
        return collectives_from_hlo(self.hlo_text(), tuple(self.mesh.devices.shape),
                                    tuple(self.mesh.axis_names))


def _place_copy(x, sharding: NamedSharding, *, force: bool = False):
    """``x`` laid out as ``sharding`` in buffers of its own (``force``: always a fresh copy).

    ``device_put`` reuses the source buffer for the shard on the source device when the layout
    replicates it (even with ``may_alias=False`` in JAX 0.10), and donating that shard would delete
    the caller's array; such a result is copied.
    """
    if force:
        return jax.device_put(jax.numpy.copy(x), sharding, may_alias=False)
    y = jax.device_put(x, sharding, may_alias=False)
    if isinstance(x, jax.Array) and not x.is_deleted():
        try:
            src = {b.data.unsafe_buffer_pointer() for b in x.addressable_shards}
            if any(b.data.unsafe_buffer_pointer() in src for b in y.addressable_shards):
                y = jax.device_put(jax.numpy.copy(x), sharding, may_alias=False)
        except (AttributeError, NotImplementedError, RuntimeError):
            y = jax.device_put(jax.numpy.copy(x), sharding, may_alias=False)
    return y


def emit(fn: Callable, plan: Plan, *, donate: bool = True, mesh=None) -> ShardedStep:
    """Build the sharded program for ``plan`` (compiled on the first call).

    Args:
      fn: the step the plan was made for.
      plan: a :class:`Plan` from :func:`hulkjax.plan` or ``Plan.load``.
      donate: donate the state buffers the step carries to its results (saves a copy of the
        parameters and optimizer state).
      mesh: use this mesh instead of ``plan.topology.mesh()``.
    """
    return ShardedStep(fn, plan, donate=donate, mesh=mesh)
