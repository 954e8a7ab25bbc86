"""From an assignment (one candidate per cost-model group) to a :class:`~hulkjax.plan.Plan`.

Every planner ends here, so every plan is judged by the same cost model and emitted the same way:
arguments and results at their planned layouts, each leader operator's operands and results
constrained to the candidate chosen for it (followers are left to the partitioner, which
propagates the same layouts the cost model derived; pooling results are pinned too, or the
partitioner moves a later gather in front of the pooling, onto the bigger tensor:
:meth:`CostModel.pinned_layouts`), and the layouts inside loop bodies.

>>> import jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)))
>>> cm = cost_model(g, hj.Topology.grid((8,), ("d",)))
>>> [t.spec for t in plan_from_assignment(cm, cm.replicated_assignment(), "mine").inputs]
[P(), P()]
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

from hulkjax.cost.model import INPUT, CostModel
from hulkjax.plan.records import Plan, TensorPlan, memory_kind
from hulkjax.plan.specs import from_pspec, to_pspec
from hulkjax.strategies.loops import body_plans
from hulkjax.strategies.loops import cost_model as cost_model

__all__ = ["assignment_for_inputs", "cost_model", "plan_cost_model", "plan_from_assignment",
           "state_apart"]


def state_apart(graph, input_specs) -> bool:
    """Whether some optimizer state's layout in ``input_specs`` (one per argument) differs from
    its parameter's (``graph.owners``): a distributed optimizer's layouts, which only a cost
    model with ``optimizer_apart`` can hold."""
    for o, p in graph.state_pairs():
        rank = len(graph.values[graph.inputs[p]].shape)
        if from_pspec(input_specs[o], rank) != from_pspec(input_specs[p], rank):
            return True
    return False


def plan_cost_model(graph, topology, plan: Plan) -> CostModel:
    """The cost model that judges ``plan`` (an SPMD plan) on ``graph``: with optimizer state
    apart where the plan was made so (:attr:`Plan.optimizer_apart`) or lays it out so (a plan
    written or loaded by hand)."""
    apart = plan.optimizer_apart or state_apart(graph, [t.spec for t in plan.inputs])
    return cost_model(graph, topology, optimizer_apart=apart)


def assignment_for_inputs(cm: CostModel, input_specs: list[PartitionSpec]) -> dict[int, int]:
    """``{input group: candidate}`` matching the given input layouts."""
    g = cm.graph
    fixed: dict[int, int] = {}
    for grp in cm.groups:
        if grp.kind != INPUT:
            continue
        i = grp.inputs[0]
        spec = from_pspec(input_specs[i], len(g.values[g.inputs[i]].shape))
        fixed[grp.id] = cm.input_candidate(grp.id, spec)
    return fixed


def plan_from_assignment(cm: CostModel, assignment: list[int], strategy: str, notes=(), *,
                         source: str = "", solver=None) -> Plan:
    """The plan (layouts, constraints, loop-body layouts, cost) of an assignment."""
    g = cm.graph
    specs = cm.value_specs(assignment)
    in_specs = [to_pspec(specs[v]) if v in specs else PartitionSpec() for v in g.inputs]
    inputs = tuple(
        TensorPlan(path=p, shape=g.values[v].shape, dtype=g.values[v].dtype, role=r, spec=s,
                   memory_kind=memory_kind(g.values[v]))
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
                                  role="output", spec=spec, memory_kind=memory_kind(g.values[v])))
    operands, results = cm.pinned_layouts(assignment)
    operand_specs, result_specs = (
        {key: to_pspec(s) for key, s in table.items()} for table in (operands, results))
    operand_paths = {key: tuple(to_pspec(s) for s in via)
                     for key, via in cm.pinned_paths(assignment, operands).items()}
    plan = Plan(strategy=strategy, axis_names=tuple(cm.mesh.axis_names),
                mesh_shape=tuple(cm.mesh.shape), inputs=inputs, outputs=tuple(outputs),
                operand_specs=operand_specs, result_specs=result_specs,
                operand_paths=operand_paths, notes=list(dict.fromkeys(notes)),
                bodies=body_plans(cm, assignment),
                source=source, solver=solver, cost=cm.evaluate(assignment),
                assignment=list(assignment), optimizer_apart=cm.optimizer_apart)
    return plan
