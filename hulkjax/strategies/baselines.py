"""Baseline planners: what people write by hand today.

* ``replicate``: every device holds and computes everything.
* ``dp``: the batch split over every device; parameters and optimizer state replicated.
* ``zero``: the distributed optimizer (ZeRO-1/2): the batch split over every device, parameters
  replicated, optimizer state sharded over every device (not among :data:`BASELINES`: its
  optimizer state has layouts of its own, which only planners with ``optimizer_apart`` search).
* ``fsdp``: ZeRO-3: parameters, gradients and optimizer state sharded over every device, gathered
  right before each use; the batch split.
* ``megatron``: tensor parallelism over every device: column/row pairs found from the graph.
* ``dp_tp``: data parallel on the expensive mesh axes, megatron on the cheapest one.
* ``expert``: the public recipes' layout (MaxText on GPU clusters, Megatron/NeMo): FSDP over the
  axes that cross nodes, Megatron tensor parallelism with sequence parallelism over the axes
  inside a node.

All decisions come from the graph (roles from the data flow, dimensions from dimension numbers),
never from parameter names. Each returns a :class:`~hulkjax.strategies.plan.Plan`.
"""

from __future__ import annotations

import logging

from hulkjax.errors import StrategyNotApplicableError
from hulkjax.plan.records import Plan
from hulkjax.strategies.layouts import (
    shard_optimizer_state,
    shard_parameters,
    split_batch,
    tensor_parallel,
)
from hulkjax.strategies.realize import cost_model
from hulkjax.strategies.registry import register_strategy, strategies
from hulkjax.strategies.specbuilder import SpecBuilder, complete
from hulkjax.trace.graph import PARAMETER, OpGraph

log = logging.getLogger("hulkjax.strategies")

BASELINES = ("replicate", "dp", "fsdp", "megatron", "dp_tp", "expert")
"""The hand-written layouts, in the order tables show them. The ILP and ``auto`` include their
assignments in every search, so neither is ever worse than a baseline."""


@register_strategy("replicate")
def replicate(graph: OpGraph, topology) -> Plan:
    """Everything replicated: the single-device program on every device."""
    return replicate_layouts(graph, topology).build()


def replicate_layouts(graph: OpGraph, topology) -> SpecBuilder:
    return SpecBuilder(graph, topology, "replicate")


@register_strategy("dp")
def data_parallel(graph: OpGraph, topology) -> Plan:
    """Batch (dim 0 of every data input) split over all mesh axes; state replicated."""
    return dp_layouts(graph, topology).build()


def dp_layouts(graph: OpGraph, topology) -> SpecBuilder:
    sb = SpecBuilder(graph, topology, "dp")
    split_batch(sb, tuple(topology.axis_names))
    return sb


@register_strategy("fsdp")
def fully_sharded(graph: OpGraph, topology) -> Plan:
    """ZeRO-3: state sharded over all devices, all-gathered before each use; batch split."""
    return fsdp_layouts(graph, topology).build()


def fsdp_layouts(graph: OpGraph, topology) -> SpecBuilder:
    sb = SpecBuilder(graph, topology, "fsdp")
    axes = tuple(topology.axis_names)
    split_batch(sb, axes)
    shard_parameters(sb, axes)
    sb.param_use = "gather"
    return sb


@register_strategy("megatron")
def megatron(graph: OpGraph, topology) -> Plan:
    """Tensor parallelism over all mesh axes: column/row pairs (MLPs, attention heads)."""
    return megatron_layouts(graph, topology).build()


def megatron_layouts(graph: OpGraph, topology) -> SpecBuilder:
    sb = SpecBuilder(graph, topology, "megatron")
    tensor_parallel(sb, tuple(topology.axis_names))
    return sb


@register_strategy("dp_tp")
def datatensor_parallel(graph: OpGraph, topology) -> Plan:
    """2-D: tensor parallel on the cheapest mesh axis, data parallel on the others."""
    return dp_tp_layouts(graph, topology).build()


def dp_tp_layouts(graph: OpGraph, topology) -> SpecBuilder:
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
    split_batch(sb, data)
    tensor_parallel(sb, (model,))
    return sb


def recipe_axes(topology) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(fsdp axes, tensor-parallel axes)`` of the expert recipe on ``topology``.

    The axes whose groups stay inside a node (NVLink) carry tensor parallelism and the axes that
    cross nodes (InfiniBand, data-centre network) carry FSDP, as in MaxText's and NeMo's multi-node
    GPU recipes. Where every axis lies at one level (a ``Topology.grid``, a TPU slice), the
    fastest axis carries tensor parallelism if it is strictly faster than every other axis;
    otherwise (one axis, or axes alike, as in MaxText's TPU recipes) FSDP spans every axis.

    >>> import hulkjax as hj
    >>> recipe_axes(hj.Topology.preset("dgx-h100", nodes=2))
    (('node',), ('gpu',))
    >>> recipe_axes(hj.Topology.grid((8,), ("d",)))
    (('d',), ())
    """
    axes = tuple(topology.axis_names)
    inside = tuple(a for a in axes if topology.axis_scope(a) == "node")
    across = tuple(a for a in axes if a not in inside)
    if inside and across:
        return across, inside
    if len(axes) < 2:
        return axes, ()
    key = lambda a: (topology.axis_bandwidth(a), -topology.axis_latency(a))  # noqa: E731
    model = max(reversed(axes), key=key)
    rest = tuple(a for a in axes if a != model)
    if all(key(model) > key(a) for a in rest):
        return rest, (model,)
    return axes, ()


@register_strategy("expert")
def expert(graph: OpGraph, topology) -> Plan:
    """The public recipes' layout: FSDP over the axes between nodes, Megatron inside a node.

    MaxText's GPU recipes and NeMo's LLaMA recipes shard parameters, gradients and optimizer
    state over the data-centre axes (gathered over those axes right before each use, the batch
    split over them) and split the MLP and attention projections column-then-row over the NVLink
    axes inside a node (:func:`recipe_axes` says which axes are which). Column/row pairs come from
    the graph (:func:`~hulkjax.strategies.layouts.tensor_parallel`); a model without any (a CNN)
    gets FSDP over every axis, as does a topology whose axes are all alike. With tensor
    parallelism, the recipes' sequence parallelism (Megatron's; NeMo's ``sequence_parallel``):
    the tensor-parallel sums are reduce-scattered onto the sequence and the residual stream
    between them (its adds and norms) is split along it
    (:func:`~hulkjax.strategies.search.sequence_parallel`).
    """
    return expert_layouts(graph, topology).build()


def expert_layouts(graph: OpGraph, topology) -> SpecBuilder:
    fsdp, tp = recipe_axes(topology)
    sb = SpecBuilder(graph, topology, "expert")
    if tp:
        tensor_parallel(sb, tp)
        params = [i for i, r in enumerate(graph.input_roles) if r == PARAMETER]
        if not any(tuple(sb.input_specs[i]) for i in params):
            sb.notes.append(f"no column/row matmul pairs divide {tp}: FSDP over every axis")
            fsdp, tp = tuple(topology.axis_names), ()
    sb.notes.append(f"FSDP over {fsdp}" + (f", tensor parallel over {tp}" if tp else ""))
    split_batch(sb, fsdp)
    shard_parameters(sb, fsdp, keep=True)
    sb.param_use = "gather"
    sb.gather_axes = fsdp
    sb.sequence_axes = tp
    return sb


@register_strategy("zero")
def zero(graph: OpGraph, topology) -> Plan:
    """The distributed optimizer (ZeRO-1/2): batch split over all mesh axes, parameters
    replicated, optimizer state sharded over all of them; the update runs on each device's
    shard and the parameters are gathered back after it."""
    return zero_layouts(graph, topology).build()


def zero_layouts(graph: OpGraph, topology) -> SpecBuilder:
    sb = SpecBuilder(graph, topology, "zero")
    axes = tuple(topology.axis_names)
    split_batch(sb, axes)
    shard_optimizer_state(sb, axes)
    if not graph.owners:
        sb.notes.append("the step has no optimizer state (no argument updated alongside a "
                        "parameter): data parallel")
    elif not sb.state_specs:
        sb.notes.append("no optimizer state divides over the mesh: data parallel")
    return sb


LAYOUTS = {"replicate": replicate_layouts, "dp": dp_layouts, "fsdp": fsdp_layouts,
           "megatron": megatron_layouts, "dp_tp": dp_tp_layouts, "expert": expert_layouts,
           "zero": zero_layouts}
"""``{baseline: (graph, topology) -> SpecBuilder}``: each baseline's input layouts, before they
are completed (:meth:`SpecBuilder.assignment`) or built into a plan (:meth:`SpecBuilder.build`)."""


def baseline_assignments(graph: OpGraph, topology, names: tuple[str, ...] = BASELINES, *,
                         optimizer_apart: bool = False) -> dict[str, list[int]]:
    """``{baseline name: its cost-model assignment}`` for every baseline (of ``names``) that
    applies to the topology (``dp_tp`` needs two mesh axes): the seeds of the ILP and of ``auto``.

    The assignments are completed from the baselines' layouts, without building their plans (the
    plan's layouts, loop bodies and cost): the same assignment as ``plan.assignment`` of the
    registered strategy, at a fraction of the time (``tests/strategies/test_baselines.py``).

    With ``optimizer_apart``, the assignments are of the cost model with optimizer state apart
    (each baseline's state then laid out as it lays it out), and ``zero`` is among them."""
    out = {}
    if optimizer_apart and "zero" not in names:
        names = (*names, "zero")
    for name in names:
        try:
            layouts = LAYOUTS.get(name)
            if layouts is None or strategies[name].fn is not _BUILT_IN[name]:
                plan = strategies[name].fn(graph, topology)
                if plan.optimizer_apart != optimizer_apart:
                    # (a strategy of the user's: its layouts, completed in the other model)
                    cm = cost_model(graph, topology, optimizer_apart=optimizer_apart)
                    out[name] = complete(cm, [t.spec for t in plan.inputs])
                else:
                    out[name] = plan.assignment
            elif optimizer_apart:
                sb = layouts(graph, topology)
                sb.optimizer_apart = True
                out[name] = sb.assignment()
            else:
                out[name] = layouts(graph, topology).assignment()
        except StrategyNotApplicableError as e:
            log.debug("baseline %s does not apply: %s", name, e)
            continue
    return out


_BUILT_IN = {"replicate": replicate, "dp": data_parallel, "fsdp": fully_sharded,
             "megatron": megatron, "dp_tp": datatensor_parallel, "expert": expert,
             "zero": zero}
