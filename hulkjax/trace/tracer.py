"""Trace a training step into an :class:`~hulkjax.trace.graph.OpGraph`.

>>> import jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: jnp.tanh(x @ w).sum(), jnp.ones((4, 3)), jnp.ones((2, 4)))
>>> [n.name for n in g.nodes]
['dot_general', 'tanh', 'reduce_sum']
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from typing import Any

import jax
from jax.extend import core as jex_core
from jax.extend.core import primitives as P
from jax.interpreters import partial_eval as pe

from hulkjax.errors import UnsupportedStepError
from hulkjax.heap import collector_paused
from hulkjax.trace.flops import flops_of
from hulkjax.trace.graph import DATA, OPTIMIZER, PARAMETER, Node, OpGraph, Value, dtype_name
from hulkjax.trace.kernels import describe as describe_kernel
from hulkjax.trace.primitives import KERNELS, PASS_THROUGH, SAME_SHAPE_UPDATES
from hulkjax.trace.walk import in_host_memory, inlined_body, struct_of, sub_jaxprs


@collector_paused()  # see hulkjax.heap: a trace allocates much and frees little
def trace(fn, *args, **kwargs) -> OpGraph:
    """Trace ``fn(*args)`` into an operator graph without running it.

    Args:
      fn: a pure function of pytrees of arrays, typically ``train_step(state, batch)``.
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` leaves (nothing is allocated).

    Returns:
      The :class:`OpGraph`, inputs named by pytree path rooted at ``fn``'s parameter names.

    Python scalars (``bool``, ``int``, ``float``, ``complex``) are taken as ``jax.jit`` takes
    them: weakly typed 0-d arrays (``int`` is ``int32`` without x64; ``bool`` is strongly typed),
    such as flax's ``TrainState.step`` (a Python ``0`` after ``TrainState.create``).

    Raises:
      UnsupportedStepError: keyword arguments, or a leaf that ``jax.jit`` refuses too (strings,
        functions, objects; an ``int`` too large for its dtype). Bind static values with
        ``functools.partial`` first.
    """
    if kwargs:
        raise UnsupportedStepError(
            f"hulkjax traces positional array arguments only; got keyword arguments "
            f"{sorted(kwargs)}. Pass them positionally, or bind static ones with "
            f"functools.partial(fn, {', '.join(f'{k}=...' for k in sorted(kwargs))}).")
    _check_arity(fn, args)
    input_paths, in_tree, avals = argument_avals(fn, args)
    # Trace on shapes, dtypes and weak types alone: shardings of already-placed arrays must not
    # enter the jaxpr, and a weak type decides dtype promotion inside the step, as under jax.jit.
    abstract = jax.tree_util.tree_unflatten(in_tree, avals)
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract)
    except UnsupportedStepError:
        raise
    except TypeError as e:
        # Only a concretization error means "the step needs concrete values"; any other TypeError
        # (mismatched shapes, a bad call inside the step) is the step's own bug: say so plainly.
        if isinstance(e, jax.errors.ConcretizationTypeError):
            hint = ("hulkjax traces the step with abstract arrays, so it must not branch on array "
                    "values or take static arguments; use jax.lax.cond / jnp.where, or bind static "
                    "arguments with functools.partial.")
        else:
            hint = ("the step raised it while being traced with abstract arrays of the arguments' "
                    "shapes and dtypes; check that it runs under jax.jit with these arguments.")
        raise UnsupportedStepError(
            f"tracing {getattr(fn, '__name__', fn)!r} failed: {e}. {hint}") from e
    closed = _without_dead_code(closed)
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    output_paths = [_path_str(path, ("out",), tuple_root=True) for path, _ in out_leaves]
    g = build_graph(closed, input_paths, output_paths, in_tree,
                    jax.tree_util.tree_structure(out_shape))
    g.fn = fn
    return g


def _without_dead_code(closed):
    """The jaxpr without equations whose results reach no output (the forward loss under
    ``jax.grad`` when the step does not return it): XLA removes them before it partitions, so
    they must not enter the plan or its cost. Inputs and effectful equations stay."""
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return jex_core.ClosedJaxpr(jaxpr, closed.consts)


def build_graph(closed, input_paths, output_paths, in_tree=None, out_tree=None) -> OpGraph:
    """Build the graph of a ``ClosedJaxpr`` (used for the step and for loop bodies)."""
    b = _Builder()
    env: dict[Any, Any] = {}
    consts = []
    for cv in closed.jaxpr.constvars:
        env[cv] = b.new_value(cv.aval, None)
        consts.append(env[cv])
    inputs = []
    for iv, path in zip(closed.jaxpr.invars, input_paths):
        env[iv] = b.new_value(iv.aval, None, name=path)
        inputs.append(env[iv])
    b.walk(closed.jaxpr, env, "", ())
    outputs = [None if isinstance(a, jex_core.Literal) else env[a] for a in closed.jaxpr.outvars]
    g = OpGraph(nodes=b.nodes, values=b.values, inputs=inputs, outputs=outputs,
                input_paths=input_paths, output_paths=output_paths, in_tree=in_tree,
                out_tree=out_tree, jaxpr=closed, constants=consts + b.constants)
    _input_roles(g)
    _label_layers_from_parameters(g)
    return g


class _Builder:
    def __init__(self):
        self.nodes: list[Node] = []
        self.values: list[Value] = []
        self.constants: list[int] = []

    def new_value(self, aval, producer, index=0, name=None) -> int:
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        v = Value(len(self.values), shape, dtype_name(dtype) if dtype is not None else "token",
                  producer, index, name,
                  in_host_memory(aval))
        self.values.append(v)
        return v.id

    def walk(self, jaxpr, env, scope: str, outer_tbs: tuple, backward: bool = False) -> None:
        for eqn in jaxpr.eqns:
            ins = [a if isinstance(a, jex_core.Literal) else env[a] for a in eqn.invars]
            stack = str(eqn.source_info.name_stack)
            is_backward = backward or "transpose(" in stack
            inner_scope = _join_scope(scope, _clean_scope(stack))
            body = inlined_body(eqn)
            if body is not None:
                sub = body[0]
                sub_env: dict[Any, Any] = {}
                for cv in sub.constvars:
                    sub_env[cv] = self.new_value(cv.aval, None)
                    self.constants.append(sub_env[cv])
                for iv, a in zip(sub.invars, ins):
                    sub_env[iv] = a
                # Tracebacks inside a nested jit stop at its boundary: keep the enclosing ones.
                self.walk(sub, sub_env, inner_scope, (eqn.source_info.traceback, *outer_tbs),
                          is_backward)
                for ov, a in zip(eqn.outvars, sub.outvars):
                    env[ov] = a if isinstance(a, jex_core.Literal) else sub_env[a]
                continue
            node_id = len(self.nodes)
            outs = tuple(self.new_value(ov.aval, node_id, k) for k, ov in enumerate(eqn.outvars))
            for ov, vid in zip(eqn.outvars, outs):
                env[ov] = vid
            inputs = tuple(None if isinstance(a, jex_core.Literal) else a for a in ins)
            in_avals = [a.aval for a in eqn.invars]
            in_shapes = [tuple(getattr(a, "shape", ())) for a in in_avals]
            out_shapes = [self.values[o].shape for o in outs]
            node = Node(id=node_id, primitive=eqn.primitive, params=eqn.params, inputs=inputs,
                        outputs=outs, layer=inner_scope, backward=is_backward,
                        traceback=(eqn.source_info.traceback, *outer_tbs))
            subs = sub_jaxprs(eqn)
            if subs:
                _cost_control_flow(node, eqn, subs)
            elif eqn.primitive in KERNELS and (kernel := _kernel(eqn, in_shapes)) is not None:
                node.kernel = kernel
                node.flops, node.bytes = kernel.flops, kernel.bytes
            else:
                node.flops = flops_of(eqn.primitive, in_shapes, out_shapes, eqn.params)
                node.bytes = float(sum(_aval_bytes(a) for a in in_avals)
                                   + sum(_aval_bytes(ov.aval) for ov in eqn.outvars))
            self.nodes.append(node)


def _kernel(eqn, in_shapes):
    """The kernel's description, or ``None`` for a kernel whose parameters this JAX lays out in a
    way :mod:`hulkjax.trace.kernels` does not read (it is then an operator without a rule:
    replicated, with the warning)."""
    try:
        return describe_kernel(eqn.params, in_shapes)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        return None


def _cost_control_flow(node: Node, eqn, subs) -> None:
    graphs = []
    for role, jaxpr, consts in subs:
        closed = jex_core.ClosedJaxpr(jaxpr, consts)
        paths = [f"{role}/in{i}" for i in range(len(jaxpr.invars))]
        outs = [f"{role}/out{i}" for i in range(len(jaxpr.outvars))]
        graphs.append(build_graph(closed, paths, outs))
    node.subgraphs = tuple(graphs)
    if eqn.primitive is P.scan_p:
        node.trip_count = int(eqn.params["length"])
        node.flops = graphs[0].total_flops * node.trip_count
        node.bytes = sum(n.bytes for n in graphs[0].nodes) * node.trip_count
    elif eqn.primitive is P.while_p:
        node.trip_count = 1  # unknown statically; fori_loops with static bounds become scans
        node.flops = sum(g.total_flops for g in graphs)
        node.bytes = sum(n.bytes for g in graphs for n in g.nodes)
    else:  # cond: the most expensive branch
        node.flops = max(g.total_flops for g in graphs)
        node.bytes = max(sum(n.bytes for n in g.nodes) for g in graphs)


def _aval_bytes(aval) -> int:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    # getattr: JAX's extended dtypes (PRNG keys) have an itemsize but are not numpy dtypes.
    return math.prod(shape) * int(getattr(dtype, "itemsize", 0) or 0)


_TRANSFORM = re.compile(r"\w+\(([^()]*)\)")


@functools.lru_cache(maxsize=4096)
def _clean_scope(stack: str) -> str:
    """``"transpose(jvp(MLP))/Dense_1"`` -> ``"MLP/Dense_1"`` (a function of the string alone,
    kept per name stack: a step's equations share a few hundred)."""
    prev = None
    while prev != stack:
        prev, stack = stack, _TRANSFORM.sub(r"\1", stack)
    return "/".join(p for p in stack.split("/") if p)


def _join_scope(outer: str, inner: str) -> str:
    if not outer:
        return inner
    if not inner or inner.startswith(outer):
        return inner or outer
    return f"{outer}/{inner}"


def _check_arity(fn, args) -> None:
    """Raise a clear error when ``fn`` cannot take ``args`` positionally (before tracing).

    Typical cause: ``hj.plan(step, state, batch=batch, topology=...)``: keyword arguments of
    ``hj.plan`` go to the planner as options, so the step is short of an argument.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and some callables have no signature: let tracing report problems
    try:
        sig.bind(*args)
    except TypeError as e:
        params = [p.name for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise UnsupportedStepError(
            f"{getattr(fn, '__name__', fn)!r} takes positional parameters {params} but got "
            f"{len(args)} positional argument(s) ({e}). hulkjax passes the step's arguments "
            f"positionally: pass every array argument positionally (keyword arguments of hj.plan "
            f"and hulk_shard are planner options), and bind static settings with "
            f"functools.partial.") from None


def _arg_names(fn, n: int) -> tuple[str, ...]:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return tuple(names + [f"arg{i}" for i in range(len(names), n)])


def _path_str(path, roots, tuple_root=False) -> str:
    if not path:
        return roots[0]
    first, rest = path[0], path[1:]
    if tuple_root:
        head = roots[0]
        rest = path
    else:
        idx = getattr(first, "idx", None)
        head = roots[idx] if idx is not None and idx < len(roots) else str(first)
    tail = jax.tree_util.keystr(tuple(rest), simple=True, separator="/")
    return f"{head}/{tail}" if tail else head


PYTHON_SCALARS = (bool, int, float, complex)
"""Python scalar types ``jax.jit`` accepts as arguments (weakly typed, except ``bool``)."""


def leaf_aval(leaf) -> jax.ShapeDtypeStruct | None:
    """How ``jax.jit`` sees an argument leaf: shape, dtype and weak type (``None``: no array).

    Python scalars are weakly typed 0-d arrays (``bool`` is strongly typed); dtypes are JAX's
    (a float64 numpy array is float32 without x64). Raises ``OverflowError`` for an ``int`` too
    large for its dtype, as ``jax.jit`` does.

    >>> leaf_aval(0), leaf_aval(True)
    (ShapeDtypeStruct(shape=(), dtype=int32, weak_type=True), ShapeDtypeStruct(shape=(), dtype=bool))
    """
    if not isinstance(leaf, PYTHON_SCALARS) and not (hasattr(leaf, "shape")
                                                     and hasattr(leaf, "dtype")):
        return None
    try:
        aval = jax.typeof(leaf)
    except TypeError:  # array-like that JAX does not know: its own shape and dtype
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
    return struct_of(aval)


def argument_avals(fn, args) -> tuple[list[str], Any, list[jax.ShapeDtypeStruct]]:
    """``(input paths, tree, avals)`` of a step's positional arguments, as ``jax.jit`` sees them.

    Raises:
      UnsupportedStepError: a leaf that is no array and no Python scalar, named by its path.
    """
    names = _arg_names(fn, len(args))
    leaves_with_path, in_tree = jax.tree_util.tree_flatten_with_path(args)
    paths, avals = [], []
    for path, leaf in leaves_with_path:
        p = _path_str(path, names)
        paths.append(p)
        avals.append(_checked_aval(p, leaf))
    return paths, in_tree, avals


def _checked_aval(path: str, leaf) -> jax.ShapeDtypeStruct:
    try:
        aval = leaf_aval(leaf)
    except OverflowError as e:
        raise UnsupportedStepError(
            f"argument leaf {path!r} is a Python {type(leaf).__name__} ({leaf!r}) that does not "
            f"fit JAX's default dtype ({e}); jax.jit refuses it too. Pass an array of a wider "
            f"dtype (enable jax_enable_x64 for 64-bit), or bind it with functools.partial if it "
            f"is a static setting.") from None
    if aval is None:
        raise UnsupportedStepError(
            f"argument leaf {path!r} is a {type(leaf).__name__}, not an array; hulkjax traces steps "
            f"whose arguments are pytrees of arrays, Python numbers or jax.ShapeDtypeStruct. Mark "
            f"non-array fields as static pytree metadata (flax.struct.field(pytree_node=False)) "
            f"or bind them with functools.partial.")
    return aval


# ---- input roles, from the data flow --------------------------------------------------------



def _input_roles(g: OpGraph) -> None:
    """Set ``input_roles``, ``carried`` and ``owners`` of a graph from its data flow.

    State is what the step carries to an output of the same shape through elementwise updates (the
    optimizer's ``p - lr * u``, ``b1 * mu + ...``). Among state, parameters are the leaves that the
    computation also feeds (through reshapes and casts) into an operator that is not a same-shape
    elementwise update: a matmul, a convolution, a broadcast into activations. Other state
    (optimizer moments) is owned by the parameter whose update it flows into.
    """
    out_index = {o: i for i, o in enumerate(g.outputs) if o is not None}
    carried = {}
    for i, vid in enumerate(g.inputs):
        out = _carried_to_output(g, vid, out_index, g.values[vid].shape)
        if out is not None:
            carried[i] = out_index[out]
    g.carried = carried  # (what is state decides what is a result other than state)
    other_out = _other_outputs(g)  # the same for every leaf: made once
    roles = [DATA if i not in carried else
             PARAMETER if _feeds_computation(g, vid, g.values[vid].shape, other_out)
             else OPTIMIZER
             for i, vid in enumerate(g.inputs)]
    g.input_roles = tuple(roles)
    param_of = {}  # value id -> param input index, through casts/reshapes
    for i, (vid, r) in enumerate(zip(g.inputs, roles)):
        if r == PARAMETER:
            for v in _pass_through_closure(g, vid):
                param_of[v] = i
    g.owners = {}
    for i, (vid, r) in enumerate(zip(g.inputs, roles)):
        if r == OPTIMIZER:
            owner = _owner_param(g, vid, param_of)
            if owner is not None:
                g.owners[i] = owner


def _carried_to_output(g: OpGraph, vid: int, outs: dict[int, int], shape) -> int | None:
    if vid in outs:
        return vid
    seen, todo = {vid}, [vid]
    while todo:
        v = todo.pop()
        for nid, _ in g.consumers(v):
            node = g.nodes[nid]
            if node.primitive not in SAME_SHAPE_UPDATES:
                continue
            for o in node.outputs:
                if g.values[o].shape == shape and o not in seen:
                    if o in outs:
                        return o
                    seen.add(o)
                    todo.append(o)
    return None


def _pass_through_closure(g: OpGraph, vid: int) -> list[int]:
    out, todo = [vid], [vid]
    while todo:
        v = todo.pop()
        for nid, _ in g.consumers(v):
            node = g.nodes[nid]
            if node.primitive in PASS_THROUGH:
                out.extend(node.outputs)
                todo.extend(node.outputs)
    return out


def _owner_param(g: OpGraph, vid: int, param_of: dict[int, int]) -> int | None:
    shape = g.values[vid].shape
    seen, todo = {vid}, [vid]
    while todo:
        v = todo.pop()
        for nid, _ in g.consumers(v):
            node = g.nodes[nid]
            if node.primitive not in SAME_SHAPE_UPDATES:
                continue
            for u in node.inputs:
                if u is not None and u in param_of and g.values[u].shape == shape:
                    return param_of[u]
            for o in node.outputs:
                if g.values[o].shape == shape and o not in seen:
                    seen.add(o)
                    todo.append(o)
    return None


def _other_outputs(g: OpGraph) -> set[int]:
    """The graph's results that are not carried state (the loss, metrics)."""
    state_out = {g.outputs[o] for o in g.carried.values()}
    return {v for v in g.outputs if v is not None} - state_out


def _feeds_computation(g: OpGraph, vid: int, shape, other_out: set[int] | None = None) -> bool:
    """Whether a state leaf is computed with, not only updated: it reaches the backward pass or a
    result that is not state (the loss), or it meets an operator that is not a same-shape update
    (a matmul, a broadcast into activations). Optimizer moments and step counters only ever flow
    into the update of state; a parameter used first elementwise (Gemma's ``1 + scale``) still
    reaches the loss. ``other_out``: :func:`_other_outputs` of ``g`` (made here without it)."""
    if other_out is None:
        other_out = _other_outputs(g)
    seen, todo = {vid}, [(vid, True)]  # (value, reached through reshapes and casts only)
    while todo:
        v, direct = todo.pop()
        if v in other_out:
            return True
        for nid, _ in g.consumers(v):
            node = g.nodes[nid]
            if node.backward:
                return True
            passing = node.primitive in PASS_THROUGH
            if direct and not passing and not (node.primitive in SAME_SHAPE_UPDATES and all(
                    g.values[o].shape == g.values[v].shape for o in node.outputs)):
                return True
            for o in node.outputs:
                if o not in seen:
                    seen.add(o)
                    todo.append((o, direct and passing))
    return False


def _label_layers_from_parameters(g: OpGraph) -> None:
    """Models without name scopes (flax.nnx): label nodes by the parameter they touch.

    A node using a parameter (through casts/reshapes) takes the parameter's enclosing path; other
    unlabeled nodes take the label of their first labeled operand. Labels are for people (summaries,
    plots); no decision depends on them.
    """
    if any(n.layer for n in g.nodes):
        return
    params = [(v, p) for v, p, r in zip(g.inputs, g.input_paths, g.input_roles) if r == PARAMETER]
    if not params:
        return
    prefix = _common_prefix([p for _, p in params])
    label: dict[int, str] = {}
    for vid, path in params:
        scope = path[len(prefix):].rsplit("/", 1)[0] if "/" in path[len(prefix):] else path
        label[vid] = scope
    param_vals = {v for v, _ in params}
    for n in g.nodes:
        # A parameter operand names the layer; otherwise the first labelled operand does.
        lab = next((label[v] for v in n.inputs if v is not None and v in param_vals), "") or \
            next((label[v] for v in n.inputs if v is not None and v in label), "")
        n.layer = lab
        if lab:
            for o in n.outputs:
                label[o] = lab


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split("/") for p in paths]
    common = []
    for segs in zip(*parts):
        if len(set(segs)) != 1:
            break
        common.append(segs[0])
    if len(common) >= min(len(p) for p in parts):
        common = common[:-1]
    return "/".join(common) + "/" if common else ""

