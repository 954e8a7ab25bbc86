"""Baseline planners: what people write by hand today.

* ``replicate``: every device holds and computes everything.
* ``dp``: the batch split over every device; parameters and optimizer state replicated.
* ``fsdp``: ZeRO-3: parameters, gradients and optimizer state sharded over every device, gathered
  right before each use; the batch split.
* ``megatron``: tensor parallelism over every device: column/row pairs found from the graph.
* ``dp_tp``: data parallel on the expensive mesh axes, megatron on the cheapest one.

All decisions come from the graph (roles from the data flow, dimensions from dimension numbers),
never from parameter names. Each returns a :class:`~hulkjax.strategies.plan.Plan`.
"""

from __future__ import annotations

from jax.extend.core import primitives as P

from hulkjax.errors import StrategyNotApplicableError
from hulkjax.rules.dims import CONTRACTED, dot_partner, map_dim
from hulkjax.strategies.base import SpecBuilder, register_strategy
from hulkjax.strategies.plan import Plan
from hulkjax.trace.flops import ELEMENTWISE_PRIMITIVES
from hulkjax.trace.graph import DATA, PARAMETER, OpGraph

# Ops through which a parameter is still "the parameter" (casts, reshapes, broadcasts).
_PARAM_VIEW_OPS = frozenset([P.convert_element_type_p, P.copy_p, P.reshape_p, P.squeeze_p,
                             P.transpose_p, P.broadcast_in_dim_p])
_UPDATE_OPS = frozenset(ELEMENTWISE_PRIMITIVES) | {P.add_jaxvals_p, P.convert_element_type_p}


@register_strategy("replicate")
def replicate(graph: OpGraph, topology, **_) -> Plan:
    """Everything replicated: the single-device program on every device."""
    return SpecBuilder(graph, topology, "replicate").build()


@register_strategy("dp")
def data_parallel(graph: OpGraph, topology, **_) -> Plan:
    """Batch (dim 0 of every data input) split over all mesh axes; state replicated."""
    sb = SpecBuilder(graph, topology, "dp")
    _split_batch(sb, tuple(topology.axis_names))
    return sb.build()


@register_strategy("fsdp")
def fully_sharded(graph: OpGraph, topology, **_) -> Plan:
    """ZeRO-3: state sharded over all devices, all-gathered before each use; batch split."""
    sb = SpecBuilder(graph, topology, "fsdp")
    axes = tuple(topology.axis_names)
    _split_batch(sb, axes)
    _shard_parameters(sb, axes)
    sb.param_use = "gather"
    return sb.build()


@register_strategy("megatron")
def megatron(graph: OpGraph, topology, **_) -> Plan:
    """Tensor parallelism over all mesh axes: column/row pairs (MLPs, attention heads)."""
    sb = SpecBuilder(graph, topology, "megatron")
    _tensor_parallel(sb, tuple(topology.axis_names))
    return sb.build()


@register_strategy("dp_tp")
def data_tensor_parallel(graph: OpGraph, topology, **_) -> Plan:
    """2-D: tensor parallel on the cheapest mesh axis, data parallel on the others."""
    axes = tuple(topology.axis_names)
    if len(axes) < 2:
        raise StrategyNotApplicableError(
            f"dp_tp needs a mesh with at least 2 axes; topology has {axes} of shape "
            f"{tuple(topology.shape)}. Use 'dp' or 'megatron', or a 2-D topology such as "
            f"Topology.grid((2, 4), ('data', 'model')).")
    # Cheapest = highest bandwidth, then lowest latency; ties go to the innermost axis.
    model = max(reversed(axes), key=lambda a: (topology.axis_bandwidth(a), -topology.axis_latency(a)))
    data = tuple(a for a in axes if a != model)
    sb = SpecBuilder(graph, topology, "dp_tp")
    sb.notes.append(f"tensor parallel on {model!r} "
                    f"({topology.axis_bandwidth(model) / 1e9:.3g} GB/s), data parallel on {data}")
    _split_batch(sb, data)
    _tensor_parallel(sb, (model,))
    return sb.build()


# ---- shared pieces ------------------------------------------------------------------------


def _split_batch(sb: SpecBuilder, axes: tuple[str, ...]) -> None:
    g = sb.graph
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        shape = g.values[vid].shape
        if role == DATA and shape:
            sb.set_input(i, sb.dim_spec(shape, 0, axes, g.input_paths[i]))


def _shard_parameters(sb: SpecBuilder, axes: tuple[str, ...]) -> None:
    """ZeRO-3 layouts: each parameter split over ``axes`` on the dimension most of them divide
    (the largest such)."""
    g = sb.graph
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        if role != PARAMETER:
            continue
        shape = g.values[vid].shape
        if not shape:
            continue
        dim = max(range(len(shape)), key=lambda d: (len(sb.axes_for(shape[d], axes)), shape[d], -d))
        sb.set_input(i, sb.dim_spec(shape, dim, axes, g.input_paths[i]))


def _tensor_parallel(sb: SpecBuilder, model_axes: tuple[str, ...]) -> None:
    """Megatron's column/row alternation, found by following the model-sharded dimension.

    Walking the graph in order, the first matmul (or convolution) that uses a parameter decides it:
    if the other operand arrives sharded on a dimension this matmul contracts, the parameter is
    split on the partner dimension (row parallel: partial sums, one all-reduce); if it arrives
    unsharded, the parameter is split on its outermost free dimension if that divides and the
    split is closed by a row-parallel matmul before anything reduces over it (column parallel: the
    result stays split until the row matmul's all-reduce). A parameter met elementwise by a split result (a bias after a column
    matmul) is split the same way. The split dimension is followed through elementwise ops,
    reshapes, transposes and attention's batched matmuls by the dimension table in
    :mod:`hulkjax.rules.dims`. Everything else is left to the compiler's propagation.
    """
    g = sb.graph
    # value -> (param input index, {value dim: param dim}) for views of parameters
    origin: dict[int, tuple[int, dict[int, int]]] = {}
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        if role == PARAMETER:
            origin[vid] = (i, {d: d for d in range(len(g.values[vid].shape))})
    decided: dict[int, int | None] = {}
    shard: dict[int, int] = {}

    def divisible(size: int) -> bool:  # by the model axes, or by a subset of them
        return bool(sb.axes_for(size, model_axes))

    def decide(i: int, pdim: int | None) -> None:
        if i in decided:
            return
        shape = g.values[g.inputs[i]].shape
        if pdim is not None and not divisible(shape[pdim]):
            pdim = None  # no subset of the model axes divides it: replicated
        decided[i] = pdim

    def sharded_dim(v: int) -> int | None:
        if v in origin:
            i, dims = origin[v]
            pdim = decided.get(i)
            if pdim is None:
                return None
            return next((vd for vd, pd in dims.items() if pd == pdim), None)
        return shard.get(v)

    for node in g.nodes:
        ins = node.inputs
        if node.primitive in _PARAM_VIEW_OPS and ins and ins[0] in origin:
            i, dims = origin[ins[0]]
            mapped = {}
            for vd, pd in dims.items():
                r = map_dim(node, g, 0, vd)
                if isinstance(r, int):
                    mapped[r] = pd
            origin[node.outputs[0]] = (i, mapped)
            continue
        if node.primitive in (P.dot_general_p, P.conv_general_dilated_p):
            _decide_matmul(node, g, origin, decided, sharded_dim, decide, divisible)
        out_dim = None
        for k, v in enumerate(ins):
            if v is None:
                continue
            sd = sharded_dim(v)
            if sd is None:
                continue
            r = map_dim(node, g, k, sd)
            if isinstance(r, int):
                out_dim = r
                break
        if out_dim is None or len(node.outputs) != 1:
            continue
        shard[node.outputs[0]] = out_dim
        if node.primitive in (P.dot_general_p, P.conv_general_dilated_p):
            continue
        for k, v in enumerate(ins):
            if v in origin and origin[v][0] not in decided:
                i, dims = origin[v]
                for vd, pd in dims.items():
                    if map_dim(node, g, k, vd) == out_dim:
                        decide(i, pd)
                        break

    for i, pdim in decided.items():
        if pdim is not None:
            shape = g.values[g.inputs[i]].shape
            sb.set_input(i, sb.dim_spec(shape, pdim, model_axes, g.input_paths[i]))


def _decide_matmul(node, g, origin, decided, sharded_dim, decide, divisible) -> None:
    ins = node.inputs
    param_ops = [k for k in (0, 1) if ins[k] is not None and ins[k] in origin]
    if len(param_ops) != 1:
        return
    k = param_ops[0]
    a = 1 - k
    i, dims = origin[ins[k]]
    if i in decided or ins[a] is None:
        return
    adim = sharded_dim(ins[a])
    pshape = g.values[ins[k]].shape
    if node.primitive is P.conv_general_dilated_p:
        if k != 1:
            return
        rhs_spec = node.params["dimension_numbers"].rhs_spec
        lhs_spec = node.params["dimension_numbers"].lhs_spec
        if adim is None:
            target = rhs_spec[0]  # output features: column
        elif adim == lhs_spec[1]:
            target = rhs_spec[1]  # input features: row
        else:
            return
        if target in dims and divisible(pshape[target]):
            decide(i, dims[target])
        return
    if adim is not None:
        if map_dim(node, g, a, adim) == CONTRACTED:
            partner = dot_partner(node, a, adim)
            if partner in dims:
                decide(i, dims[partner])  # row parallel
        return
    # Column parallel on the outermost free dimension (the heads of a (D, heads, head_dim)
    # kernel), or not at all: splitting head_dim instead would put the split under attention's
    # contraction and all-reduce the scores.
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    contract, batch = (lc, lb) if k == 0 else (rc, rb)
    free = [d for d in range(len(pshape)) if d not in contract and d not in batch]
    if free and free[0] in dims and divisible(pshape[free[0]]):
        out_dim = map_dim(node, g, k, free[0])
        if isinstance(out_dim, int) and _closed_by_row_matmul(g, node.outputs[0], out_dim, origin):
            decide(i, dims[free[0]])
    if i not in decided:
        decide(i, None)


def _closed_by_row_matmul(g: OpGraph, start: int, dim: int, origin) -> bool:
    """Whether a split of ``dim`` of value ``start`` is closed by a row-parallel matmul before
    anything reduces over it, gathers it, or loses track of it.

    Follows every use of the split dimension (backward-pass uses included). A use by a matmul with a
    parameter that contracts the dimension closes that path; a use that carries the dimension on
    continues; a graph output ends a path neutrally; anything else (LayerNorm's reduction over the
    hidden size, a gather, an operator without a dimension rule) rejects the split.
    """
    outputs = set(o for o in g.outputs if o is not None)
    closed = False
    seen = {(start, dim)}
    todo = [(start, dim)]
    while todo:
        v, d = todo.pop()
        for nid, k in g.consumers(v):
            node = g.nodes[nid]
            r = map_dim(node, g, k, d)
            if r == CONTRACTED and node.primitive is P.dot_general_p and any(
                    u is not None and u in origin for j, u in enumerate(node.inputs) if j != k):
                closed = True
                continue
            if not isinstance(r, int) or len(node.outputs) != 1:
                return False
            nxt = (node.outputs[0], r)
            # A graph output that is used further (a loop body's residuals) is followed on.
            if nxt not in seen and (node.outputs[0] not in outputs or g.consumers(node.outputs[0])):
                seen.add(nxt)
                todo.append(nxt)
    return closed
