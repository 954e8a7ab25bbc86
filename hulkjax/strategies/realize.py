"""From an assignment (one candidate per cost-model group) to a :class:`Plan`.

Every planner ends here, so every plan is judged by the same :class:`~hulkjax.cost.CostModel` and
emitted the same way: arguments and results at their planned layouts, and each leader operator's
operands and results constrained to the candidate chosen for it (followers are left to the
partitioner, which propagates the same layouts the cost model derived; pooling results are
pinned too, or the partitioner moves a later gather in front of the pooling, onto the bigger
tensor: :meth:`CostModel.leader_layouts`).
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from hulkjax.cost.model import CostModel
from hulkjax.rules.specs import from_pspec, to_pspec
from hulkjax.strategies.plan import Plan, TensorPlan
from hulkjax.trace.graph import OpGraph


def cost_model(graph: OpGraph, topology) -> CostModel:
    """The cost model of (graph, topology), built once and kept on the graph."""
    cache = graph.__dict__.setdefault("_cost_models", {})
    cm = cache.get(topology)
    if cm is None:
        cm = cache[topology] = CostModel(graph, topology)
    return cm


def assignment_for_inputs(cm: CostModel, input_specs: list[PartitionSpec]) -> dict[int, int]:
    """Fix each input group to the candidate matching the given input layouts."""
    g = cm.graph
    fixed: dict[int, int] = {}
    for grp in cm.groups:
        if grp.kind != "input":
            continue
        i = grp.inputs[0]
        spec = from_pspec(input_specs[i], len(g.values[g.inputs[i]].shape))
        fixed[grp.id] = cm.input_candidate(grp.id, spec)
    return fixed


def plan_from_assignment(cm: CostModel, assignment: list[int], strategy: str,
                         notes=()) -> Plan:
    """The plan (layouts, constraints, cost) of an assignment."""
    g = cm.graph
    specs = cm.value_specs(assignment)
    in_specs = [to_pspec(specs[v]) if v in specs else PartitionSpec() for v in g.inputs]
    inputs = tuple(
        TensorPlan(path=p, shape=g.values[v].shape, dtype=g.values[v].dtype, role=r, spec=s)
        for p, v, r, s in zip(g.input_paths, g.inputs, g.input_roles, in_specs))
    carried_from = {o: i for i, o in g.carried.items()}
    outputs = []
    for k, (p, v) in enumerate(zip(g.output_paths, g.outputs)):
        if v is None:
            outputs.append(TensorPlan(path=p, shape=(), dtype="float32", role="output",
                                      spec=PartitionSpec()))
            continue
        spec = in_specs[carried_from[k]] if k in carried_from else to_pspec(specs.get(v, ()))
        outputs.append(TensorPlan(path=p, shape=g.values[v].shape, dtype=g.values[v].dtype,
                                  role="output", spec=spec))
    operand_specs, result_specs = (
        {key: to_pspec(s) for key, s in specs.items()} for specs in cm.leader_layouts(assignment))
    plan = Plan(strategy=strategy, axis_names=tuple(cm.mesh.axis_names),
                mesh_shape=tuple(cm.mesh.shape), inputs=inputs, outputs=tuple(outputs),
                operand_specs=operand_specs, result_specs=result_specs,
                notes=list(dict.fromkeys(notes)))
    plan.cost = cm.evaluate(assignment)
    plan.assignment = list(assignment)
    return plan
