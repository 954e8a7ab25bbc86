"""A sharding plan: what every planner returns and what the emitter consumes.

>>> import hulkjax as hj, jax.numpy as jnp
>>> topo = hj.Topology.grid((8,), ("d",))
>>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)),
...                topology=topo, strategy="dp")
>>> plan.in_specs
(PartitionSpec(), PartitionSpec('d',))
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import PartitionSpec

from hulkjax.errors import InvalidPlanError

PLAN_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class TensorPlan:
    """How one argument or result leaf is laid out.

    Attributes:
      path: pytree path, e.g. ``"state/params/Dense_0/kernel"``.  # str
      shape: logical shape.  # tuple of int
      dtype: numpy dtype name.  # str
      role: ``"parameter" | "optimizer" | "data" | "output"``.  # str
      spec: the ``PartitionSpec`` over the plan's mesh axes.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    spec: PartitionSpec


@dataclass(kw_only=True, eq=False)
class BodyPlan:
    """The layouts planned inside one body of a ``scan`` / ``while`` / ``cond`` node.

    Node ids are the body graph's own (``node.subgraphs[i]``), in its inlined depth-first walk.

    Attributes:
      inputs: ``{body input index: spec}``: the boundary; the emitter constrains the body's
        arguments to it on entry.
      outputs: ``{body result index: spec}``: a loop's carry results are constrained to the
        carry-in layout (and a ``cond``'s results to one layout for all branches) on exit.
      operand_specs / result_specs: as :class:`Plan`'s, for the body's leaders.
      bodies: ``{node id: (BodyPlan per sub-graph, ...)}`` for loops nested in this body.
    """

    inputs: dict[int, PartitionSpec] = field(default_factory=dict)
    outputs: dict[int, PartitionSpec] = field(default_factory=dict)
    operand_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    result_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    bodies: dict[int, tuple[BodyPlan, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "inputs": [[j, spec_to_json(s)] for j, s in sorted(self.inputs.items())],
            "outputs": [[j, spec_to_json(s)] for j, s in sorted(self.outputs.items())],
            "operand_specs": [[n, k, spec_to_json(s)] for (n, k), s in sorted(self.operand_specs.items())],
            "result_specs": [[n, k, spec_to_json(s)] for (n, k), s in sorted(self.result_specs.items())],
            "bodies": bodies_to_json(self.bodies),
        }

    @classmethod
    def from_dict(cls, d: dict) -> BodyPlan:
        return cls(
            inputs={int(j): spec_from_json(s) for j, s in d["inputs"]},
            outputs={int(j): spec_from_json(s) for j, s in d["outputs"]},
            operand_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["operand_specs"]},
            result_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["result_specs"]},
            bodies=bodies_from_json(d.get("bodies", [])),
        )


def bodies_to_json(bodies: dict[int, tuple[BodyPlan, ...]]) -> list:
    return [[nid, [b.to_dict() for b in plans]] for nid, plans in sorted(bodies.items())]


def bodies_from_json(entries) -> dict[int, tuple[BodyPlan, ...]]:
    if not isinstance(entries, list):
        raise InvalidPlanError(f"loop bodies are stored as a list, got {type(entries).__name__}")
    return {int(nid): tuple(BodyPlan.from_dict(b) for b in plans) for nid, plans in entries}


@dataclass(kw_only=True, eq=False)
class Plan:
    """A sharding plan for one traced step on one topology.

    Attributes:
      strategy: the planner's name (``"dp"``, ``"ilp"``, ...).  # str
      axis_names / mesh_shape: the mesh the specs refer to.  # tuple of str / tuple of int
      inputs / outputs: one :class:`TensorPlan` per flattened argument / result leaf.
      operand_specs: ``{(node id, operand index): spec}``: the layout an operator needs for an
        operand; the emitter constrains the operand to it right before the operator.
      result_specs: ``{(node id, result index): spec}``: layouts of planned intermediate values;
        the emitter constrains the result right after the operator.
      graph_fingerprint / topology_fingerprint: what the plan was made for (checked by ``emit``).
      topology: the topology (a ``hulkjax.Topology``), so a loaded plan can be emitted.
      cost: the cost model's verdict (``hulkjax.Cost``) when a planner computed one.
      stages: ``None`` for SPMD plans; ``[(device group, node ids), ...]`` for staged plans.
      planning_time: seconds spent planning (tracing excluded).  # float
      notes: what the planner wants a person to know (fallbacks, unsharded dims).  # list of str
      loop_bodies: ``{loop node id: (BodyPlan per sub-graph, ...)}``: layouts inside the bodies of
        ``scan`` / ``while`` / ``cond`` nodes; ``None`` until derived from the assignment (read it
        as :attr:`bodies`).
      in_tree / out_tree: pytree structures of the step's arguments / results. Not saved (pickled
        structures would run code on load): a loaded plan keys ``in_specs`` by path until
        ``emit`` binds it to real arguments.
    """

    strategy: str
    axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    operand_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    result_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    graph_fingerprint: str = ""
    topology_fingerprint: str = ""
    topology: Any = None
    cost: Any = None
    stages: Any = None
    planning_time: float = 0.0
    notes: list[str] = field(default_factory=list)
    loop_bodies: dict[int, tuple[BodyPlan, ...]] | None = None
    in_tree: Any = None
    out_tree: Any = None
    graph: Any = field(default=None, repr=False)  # the OpGraph it was made on (not saved)
    assignment: Any = field(default=None, repr=False)  # cost-model candidate per group (not saved)

    @property
    def bodies(self) -> dict[int, tuple[BodyPlan, ...]]:
        """Layouts inside loop bodies, ``{loop node id: (BodyPlan per sub-graph, ...)}``.

        Derived on first use from the assignment on the graph the plan was made on (the cost
        model's loop candidates); loaded plans carry them.
        """
        if self.loop_bodies is None:
            self.loop_bodies = {}
            g, topo, a = self.graph, self.topology, self.assignment
            if g is not None and topo is not None and a is not None and any(
                    n.subgraphs for n in g.nodes):
                from hulkjax.rules.loops import body_plans
                from hulkjax.strategies.realize import cost_model

                self.loop_bodies = body_plans(cost_model(g, topo), a)
        return self.loop_bodies

    # ---- pytree views ---------------------------------------------------------------------
    @property
    def in_specs(self):
        """Pytree of ``PartitionSpec`` mirroring the step's arguments (a tuple of args)."""
        specs = [t.spec for t in self.inputs]
        if self.in_tree is None:
            return {t.path: t.spec for t in self.inputs}
        return jax.tree_util.tree_unflatten(self.in_tree, specs)

    @property
    def out_specs(self):
        """Pytree of ``PartitionSpec`` mirroring the step's result."""
        specs = [t.spec for t in self.outputs]
        if self.out_tree is None:
            return {t.path: t.spec for t in self.outputs}
        return jax.tree_util.tree_unflatten(self.out_tree, specs)

    def spec(self, path: str) -> PartitionSpec:
        """The spec of the argument or result leaf with this path."""
        for t in self.inputs + self.outputs:
            if t.path == path:
                return t.spec
        raise KeyError(f"no leaf {path!r} in plan; arguments start {[t.path for t in self.inputs[:5]]}")

    def summary(self, *, max_rows: int = 40) -> str:
        """A plain-text table: how each argument leaf is laid out, and the planned intermediates."""
        from hulkjax.strategies.explain import plan_summary

        return plan_summary(self, max_rows=max_rows)

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A JSON-serializable dict (``Plan.from_dict`` inverts it exactly)."""
        return {
            "format": PLAN_FORMAT,
            "strategy": self.strategy,
            "axis_names": list(self.axis_names),
            "mesh_shape": list(self.mesh_shape),
            "inputs": [_tensor_to_json(t) for t in self.inputs],
            "outputs": [_tensor_to_json(t) for t in self.outputs],
            "operand_specs": [[n, k, spec_to_json(s)] for (n, k), s in sorted(self.operand_specs.items())],
            "result_specs": [[n, k, spec_to_json(s)] for (n, k), s in sorted(self.result_specs.items())],
            "graph_fingerprint": self.graph_fingerprint,
            "topology_fingerprint": self.topology_fingerprint,
            "topology": None if self.topology is None else self.topology.to_dict(),
            "cost": None if self.cost is None else self.cost.to_dict(),
            "stages": self.stages,
            "planning_time": self.planning_time,
            "notes": list(self.notes),
            "bodies": bodies_to_json(self.bodies),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """Inverse of :meth:`to_dict`; raises :class:`InvalidPlanError` on a malformed dict."""
        try:
            if d.get("format") != PLAN_FORMAT:
                raise InvalidPlanError(f"plan format {d.get('format')!r} is not supported "
                                       f"(this hulkjax reads format {PLAN_FORMAT}); re-plan.")
            topo = None
            if d.get("topology") is not None:
                from hulkjax.topology import Topology

                topo = Topology.from_dict(d["topology"])
            cost = None
            if d.get("cost") is not None:
                from hulkjax.cost import Cost

                cost = Cost.from_dict(d["cost"])
            return cls(
                strategy=d["strategy"],
                axis_names=tuple(d["axis_names"]),
                mesh_shape=tuple(int(x) for x in d["mesh_shape"]),
                inputs=tuple(_tensor_from_json(t) for t in d["inputs"]),
                outputs=tuple(_tensor_from_json(t) for t in d["outputs"]),
                operand_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["operand_specs"]},
                result_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["result_specs"]},
                graph_fingerprint=d["graph_fingerprint"],
                topology_fingerprint=d["topology_fingerprint"],
                topology=topo,
                cost=cost,
                stages=d.get("stages"),
                planning_time=float(d.get("planning_time", 0.0)),
                notes=list(d.get("notes", [])),
                loop_bodies=bodies_from_json(d.get("bodies", [])),
            )
        except InvalidPlanError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidPlanError(f"malformed plan: {type(e).__name__}: {e}. Plans are written by "
                                   f"Plan.save; re-create it with hj.plan(...).save(path).") from e

    def save(self, path) -> None:
        """Write the plan as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> Plan:
        """Read a plan written by :meth:`save`."""
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise InvalidPlanError(f"{path}: not a plan JSON file ({e}).") from e
        return cls.from_dict(d)


def spec_to_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_from_json(entries) -> PartitionSpec:
    if not isinstance(entries, list):
        raise InvalidPlanError(f"a PartitionSpec is stored as a list, got {entries!r}")
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


def _tensor_to_json(t: TensorPlan) -> dict:
    return {"path": t.path, "shape": list(t.shape), "dtype": t.dtype, "role": t.role,
            "spec": spec_to_json(t.spec)}


def _tensor_from_json(d: dict) -> TensorPlan:
    return TensorPlan(path=d["path"], shape=tuple(int(x) for x in d["shape"]), dtype=d["dtype"],
                      role=d["role"], spec=spec_from_json(d["spec"]))
