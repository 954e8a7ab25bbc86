"""The layouts people write by hand, as recipes over a plan's inputs: split the batch, shard the
parameters (ZeRO-3), pair columns and rows (Megatron).

Every decision comes from the graph (roles from the data flow, dimensions from dimension numbers
through :mod:`hulkjax.rules.dims`), never from parameter names. The baselines
(:mod:`hulkjax.strategies.baselines`) and the loop-body planner (:mod:`hulkjax.strategies.loops`)
both build on these recipes; nothing here costs anything.

>>> import jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)))
>>> sb = InputLayouts(g, hj.Topology.grid((8,), ("d",)))
>>> split_batch(sb, ("d",)); sb.input_specs
[P(), P('d',)]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from jax.extend.core import primitives as P
from jax.sharding import PartitionSpec

from hulkjax.rules.dims import CONTRACTED, dot_partner, map_dim, map_dim_results
from hulkjax.trace.graph import DATA, PARAMETER, OpGraph
from hulkjax.trace.primitives import VIEWS


class InputLayouts:
    """A plan's input layouts as a person writes them: one ``PartitionSpec`` per input leaf.

    Shards a dimension over mesh axes only where the sizes divide: ``shard(vid, dim, axes)`` uses
    the largest ordered subset of ``axes`` whose product divides the dimension (none: replicated).
    """

    def __init__(self, graph: OpGraph, topology, strategy: str = ""):
        self.graph = graph
        self.topology = topology
        self.strategy = strategy
        self.sizes = dict(zip(topology.axis_names, topology.shape))
        self.input_specs: list[PartitionSpec] = [PartitionSpec()] * len(graph.inputs)
        self.notes: list[str] = []
        self.param_use = "keep"  # "gather" for ZeRO-3: parameters gathered whole before each use
        self.gather_axes: tuple[str, ...] | None = None  # with "gather": only over these axes
        # Megatron's sequence parallelism over these (tensor-parallel) axes, applied to the
        # completed assignment (:func:`hulkjax.strategies.search.sequence_parallel`)
        self.sequence_axes: tuple[str, ...] = ()
        # The distributed optimizer (:func:`shard_optimizer_state`): optimizer state laid out
        # apart from its parameter, {state input: layout}; without an entry, the parameter's.
        self.state_specs: dict[int, PartitionSpec] = {}
        # Whether the layouts are completed and costed in the cost model with optimizer state
        # apart (set with state_specs; a planner that searches such layouts sets it for all).
        self.optimizer_apart = False
        self._axes_for: dict = {}  # (size, axes) -> axes_for's answer (sizes are fixed)

    def axes_for(self, size: int, axes: Sequence[str]) -> tuple[str, ...]:
        """The largest ordered subset of ``axes`` whose total size divides ``size``."""
        key = (size, tuple(axes))
        hit = self._axes_for.get(key)
        if hit is None:
            hit = self._axes_for[key] = self._largest_dividing(size, key[1])
        return hit

    def _largest_dividing(self, size: int, axes: tuple[str, ...]) -> tuple[str, ...]:
        best: tuple[str, ...] = ()
        best_n = 1
        for r in range(len(axes), 0, -1):
            for combo in itertools.combinations(axes, r):
                n = 1
                for a in combo:
                    n *= self.sizes[a]
                if n > best_n and size % n == 0:
                    best, best_n = combo, n
        return best

    def dim_spec(self, shape: Sequence[int], dim: int, axes: Sequence[str],
                 path: str = "") -> PartitionSpec:
        """A spec sharding ``dim`` of ``shape`` over (a dividing subset of) ``axes``."""
        if not axes or dim is None or dim >= len(shape):
            return PartitionSpec()
        use = self.axes_for(shape[dim], axes)
        if tuple(use) != tuple(axes):
            want = 1
            for a in axes:
                want *= self.sizes[a]
            self.notes.append(f"{path or shape}: dim {dim} (size {shape[dim]}) does not divide "
                              f"{want} over {tuple(axes)}; sharded over {use or 'nothing'}")
        if not use:
            return PartitionSpec()
        entries: list = [None] * len(shape)
        entries[dim] = use[0] if len(use) == 1 else tuple(use)
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def set_input(self, index: int, spec: PartitionSpec) -> None:
        self.input_specs[index] = spec


# ---- the recipes -----------------------------------------------------------------------------


def split_batch(sb: InputLayouts, axes: tuple[str, ...]) -> None:
    """Data parallel: dim 0 of every data input split over (a dividing subset of) ``axes``."""
    g = sb.graph
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        shape = g.values[vid].shape
        if role == DATA and shape:
            sb.set_input(i, sb.dim_spec(shape, 0, axes, g.input_paths[i]))


def shard_parameters(sb: InputLayouts, axes: tuple[str, ...], *, keep: bool = False) -> None:
    """ZeRO-3 layouts: each parameter split over ``axes`` on the dimension most of them divide
    (the largest such).

    With ``keep``, the layouts already set (tensor-parallel splits) stay, and the split over
    ``axes`` goes on a dimension they leave whole (MaxText's FSDP over the data axes of a kernel
    that tensor parallelism splits on its other dimension).
    """
    g = sb.graph
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        if role != PARAMETER:
            continue
        shape = g.values[vid].shape
        if not shape:
            continue
        old = tuple(sb.input_specs[i]) + (None,) * (len(shape) - len(sb.input_specs[i]))
        free = [d for d in range(len(shape)) if not keep or old[d] is None]
        if not free:
            continue
        dim = max(free, key=lambda d: (len(sb.axes_for(shape[d], axes)), shape[d], -d))
        spec = sb.dim_spec(shape, dim, axes, g.input_paths[i])
        if keep and spec:
            entries = list(old)
            entries[dim] = spec[dim]
            while entries and entries[-1] is None:
                entries.pop()
            spec = PartitionSpec(*entries)
        if keep and not spec:
            continue
        sb.set_input(i, spec)


def shard_optimizer_state(sb: InputLayouts, axes: tuple[str, ...]) -> None:
    """The distributed optimizer (ZeRO-1/2, Megatron's ``use_distributed_optimizer``): each
    optimizer-state input laid out as its parameter is, further split over ``axes`` (those of
    them its parameter's layout leaves free) on the dimension most of them divide (the largest
    such). The update then runs on each device's shard: the gradient is reduced onto the shards
    (a reduce-scatter where data parallelism would all-reduce it) and the new parameter gathered
    back. Call after the parameters' layouts are set.
    """
    g = sb.graph
    for opt, param in g.state_pairs():
        shape = g.values[g.inputs[opt]].shape
        if not shape:
            continue
        old = tuple(sb.input_specs[param]) + (None,) * (len(shape) - len(sb.input_specs[param]))
        used = {a for e in old if e is not None for a in ((e,) if isinstance(e, str) else e)}
        left = tuple(a for a in axes if a not in used)
        free = [d for d in range(len(shape)) if old[d] is None]
        if not left or not free:
            continue
        dim = max(free, key=lambda d: (len(sb.axes_for(shape[d], left)), shape[d], -d))
        use = sb.axes_for(shape[dim], left)
        if not use:
            continue
        entries = list(old)
        entries[dim] = use[0] if len(use) == 1 else tuple(use)
        while entries and entries[-1] is None:
            entries.pop()
        sb.state_specs[opt] = PartitionSpec(*entries)
        sb.optimizer_apart = True


# Operators through which a parameter is still the parameter for the walk: the views, and the
# spatial reversal of a convolution kernel in its gradient with respect to the input.
_KERNEL_VIEWS = VIEWS | {P.rev_p}


def tensor_parallel(sb: InputLayouts, model_axes: tuple[str, ...], *,
                    vocab_parallel: bool = True) -> None:
    """Megatron's column/row alternation, found by following the model-sharded dimension.

    Walking the graph in order, the first matmul (or convolution) that uses a parameter decides it:
    if the other operand arrives sharded on a dimension this matmul contracts, the parameter is
    split on the partner dimension (row parallel: partial sums, one all-reduce), and on a batch
    dimension likewise (an expert bank's kernels where the experts arrive split); if it arrives
    unsharded, the parameter is split on a free dimension that divides (the one the model axes
    divide best, the outermost on ties) whose split is closed by a row-parallel matmul before
    anything reduces over it (column parallel: the result stays split until the row matmul's
    all-reduce; see :func:`_column_split_rejection`, which also says why a kernel stays
    replicated: ``sb.notes`` gets one line per such kernel). A parameter met elementwise by a
    split result (a bias after a column matmul) is split the same way. The split dimension is
    followed through elementwise ops, reshapes, transposes, attention's batched matmuls, gathers
    and scatters by the dimension table in :mod:`hulkjax.rules.dims`. Everything else is left to
    the compiler's propagation.

    ``vocab_parallel`` also splits a last projection whose result only reductions complete (the
    LM head's vocabulary, the cross-entropy's sums reduced with small all-reduces, a tied
    embedding then looked up with a masked gather): Megatron-LM's vocab-parallel head, on by
    default; ``False`` keeps such a projection replicated. See :func:`_column_split_rejection`.
    """
    g = sb.graph
    origin = _parameter_views(g)
    decided: dict[int, int | None] = {}
    shard: dict[int, int] = {}

    def divisible(size: int) -> bool:  # by the model axes, or by a subset of them
        return bool(sb.axes_for(size, model_axes))

    def axes_size(size: int) -> int:  # devices a dimension of this size is split over
        n = 1
        for a in sb.axes_for(size, model_axes):
            n *= sb.sizes[a]
        return n

    why: dict[int, str] = {}  # parameter input index -> why a column split was not made

    # _column_split_rejection's answers, kept with the graph: they depend on the value, the
    # dimension, the parameters and their views (``origin``, fixed by the graph once the views
    # are walked below), which sizes the model axes divide (some axis larger than one divides
    # the size: the set of such axis sizes decides) and ``vocab_parallel``. Another layout on
    # the same graph with the same model axis sizes (dp_tp, expert, a stage's megatron) reuses
    # them.
    divides = tuple(sorted({sb.sizes[a] for a in model_axes if sb.sizes[a] > 1}))
    rejections = g.memo.setdefault("column_split_rejections", {})

    def reject(start: int, dim: int) -> str | None:
        key = (start, dim, divides, vocab_parallel)
        if key not in rejections:
            rejections[key] = _column_split_rejection(g, start, dim, origin, divisible,
                                                      vocab_parallel=vocab_parallel)
        return rejections[key]

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
        if node.primitive in _KERNEL_VIEWS and ins and ins[0] in origin:
            continue
        if node.primitive in (P.dot_general_p, P.conv_general_dilated_p):
            _decide_matmul(node, g, origin, decided, sharded_dim, decide, divisible, axes_size,
                           why, reject)
        carried = None
        for k, v in enumerate(ins):
            if v is None:
                continue
            sd = sharded_dim(v)
            if sd is None:
                continue
            r = map_dim_results(node, g, k, sd)
            if isinstance(r, list):
                carried = r
                break
        if not carried:
            continue
        for o, d in carried:
            shard[node.outputs[o]] = d
        out_dim = carried[0][1]
        if node.primitive in (P.dot_general_p, P.conv_general_dilated_p) or len(carried) > 1:
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
        elif i in why:
            sb.notes.append(f"{g.input_paths[i]}: kept replicated, {why[i]}")


def _decide_matmul(node, g, origin, decided, sharded_dim, decide, divisible, axes_size,
                   why, reject) -> None:
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
            # Output features: column parallel, closed like a matmul's (a ViT's patch embedding
            # is followed by LayerNorm, which would reduce over the split features).
            target = rhs_spec[0]
            if target in dims and divisible(pshape[target]):
                reason = reject(node.outputs[0], node.params["dimension_numbers"].out_spec[1])
                if reason is None:
                    decide(i, dims[target])
                else:
                    why[i] = reason
                    decide(i, None)
            return
        if adim == lhs_spec[1]:
            target = rhs_spec[1]  # input features: row
        else:
            return
        if target in dims and divisible(pshape[target]):
            decide(i, dims[target])
        return
    if adim is not None:
        r = map_dim(node, g, a, adim)
        partner = dot_partner(node, a, adim)
        if partner in dims and (r == CONTRACTED or isinstance(r, int)):
            # Contracted: row parallel (partial sums, one all-reduce). Batched: the parameter is
            # split with it (each expert's kernel where the experts arrive split).
            decide(i, dims[partner])
        return
    # Column parallel on a free dimension whose split is closed (see _column_split_rejection):
    # the one the model axes divide best, the outermost on ties (the heads of a (D, heads,
    # head_dim) kernel; the head_dim split would put the split under attention's contraction and
    # is rejected). An expert bank's (experts, D, F) kernel splits F where F divides more axes.
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    contract, batch = (lc, lb) if k == 0 else (rc, rb)
    free = [d for d in range(len(pshape))
            if d not in contract and d not in batch and d in dims and divisible(pshape[d])]
    free.sort(key=lambda d: -axes_size(pshape[d]))
    reasons = []
    for d in free:
        out_dim = map_dim(node, g, k, d)
        if not isinstance(out_dim, int):
            continue
        reason = reject(node.outputs[0], out_dim)
        if reason is None:
            decide(i, dims[d])
            return
        reasons.append(f"dim {dims[d]}: {reason}")  # the parameter's own dimension
    if reasons:
        why[i] = "; ".join(reasons)
    decide(i, None)


# Reductions that complete a split they reduce with one small all-reduce (sum, max, min).
_REDUCING = frozenset((P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p))


def _column_split_rejection(g: OpGraph, start: int, dim: int, origin, divisible, *,
                            vocab_parallel: bool = False) -> str | None:
    """Why a column split of ``dim`` of value ``start`` should not be made, or ``None`` if it is
    closed.

    Follows every use of the split dimension (backward-pass uses included). It is closed

    * by a row-parallel matmul: a use by a matmul (or convolution) with a parameter that contracts
      the dimension, where the path ends; or
    * with ``vocab_parallel``, by reductions, for a projection wider than its input (a
      vocabulary larger than the hidden size) that no forward matmul follows:
      forward sums, maxima and lookups (a gather indexing the split dimension) of it complete
      with one all-reduce of their small result. This is Megatron's vocab-parallel LM head and
      cross-entropy (the log-sum-exp's max and sum and the label logit's lookup over the split
      vocabulary). A path that both reduces the split and reaches a row matmul in the forward
      pass is always rejected: a LayerNorm over the split hidden size between two matmuls (the
      residual stream would stay split and every projection after it be row parallel).

    The cross-entropy's log-sum-exp then stays split: its maximum and its sum over the split
    vocabulary are partial results completed by one small all-reduce each
    (:mod:`hulkjax.rules.dims`), so no device holds the whole logits.

    In the backward pass a sum over the split (the gradient of a replicated operand broadcast
    into it: grouped- and multi-query attention's shared key/value heads, a relative position
    bias) ends its path: partial sums, all-reduced. A use that carries the dimension continues; a
    graph output ends a path neutrally; anything else (a gather, sort or top-k over it, an
    operator without a dimension rule, a reshape into pieces the model axes do not divide: two
    key/value heads of grouped-query attention on 8 devices) rejects the split.
    """
    outputs = set(o for o in g.outputs if o is not None)
    closed = reduced = row_forward = None
    seen = {(start, dim)}
    todo = [(start, dim)]
    while todo:
        v, d = todo.pop()
        for nid, k in g.consumers(v):
            node = g.nodes[nid]
            r = map_dim_results(node, g, k, d)
            matmul = node.primitive in (P.dot_general_p, P.conv_general_dilated_p)
            if r == CONTRACTED and matmul and any(
                    u is not None and u in origin for j, u in enumerate(node.inputs) if j != k):
                closed = closed or node
                if not node.backward:
                    row_forward = row_forward or node
                continue
            reduces = (r == CONTRACTED and not matmul) or (
                node.primitive in _REDUCING and d in tuple(node.params.get("axes", ())))
            if reduces:
                if not node.backward:
                    reduced = reduced or node
                continue
            if not isinstance(r, list):
                return f"{_where(node)} does not keep the split"
            for o, rd in r:
                nxt = (node.outputs[o], rd)
                if not divisible(g.values[nxt[0]].shape[rd]):
                    if node.backward:  # the gradient of a replicated operand (grouped-query
                        continue       # attention's shared key/value heads): reduced there
                    return (f"{_where(node)} gives a dimension of size "
                            f"{g.values[nxt[0]].shape[rd]} that the model axes do not divide")
                # A graph output that is used further (a loop body's residuals) is followed on.
                if nxt not in seen and (nxt[0] not in outputs or g.consumers(nxt[0])):
                    seen.add(nxt)
                    todo.append(nxt)
    if reduced is not None and row_forward is not None:
        return (f"{_where(reduced)} reduces the split before {_where(row_forward)} contracts it "
                f"(a normalization between two matmuls)")
    if reduced is not None and not vocab_parallel:
        return f"{_where(reduced)} reduces the split (a vocab-parallel head, turned off)"
    if reduced is not None:  # a head: only reductions complete its split
        width, inputs = g.values[start].shape[dim], _contracted_size(g, start)
        if inputs is not None and width <= inputs:
            return (f"{_where(reduced)} reduces the split of a head no wider than its input "
                    f"({width} outputs from {inputs}: a vocab-parallel head splits a "
                    f"vocabulary larger than the hidden size)")
    if closed is None and reduced is None:
        return "no matmul or reduction completes the split"
    return None


def _parameter_views(g: OpGraph) -> dict[int, tuple[int, dict[int, int]]]:
    """``{value: (parameter input index, {value dim: parameter dim})}`` for the parameters and
    their views, over the whole step: a later layer's kernel is often cast or transposed right
    before its matmul, after the earlier layer's decision looks for it."""
    origin: dict[int, tuple[int, dict[int, int]]] = {}
    for i, (vid, role) in enumerate(zip(g.inputs, g.input_roles)):
        if role == PARAMETER:
            origin[vid] = (i, {d: d for d in range(len(g.values[vid].shape))})
    for node in g.nodes:
        ins = node.inputs
        if node.primitive in _KERNEL_VIEWS and ins and ins[0] in origin:
            i, dims = origin[ins[0]]
            mapped = {}
            for vd, pd in dims.items():
                r = map_dim(node, g, 0, vd)
                if isinstance(r, int):
                    mapped[r] = pd
            origin[node.outputs[0]] = (i, mapped)
    return origin


def _contracted_size(g: OpGraph, v: int) -> int | None:
    """How many inputs each output of the matmul that makes ``v`` sums (``None``: not a
    matmul's result)."""
    producer = g.values[v].producer
    node = None if producer is None else g.nodes[producer]
    if node is None or node.primitive is not P.dot_general_p:
        return None
    (lc, _), _ = node.params["dimension_numbers"]
    lhs = g.values[node.inputs[0]].shape
    return math.prod(lhs[d] for d in lc)


def _where(node) -> str:
    return f"{node.name} ({node.source})"
