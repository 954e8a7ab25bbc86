"""The stage of a staged (pipeline) plan: which devices run which part of the step, and how.

Where this sits::

    strategies.stages (planners)  ->  Plan.stages = (Stage, ...)  ->  emit.mpmd (one program per
                                                                       stage and phase, transfers)

A staged plan splits one traced training step over disjoint device groups. Stage ``k`` runs the
nodes ``forward`` and ``backward`` once per microbatch, and ``update`` (the optimizer) once per
step, as SPMD programs on its own sub-mesh; values crossing stages are sent with
``jax.device_put`` to the receiving stage's layout (``value_specs``). Node and value ids are those
of the plan's graph (``Plan.graph_fingerprint``).

>>> s = Stage(devices=(0, 1), layers=("MLP/dense_0",), axis_names=("gpu",), mesh_shape=(2,),
...           forward=(0, 1), backward=(5,), update=(9,))
>>> s.nodes, Stage.from_dict(s.to_dict()) == s
((0, 1, 5, 9), True)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec

from hulkjax.errors import InvalidPlanError
from hulkjax.plan.specs import paths_from_json, paths_to_json, spec_from_json, spec_to_json


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of a staged plan: a device group, the layers it runs, its SPMD layouts.

    Attributes:
      devices: indices into the topology's devices (``Topology.devices``), in mesh order.  # tuple
      layers: the module scopes it runs (``"GPT2/h_3"``), in step order.  # tuple of str
      axis_names / mesh_shape: its sub-mesh over ``devices`` (row-major).  # tuple / tuple
      forward: graph node ids it runs per microbatch on the way forward.  # tuple of int
      backward: graph node ids it runs per microbatch on the way back (gradients, recomputation of
        rematerialized layers).  # tuple of int
      update: graph node ids it runs once per step on the combined microbatches (the optimizer
        update of its parameters).  # tuple of int
      inputs: indices of the step's argument leaves it holds (its parameters and their optimizer
        state; the batch is sent to every stage that reads it).  # tuple of int
      value_specs: ``{value id: PartitionSpec}``: the layout, on this sub-mesh, of every value its
        programs receive or hand on (arguments it holds or reads, activations from other stages,
        residuals kept for its backward pass, gradients accumulated for its update).  # dict
      operand_specs / result_specs: ``{(node id, index): PartitionSpec}``: the constraints of its
        SPMD plan, as :class:`~hulkjax.plan.Plan`'s.  # dict
      operand_paths: ``{(node id, index): (PartitionSpec, ...)}``: layouts its operands pass
        through, as :attr:`Plan.operand_paths`.  # dict
      bodies: layouts inside the bodies of its ``scan`` / ``while`` / ``cond`` nodes, as
        :attr:`Plan.bodies`.  # dict
      strategy: the SPMD plan inside the stage (``"dp_tp"``, ``"ilp"``, ...).  # str
      unreduced: ``{value id: mesh axes}``: sums its per-microbatch programs make (weight
        gradients, summed losses) that are accumulated unreduced over these axes of its
        sub-mesh, one partial sum per device, and reduced once per step before the update,
        instead of in every microbatch (:mod:`hulkjax.cost.unreduced`).  # dict
    """

    devices: tuple[int, ...]
    layers: tuple[str, ...]
    axis_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    forward: tuple[int, ...] = ()
    backward: tuple[int, ...] = ()
    update: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    value_specs: dict[int, PartitionSpec] = field(default_factory=dict, compare=False)
    operand_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict,
                                                                compare=False)
    result_specs: dict[tuple[int, int], PartitionSpec] = field(default_factory=dict,
                                                               compare=False)
    bodies: dict[int, tuple[Any, ...]] = field(default_factory=dict, compare=False)
    strategy: str = ""
    operand_paths: dict[tuple[int, int], tuple[PartitionSpec, ...]] = field(
        default_factory=dict, compare=False)
    unreduced: dict[int, tuple[str, ...]] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        n = 1
        for s in self.mesh_shape:
            n *= s
        if n != len(self.devices) or len(self.axis_names) != len(self.mesh_shape):
            raise InvalidPlanError(
                f"Stage: mesh {dict(zip(self.axis_names, self.mesh_shape))} does not cover its "
                f"{len(self.devices)} devices {list(self.devices)[:8]}; give one axis name per "
                f"mesh dimension and sizes multiplying to the number of devices.")
        if len(set(self.devices)) != len(self.devices):
            raise InvalidPlanError(f"Stage: devices {list(self.devices)} repeat a device.")
        for v, axes in self.unreduced.items():
            if not axes or not set(axes) <= set(self.axis_names):
                raise InvalidPlanError(
                    f"Stage: value {v} is accumulated unreduced over axes {tuple(axes)}, which "
                    f"are not axes of the stage's mesh {tuple(self.axis_names)}. Re-plan.")

    @property
    def nodes(self) -> tuple[int, ...]:
        """Every node it runs: forward, backward, then update."""
        return self.forward + self.backward + self.update

    def to_dict(self) -> dict:
        """The JSON form (:meth:`from_dict` inverts it; loop bodies are read back by
        ``Plan.from_dict``, which knows their record)."""
        return {
            "devices": list(self.devices),
            "layers": list(self.layers),
            "axis_names": list(self.axis_names),
            "mesh_shape": list(self.mesh_shape),
            "forward": _ranges(self.forward),
            "backward": _ranges(self.backward),
            "update": _ranges(self.update),
            "inputs": list(self.inputs),
            "value_specs": [[v, spec_to_json(s)] for v, s in sorted(self.value_specs.items())],
            "operand_specs": [[n, k, spec_to_json(s)]
                              for (n, k), s in sorted(self.operand_specs.items())],
            "result_specs": [[n, k, spec_to_json(s)]
                             for (n, k), s in sorted(self.result_specs.items())],
            "bodies": [[nid, [b.to_dict() for b in plans]]
                       for nid, plans in sorted(self.bodies.items())],
            "strategy": self.strategy,
            "operand_paths": paths_to_json(self.operand_paths),
            "unreduced": [[v, list(axes)] for v, axes in sorted(self.unreduced.items())],
        }

    @classmethod
    def from_dict(cls, d: dict, *, bodies=None) -> Stage:
        """Inverse of :meth:`to_dict`; ``bodies`` reads the loop bodies' JSON (``Plan.from_dict``
        passes its reader; without one a stage with loop bodies cannot be read)."""
        if d.get("bodies") and bodies is None:
            raise InvalidPlanError("a stage with loop bodies is read as part of its plan: use "
                                   "hj.Plan.from_dict / hj.Plan.load.")
        return cls(
            devices=tuple(int(x) for x in d["devices"]),
            layers=tuple(d["layers"]),
            axis_names=tuple(d["axis_names"]),
            mesh_shape=tuple(int(x) for x in d["mesh_shape"]),
            forward=_unranges(d["forward"]),
            backward=_unranges(d["backward"]),
            update=_unranges(d["update"]),
            inputs=tuple(int(x) for x in d["inputs"]),
            value_specs={int(v): spec_from_json(s) for v, s in d["value_specs"]},
            operand_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["operand_specs"]},
            result_specs={(int(n), int(k)): spec_from_json(s) for n, k, s in d["result_specs"]},
            bodies=bodies(d["bodies"]) if d.get("bodies") else {},
            strategy=d.get("strategy", ""),
            operand_paths=paths_from_json(d.get("operand_paths", [])),
            unreduced={int(v): tuple(axes) for v, axes in d.get("unreduced", [])},
        )


SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""Pipeline schedules: ``"1f1b"`` (one forward, one backward: at most ``stages - k`` microbatches
in flight on stage ``k``), ``"gpipe"`` (all forwards, then all backwards) and ``"interleaved"``
(Megatron-LM's interleaved 1F1B, Narayanan et al., SC'21: each device group hosts ``v``
non-contiguous chunks of layers, "virtual stages"; the bubble shrinks by ``v``, the transfers
between groups grow by ``v``). See :func:`schedule_queues`."""


def schedule_queues(schedule: str, groups: int, chunks: int, microbatches: int
                    ) -> list[list[tuple[int, str, int]]]:
    """The order in which each device group runs its programs: per group ``d``, a list of
    ``(stage, phase, microbatch)`` with phase ``"F"`` or ``"B"``.

    Stages are numbered in pipeline order; stage ``j`` runs on group ``j % groups`` (with
    ``chunks == 1`` stage ``j`` is group ``j``). ``"gpipe"``: every forward, then every backward.
    ``"1f1b"``: group ``d`` warms up with ``groups - d - 1`` forwards, then alternates.
    ``"interleaved"`` (``chunks = v >= 2``, ``microbatches`` a multiple of ``groups``, as in
    Megatron-LM): forwards go through the group's chunks in blocks of ``groups`` microbatches,
    chunk by chunk, backwards through its chunks in reverse; group ``d`` warms up with
    ``2 (groups - d - 1) + (v - 1) groups`` forwards, then alternates one forward and one backward.

    >>> schedule_queues("interleaved", 2, 2, 2)[1]
    [(1, 'F', 0), (1, 'F', 1), (3, 'F', 0), (3, 'B', 0), (3, 'F', 1), (3, 'B', 1), (1, 'B', 0), (1, 'B', 1)]
    """
    S, v, M = groups, chunks, microbatches
    if schedule == "interleaved":
        if v < 2 or M % S:
            raise InvalidPlanError(
                f"the interleaved schedule needs at least 2 chunks per group and a number of "
                f"microbatches that is a multiple of the {S} groups, got chunks={v}, "
                f"microbatches={M}.")
    elif v != 1:
        raise InvalidPlanError(f"schedule {schedule!r} runs one chunk per group, got {v}; use "
                               f"schedule='interleaved' for virtual stages.")
    out = []
    for d in range(S):
        if schedule == "gpipe":
            q = [(d, "F", m) for m in range(M)] + [(d, "B", m) for m in range(M)]
        elif schedule == "1f1b":
            warm = min(S - d - 1, M)
            q = [(d, "F", m) for m in range(warm)]
            f, b = warm, 0
            while f < M or b < M:
                if f < M:
                    q.append((d, "F", f))
                    f += 1
                if b < M:
                    q.append((d, "B", b))
                    b += 1
        else:
            total = M * v

            def op(i, phase, d=d):
                c = (i % (S * v)) // S
                if phase == "B":
                    c = v - 1 - c
                return (c * S + d, phase, (i // (S * v)) * S + i % S)

            warm = min(2 * (S - d - 1) + (v - 1) * S, total)
            q = [op(i, "F") for i in range(warm)]
            for i in range(total - warm):
                q += [op(warm + i, "F"), op(i, "B")]
            q += [op(i, "B") for i in range(total - warm, total)]
        out.append(q)
    return out


def schedule_times(schedule: str, groups: int, chunks: int, microbatches: int, forward,
                   backward, transfers=None,
                   tails=None) -> dict[tuple[int, str, int], tuple[float, float]]:
    """``{(stage, phase, microbatch): (start, end)}`` when every device group runs its programs
    in :func:`schedule_queues` order, each as soon as the group is free and its inputs have
    arrived: a forward after the previous stage's forward of that microbatch, a backward after
    its own forward and the next stage's backward, plus the per-microbatch transfer between
    the two stages (a delay: links are not queued). Values of stages further apart (skip
    connections) wait for their own transfer.

    Args:
      forward / backward: seconds per microbatch, per stage (pipeline order).
      transfers: ``{(src, dst): {"fwd": s, "bwd": s}}``, seconds per microbatch of the values
        a forward (``"fwd"``) or a backward (``"bwd"``) of stage ``src`` sends stage ``dst``.
      tails: seconds per stage that its group stays busy after the stage's last program (the
        reduction of the gradients it accumulated unreduced): the group's later programs wait.

    >>> t = schedule_times("1f1b", 2, 1, 2, [1.0, 1.0], [2.0, 2.0])
    >>> t[(1, "F", 0)], t[(0, "B", 1)]
    ((1.0, 2.0), (7.0, 9.0))
    """
    f, b, S = list(forward), list(backward), len(forward)
    deps: dict[tuple[str, int], dict[tuple[str, int], float]] = {}
    for j in range(S):
        deps[("F", j)] = {("F", j - 1): 0.0} if j else {}
        deps[("B", j)] = {("F", j): 0.0, **({("B", j + 1): 0.0} if j + 1 < S else {})}
    for (i, j), t in (transfers or {}).items():
        if t.get("fwd", 0.0) > 0:  # forward values: into the reader's forward, or its backward
            key = ("F", j) if i < j else ("B", j)
            deps[key][("F", i)] = max(deps[key].get(("F", i), 0.0), t["fwd"])
        if t.get("bwd", 0.0) > 0:
            deps[("B", j)][("B", i)] = max(deps[("B", j)].get(("B", i), 0.0), t["bwd"])
    queues = schedule_queues(schedule, groups, chunks, microbatches)
    tail = {}  # (stage, phase, microbatch) of each stage's last program -> its tail
    for q in queues:
        for key in q:
            tail[key[0]] = key
    tail = {key: float(tails[j]) for j, key in tail.items()} if tails is not None else {}
    times: dict[tuple[int, str, int], tuple[float, float]] = {}
    free, heads = [0.0] * groups, [0] * groups
    while any(h < len(q) for h, q in zip(heads, queues)):
        progressed = False
        for d, q in enumerate(queues):
            while heads[d] < len(q):
                j, ph, mb = q[heads[d]]
                need = deps[(ph, j)]
                if any((i, p, mb) not in times for p, i in need):
                    break
                start = max([free[d]] + [times[(i, p, mb)][1] + c for (p, i), c in need.items()])
                end = start + (f[j] if ph == "F" else b[j])
                times[(j, ph, mb)] = (start, end)
                free[d] = end + tail.get((j, ph, mb), 0.0)
                heads[d] += 1
                progressed = True
        if not progressed:
            raise InvalidPlanError(f"the {schedule!r} order of {groups} groups x {chunks} chunks "
                                   f"deadlocks")
    return times


def check_virtual_stages(stages, schedule: str, chunks: int, microbatches: int) -> None:
    """Raise :class:`InvalidPlanError` unless ``stages`` (pipeline order) fit ``chunks`` virtual
    stages per device group: ``len(stages) = groups x chunks``, stage ``j`` on the devices of stage
    ``j % groups``, the first ``groups`` stages on disjoint devices, and the schedule's
    conditions (:func:`schedule_queues`)."""
    if not isinstance(chunks, int) or chunks < 1 or len(stages) % chunks:
        raise InvalidPlanError(f"virtual_stages={chunks!r} must be an int >= 1 dividing the "
                               f"{len(stages)} stages of the plan.")
    S = len(stages) // chunks
    if chunks > 1:
        for j, st in enumerate(stages):
            if st.devices != stages[j % S].devices:
                raise InvalidPlanError(
                    f"stage {j} of an interleaved plan with {S} device groups x {chunks} chunks "
                    f"runs on devices {list(st.devices)[:8]}, not on those of stage {j % S} "
                    f"({list(stages[j % S].devices)[:8]}): chunk j runs on group j % groups.")
        seen: set[int] = set()
        for st in stages[:S]:
            if seen & set(st.devices):
                raise InvalidPlanError(f"the {S} device groups of an interleaved plan share "
                                       f"devices {sorted(seen & set(st.devices))[:8]}.")
            seen |= set(st.devices)
    schedule_queues(schedule, S, chunks, microbatches)  # raises on a schedule / chunks mismatch


def schedule_in_flight(schedule: str, groups: int, chunks: int, microbatches: int) -> list[int]:
    """Per stage (pipeline order), the most microbatches whose forward it has run and whose
    backward it has not, over its group's order (:func:`schedule_queues`): the activations it
    holds at its peak. 1F1B: ``min(M, groups - k)``; GPipe: ``M``.

    >>> schedule_in_flight("1f1b", 4, 1, 8), schedule_in_flight("interleaved", 2, 2, 4)
    ([4, 3, 2, 1], [4, 3, 2, 1])
    """
    peak = [0] * (groups * chunks)
    for q in schedule_queues(schedule, groups, chunks, microbatches):
        live = [0] * (groups * chunks)
        for j, ph, _ in q:
            live[j] += 1 if ph == "F" else -1
            peak[j] = max(peak[j], live[j])
    return peak


def _ranges(ids: tuple[int, ...]) -> list[list[int]]:
    """``(3, 4, 5, 9)`` -> ``[[3, 6], [9, 10]]`` (half-open runs, in the given order)."""
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def _unranges(runs) -> tuple[int, ...]:
    if not isinstance(runs, list):
        raise InvalidPlanError(f"stage node ids are stored as [start, end] runs, got {runs!r}")
    return tuple(i for a, b in runs for i in range(int(a), int(b)))
