"""A sharding plan: what every planner returns and what the emitter consumes.

>>> import hulkjax as hj, jax.numpy as jnp
>>> topo = hj.Topology.grid((8,), ("d",))
>>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)),
...                topology=topo, strategy="dp")
>>> plan.in_specs
(P(), P('d',))
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import PartitionSpec

from hulkjax.errors import InvalidPlanError
from hulkjax.formatting import format_bytes, format_spec, format_time
from hulkjax.plan.cost import Cost
from hulkjax.plan.specs import paths_from_json, paths_to_json, spec_from_json, spec_to_json
from hulkjax.plan.stages import SCHEDULES, Stage, check_virtual_stages
from hulkjax.topology import Topology
from hulkjax.trace.graph import dtype_size

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
      memory_kind: where the leaf lives: ``"device"``, or ``"pinned_host"`` for one the step
        keeps in host memory (its traced value's memory space is ``Host``: state offloaded
        between steps); the emitted program's sharding keeps it there.  # str
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    spec: PartitionSpec
    memory_kind: str = "device"


@dataclass(kw_only=True, eq=False)
class BodyPlan:
    """The layouts planned inside one body of a ``scan`` / ``while`` / ``cond`` node.

    Node ids are the body graph's own (``node.subgraphs[i]``), in its inlined depth-first walk.

    Attributes:
      inputs: ``{body input index: spec}``: the boundary; the emitter constrains the body's
        arguments to it on entry.
      outputs: ``{body result index: spec}``: a loop's carry results are constrained to the
        carry-in layout (and a ``cond``'s results to one layout for all branches) on exit.
      operand_specs / result_specs / operand_paths: as :class:`Plan`'s, for the body's
        operators.
      bodies: ``{node id: (BodyPlan per sub-graph, ...)}`` for loops nested in this body.
    """

    inputs: dict[int, PartitionSpec] = field(default_factory=dict)
    outputs: dict[int, PartitionSpec] = field(default_factory=dict)
    operand_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    result_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    bodies: dict[int, tuple[BodyPlan, ...]] = field(default_factory=dict)
    operand_paths: dict[tuple[int, int], tuple[PartitionSpec, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "inputs": [[j, spec_to_json(s)] for j, s in sorted(self.inputs.items())],
            "outputs": [[j, spec_to_json(s)] for j, s in sorted(self.outputs.items())],
            "operand_specs": [[n, k, spec_to_json(s)] for (n, k), s in sorted(self.operand_specs.items())],
            "result_specs": [[n, k, spec_to_json(s)] for (n, k), s in sorted(self.result_specs.items())],
            "bodies": bodies_to_json(self.bodies),
            "operand_paths": paths_to_json(self.operand_paths),
        }

    @classmethod
    def from_dict(cls, d: dict) -> BodyPlan:
        return cls(
            inputs={int(j): spec_from_json(s) for j, s in d["inputs"]},
            outputs={int(j): spec_from_json(s) for j, s in d["outputs"]},
            operand_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["operand_specs"]},
            result_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["result_specs"]},
            bodies=bodies_from_json(d.get("bodies", [])),
            operand_paths=paths_from_json(d.get("operand_paths", [])),
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
      operand_paths: ``{(node id, operand index): (spec, ...)}``: layouts an operand passes
        through on its way to its ``operand_specs`` layout, where the cost model makes the
        layout change in steps that XLA's partitioner makes more cheaply than its own change
        (``CostModel.reshard_via``); the emitter constrains the operand to each in turn.
      graph_fingerprint / topology_fingerprint: what the plan was made for (checked by ``emit``).
      topology: the topology (a ``hulkjax.Topology``), so a loaded plan can be emitted.
      cost: the cost model's verdict (``hulkjax.Cost``) when a planner computed one.
      stages: ``None`` for SPMD plans; for staged (pipeline) plans a tuple of
        :class:`~hulkjax.plan.Stage`: which devices run which nodes, on which sub-mesh, with which
        layouts. Then ``inputs[i].spec`` is the layout on the stage holding the leaf,
        ``axis_names`` / ``mesh_shape`` are the whole topology's mesh, and ``operand_specs`` /
        ``result_specs`` are empty (each stage has its own).
      microbatches: microbatches per step (1 for SPMD plans).  # int
      schedule: ``"1f1b"``, ``"gpipe"`` or ``"interleaved"`` for staged plans, ``None`` for SPMD
        plans.  # str | None
      virtual_stages: chunks of layers per device group (``v``; 1 unless ``schedule`` is
        ``"interleaved"``). Then ``stages`` holds ``groups x v`` stages in pipeline order and
        stage ``j`` runs on the devices of stage ``j % groups``
        (:func:`~hulkjax.plan.stages.check_virtual_stages`).  # int
      optimizer_apart: whether the plan lays optimizer state out apart from its parameter (the
        distributed optimizer: ``strategy="zero"``, or ``ilp`` / ``auto`` with
        ``optimizer_apart=True``); its cost model is then made so too
        (:class:`~hulkjax.cost.CostModel`).  # bool
      planning_time: seconds spent planning (tracing excluded).  # float
      notes: what the planner wants a person to know (fallbacks, unsharded dims).  # list of str
      bodies: ``{loop node id: (BodyPlan per sub-graph, ...)}``: layouts inside the bodies of
        ``scan`` / ``while`` / ``cond`` nodes, filled in by the planner (saved with the plan).
      source: which of a search's candidates the planner returned (``auto``: ``"shortlist
        optimum"``, a baseline's name, ...); ``""`` when there was no choice.  # str
      solver: the solver's report (``ilp``: an ``ILPResult`` with status, objective, bound and
        gap); ``None`` for planners without a solver. Not saved.
      in_tree / out_tree: pytree structures of the step's arguments / results. Not saved (pickled
        structures would run code on load): a loaded plan keys ``in_specs`` by path until
        ``emit`` binds it to real arguments.
      graph: the :class:`~hulkjax.trace.OpGraph` the plan was made on. Not saved.
      assignment: the cost model's candidate per group (what :mod:`hulkjax.explain` and
        ``hj.estimate`` read back); for staged plans one such list per stage, on the cost model
        of the step at microbatch size on the stage's devices. Not saved.
    """

    strategy: str
    axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    operand_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    result_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict)
    operand_paths: dict[tuple[int, int], tuple[PartitionSpec, ...]] = field(default_factory=dict)
    graph_fingerprint: str = ""
    topology_fingerprint: str = ""
    topology: Any = None
    cost: Any = None
    stages: tuple[Stage, ...] | None = None
    microbatches: int = 1
    schedule: str | None = None
    virtual_stages: int = 1
    optimizer_apart: bool = False
    planning_time: float = 0.0
    notes: list[str] = field(default_factory=list)
    bodies: dict[int, tuple[BodyPlan, ...]] = field(default_factory=dict)
    source: str = ""
    solver: Any = field(default=None, repr=False)
    in_tree: Any = None
    out_tree: Any = None
    graph: Any = field(default=None, repr=False)  # the OpGraph it was made on (not saved)
    assignment: Any = field(default=None, repr=False)  # cost-model candidate per group (not saved)

    def __post_init__(self):
        if self.stages is not None:
            self.stages = tuple(self.stages)
            if not self.stages or not all(isinstance(st, Stage) for st in self.stages):
                raise InvalidPlanError(f"Plan.stages must be None (SPMD) or a non-empty tuple of "
                                       f"hulkjax.plan.Stage, got {self.stages!r}")
            if self.schedule not in SCHEDULES:
                raise InvalidPlanError(f"a staged plan's schedule must be one of {SCHEDULES}, "
                                       f"got {self.schedule!r}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise InvalidPlanError(f"Plan.microbatches must be an int >= 1, got "
                                   f"{self.microbatches!r}")
        if self.stages is not None:
            check_virtual_stages(self.stages, self.schedule, self.virtual_stages,
                                 self.microbatches)
        elif self.virtual_stages != 1:
            raise InvalidPlanError(f"an SPMD plan has no virtual stages, got "
                                   f"virtual_stages={self.virtual_stages!r}.")

    @property
    def staged(self) -> bool:
        """Whether the plan runs the step as pipeline stages (``stages`` is not ``None``)."""
        return self.stages is not None

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
        """Plain text: the per-layer explanation (when :mod:`hulkjax.explain` is loaded, as
        ``import hulkjax`` does), then the arguments grouped by role and layout, the predicted cost
        and collectives, and the notes."""
        lines = [f"Plan {self.strategy!r} on mesh ({_mesh_text(self)}), planned in "
                 f"{self.planning_time:.2f} s"]
        for section in summary_sections:
            lines += section(self, max_rows)
        lines += record_summary(self, max_rows=max_rows)
        return "\n".join(lines)

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
            "stages": None if self.stages is None else [st.to_dict() for st in self.stages],
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "virtual_stages": self.virtual_stages,
            "planning_time": self.planning_time,
            "notes": list(self.notes),
            "bodies": bodies_to_json(self.bodies),
            "operand_paths": paths_to_json(self.operand_paths),
            # (written only where set: plans without it read as they did before)
            **({"optimizer_apart": True} if self.optimizer_apart else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """Inverse of :meth:`to_dict`; raises :class:`InvalidPlanError` on a malformed dict."""
        try:
            if d.get("format") != PLAN_FORMAT:
                raise InvalidPlanError(f"plan format {d.get('format')!r} is not supported "
                                       f"(this hulkjax reads format {PLAN_FORMAT}); re-plan.")
            topo = None if d.get("topology") is None else Topology.from_dict(d["topology"])
            cost = None if d.get("cost") is None else Cost.from_dict(d["cost"])
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
                stages=None if d.get("stages") is None else tuple(
                    Stage.from_dict(st, bodies=bodies_from_json) for st in d["stages"]),
                microbatches=int(d.get("microbatches", 1)),
                schedule=d.get("schedule"),
                virtual_stages=int(d.get("virtual_stages", 1)),
                optimizer_apart=bool(d.get("optimizer_apart", False)),
                planning_time=float(d.get("planning_time", 0.0)),
                notes=list(d.get("notes", [])),
                bodies=bodies_from_json(d.get("bodies", [])),
                operand_paths=paths_from_json(d.get("operand_paths", [])),
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


def memory_kind(value) -> str:
    """The ``memory_kind`` of a traced value's :class:`TensorPlan`."""
    return "pinned_host" if value.host else "device"


def _tensor_to_json(t: TensorPlan) -> dict:
    out = {"path": t.path, "shape": list(t.shape), "dtype": t.dtype, "role": t.role,
           "spec": spec_to_json(t.spec)}
    if t.memory_kind != "device":
        out["memory_kind"] = t.memory_kind
    return out


def _tensor_from_json(d: dict) -> TensorPlan:
    return TensorPlan(path=d["path"], shape=tuple(int(x) for x in d["shape"]), dtype=d["dtype"],
                      role=d["role"], spec=spec_from_json(d["spec"]),
                      memory_kind=d.get("memory_kind", "device"))


# ---- the plain-text summary -----------------------------------------------------------------
SummarySection = Callable[["Plan", int], list]
summary_sections: list[SummarySection] = []
"""Sections :meth:`Plan.summary` prints before the record's own lines. Higher layers add theirs
(:mod:`hulkjax.explain` adds the per-layer table) with :func:`register_summary_section`: the record
does not import them."""


def register_summary_section(section: SummarySection) -> SummarySection:
    """Add ``section(plan, max_rows) -> [line, ...]`` to :meth:`Plan.summary` (once)."""
    if section not in summary_sections:
        summary_sections.append(section)
    return section


def _mesh_text(plan: Plan) -> str:
    return " x ".join(f"{a}={n}" for a, n in zip(plan.axis_names, plan.mesh_shape))


def record_summary(plan: Plan, *, max_rows: int = 40) -> list[str]:
    """The record's part of the summary: arguments grouped by role and layout (leaves with the same
    role and spec counted together, so a GPT-2 plan reads as a dozen lines), constraints, the
    predicted cost and collectives, and the notes."""
    lines = []
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for t in plan.inputs:
        groups[(t.role, format_spec(t.spec))].append(t)
    lines.append(f"{'role':<10} {'layout':<22} {'leaves':>6} {'bytes':>10}  example")
    for (role, spec), ts in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1])))[:max_rows]:
        total_b = sum(_size(t.shape) * dtype_size(t.dtype) for t in ts)
        lines.append(f"{role:<10} {spec:<22} {len(ts):>6} {format_bytes(total_b):>10}  {ts[0].path}")
    if plan.operand_specs or plan.result_specs:
        lines.append(f"constraints: {len(plan.operand_specs)} operand, "
                     f"{len(plan.result_specs)} intermediate")
    if plan.cost is not None:
        lines.append(str(plan.cost))
        # The dearest first where there are more than ``max_rows`` (a staged plan lists each
        # stage's: 32 stages, a hundred lines).
        colls = plan.cost.collectives
        if len(colls) > max_rows:
            colls = sorted(colls, key=lambda c: -c.time)[:max_rows]
        for c in colls:
            links = "+".join(dict.fromkeys(plan.cost.link_class.get(x, "?") for x in c.axes))
            lines.append(f"  {c.kind} over {'+'.join(c.axes)} ({links} links): {c.count} x, "
                         f"{format_bytes(c.bytes)}, {format_time(c.time)}")
        if len(plan.cost.collectives) > len(colls):
            lines.append(f"  ... and {len(plan.cost.collectives) - len(colls)} more "
                         f"(plan.cost.collectives)")
    for note in plan.notes[:10]:
        lines.append(f"note: {note}")
    if len(plan.notes) > 10:
        lines.append(f"note: ... and {len(plan.notes) - 10} more")
    return lines


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
