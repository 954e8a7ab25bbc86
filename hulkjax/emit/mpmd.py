"""Emit a staged plan: one jitted program per stage and phase, transfers, a host-driven schedule.

Where this sits::

    Plan.stages (hj.Stage: devices, sub-mesh, node ids per phase, layouts)
        |   the traced step at the full batch and at the microbatch size (trace.microbatch)
        v
    per stage k:  F_k (its forward nodes)  B_k (its backward nodes, accumulating gradients)
                  on its sub-mesh, from the microbatch trace; R_k (the reduction of the
                  gradients it accumulates unreduced); U (the optimizer) from the full trace
        |   jax.device_put of activations / gradients to the next stage's NamedSharding
        v
    StagedStep(state, batch): the batch cut into M microbatches; F and B in GPipe, 1F1B or
    interleaved 1F1B order for every microbatch; the accumulated gradients (and summed losses)
    combined exactly (M ** e times their sum, see hulkjax.trace.microbatch); the update once per
    step on each stage.

Gradients accumulated unreduced (``Stage.unreduced``, decided by the cost model:
:mod:`hulkjax.cost.unreduced`): where a stage's plan splits the batch over mesh axes and leaves a
weight gradient whole over them, the operator making it (a sum over examples) runs per device on
its piece of the batch inside ``jax.shard_map`` (manual over those axes only), and the
microbatch's program adds each device's partial sum to its own row of a float32 accumulator
(a leading dimension over the axes): no collective per microbatch. Right after the stage's last
forward or backward, ``R_k`` sums the rows (one all-reduce, which XLA
combines over the stage's gradients), scales them and hands the gradients to the update, as
Megatron-LM and DeepSpeed reduce once per step. Gradients the plan reduce-scatters (fsdp-like)
are reduced in every microbatch, as ZeRO-3 does.

An interleaved plan (``plan.virtual_stages = v > 1``) lists every chunk of layers as a stage:
chunk ``j`` has its own programs on its own mesh over the devices of group ``j % groups``. Each
group's order is Megatron-LM's (:func:`hulkjax.plan.stages.schedule_queues`); the host merges the
groups' orders by the programs' predicted start times (:func:`hulkjax.plan.stages.schedule_times`
on the plan's cost), dispatching a program as soon as its inputs are computed.

Values move between stages as early as the cost model has them move: the parameters another
stage reads before the first program, a microbatch's activation (or gradient) right after the
program computing it, once per receiving stage (which keeps it until its last reader there), a
summed gradient to the update's stage right after its last microbatch.

Every program re-runs the plan's nodes of one traced step (:func:`hulkjax.trace.interpret.evaluate`)
with the stage's planned constraints, so the staged step computes what the unsharded step computes.
Programs are lowered and compiled by :meth:`StagedStep.compile` before any argument is touched.
Donation as in SPMD emission: each state leaf's buffer is given to the program that writes its new
value (the last to read it); gradient accumulators are donated from microbatch to microbatch, and
to the reduction.

Under ``jax.distributed`` (several processes, e.g. ``hulkjax launch``) the same step runs
multi-controller: every process calls it with the same arguments (host values, or what the step
returned), runs the same host schedule, compiles and runs the programs of the stages whose devices
it holds, and holds placeholders (arrays with no shards here) for the other stages' values; a
value crossing processes goes with one cross-host ``jax.device_put`` that every process takes
part in (:mod:`hulkjax.emit.transfer`), and a call returns once every process has its results
(so a job-wide collective after it cannot wait on a pending send). Each stage's devices must
belong to one process.

What cannot be emitted with several microbatches (the plan then raises and says why): steps whose
batch-dependent part is not a sum over examples (batch statistics, a loss normalized by a
data-dependent count, reductions over the batch that are not sums, random numbers drawn per example),
see :mod:`hulkjax.trace.microbatch`. Such steps run staged with one microbatch.

>>> import jax, jax.numpy as jnp, hulkjax as hj
>>> from hulkjax import zoo
>>> m = zoo.get("mlp", size="tiny")
>>> state, batch = m.init(seed=0)
>>> plan = hj.plan(m.step, state, batch, topology=hj.Topology.preset("hetero"),
...                strategy="pipeline")
>>> step = hj.emit(m.step, plan, donate=False)
>>> _, metrics = step(state, batch)
>>> bool(abs(metrics["loss"] - m.step(state, batch)[1]["loss"]) < 1e-5)
True
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hulkjax.emit import transfer
from hulkjax.emit.hlo import Collective, collectives_from_hlo
from hulkjax.emit.spmd import _place_copy as place_copy
from hulkjax.emit.spmd import bind_graph, body_hooks, check_args, node_hooks
from hulkjax.errors import (
    DonatedArgumentError,
    InvalidPlanError,
    NotCompiledError,
    NotEnoughDevicesError,
    PlanMismatchError,
    ProcessLayoutError,
    UnsupportedStepError,
)
from hulkjax.plan.records import Plan, memory_kind
from hulkjax.plan.stages import schedule_queues, schedule_times
from hulkjax.trace.graph import OpGraph
from hulkjax.trace.interpret import constant_values, equations, evaluate
from hulkjax.trace.microbatch import analyze, microbatch_graph, sum_over_examples
from hulkjax.trace.tracer import leaf_aval

log = logging.getLogger("hulkjax.emit")

F, B, U = "F", "B", "U"


class _Program:
    """One jitted program: some nodes of one graph on one stage's mesh.

    ``reads``: value ids it takes (in order); ``writes``: value ids it returns; ``accs``: boundary
    value ids it adds into float32 accumulators (taken after ``reads``, returned after
    ``writes``).
    """

    def __init__(self, name: str, stage: int, graph: OpGraph, nodes: list[int]):
        self.name, self.stage, self.graph, self.nodes = name, stage, graph, nodes
        self.reads: list[int] = []
        self.writes: list[int] = []
        self.accs: list[int] = []
        self.donate: tuple[int, ...] = ()
        self.compiled = None


class StagedStep:
    """A staged plan compiled for its stages: call it like the original step.

    Attributes:
      fn: the user's step.
      plan: the staged :class:`~hulkjax.plan.Plan` it runs.
      meshes: one ``jax.sharding.Mesh`` per stage (its sub-mesh of ``jax.devices()``).
      programs: ``{(stage, phase): compiled program}`` after :meth:`compile` (phase ``"F"``,
        ``"B"``, ``"R<stage>"`` for the reduction of its unreduced gradients, ``"U0"``,
        ``"U1"``, ... for the update's segments); in a multi-process job only the stages this
        process holds.
      local_stages: the stages whose devices this process holds (all of them in one process).
      crossings: the values the last call sent between processes, in order
        (:class:`hulkjax.emit.transfer.Crossing`; empty in one process).
    """

    def __init__(self, fn: Callable, plan: Plan, *, donate: bool = True, devices=None):
        if not isinstance(plan, Plan) or plan.stages is None:
            raise InvalidPlanError("StagedStep needs a staged plan (plan.stages is not None); "
                                   "emit SPMD plans with hj.emit, which picks the right emitter.")
        if plan.topology is None:
            raise InvalidPlanError("the staged plan has no topology to place its stages on; "
                                   "plans from hj.plan or Plan.load carry one.")
        if plan.topology_fingerprint and plan.topology.fingerprint() != plan.topology_fingerprint:
            raise PlanMismatchError(
                f"the plan's topology {plan.topology.name!r} has fingerprint "
                f"{plan.topology.fingerprint()}, but the plan was made for "
                f"{plan.topology_fingerprint} (was the plan file edited?). Re-plan.")
        self.fn, self.plan, self.donate = fn, plan, donate
        devs = list(jax.devices() if devices is None else devices)
        n = plan.topology.num_devices
        if len(devs) < n:
            raise NotEnoughDevicesError(
                f"the staged plan's topology {plan.topology.name!r} needs {n} devices but JAX has "
                f"{len(devs)}; for fake CPU devices set jax.config.update('jax_num_cpu_devices', "
                f"{n}) before JAX starts.")
        self.meshes = []
        for st in plan.stages:
            grid = np.empty(len(st.devices), dtype=object)
            grid[:] = [devs[d] for d in st.devices]
            self.meshes.append(jax.sharding.Mesh(
                grid.reshape(st.mesh_shape), st.axis_names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(st.axis_names)))
        me = jax.process_index()
        owners = [sorted({d.process_index for d in m.devices.flat}) for m in self.meshes]
        for k, procs in enumerate(owners):
            if len(procs) > 1:
                raise ProcessLayoutError(
                    f"stage {k} of the staged plan runs on devices {list(plan.stages[k].devices)}"
                    f" of processes {procs}; a staged step runs each stage in one process (its "
                    f"programs there, values between stages sent across processes). Start one "
                    f"process per stage's device group (hulkjax launch --processes "
                    f"{len(plan.stages) // plan.virtual_stages} for this plan's groups, or one per "
                    f"region holding whole "
                    f"stages), or plan stages that fit the processes.")
        self.local_stages = frozenset(k for k, procs in enumerate(owners) if me in procs)
        self.multiprocess = len({p for procs in owners for p in procs}) > 1
        if self.multiprocess:
            transfer.check_enabled("this staged plan")
        self.crossings: list[transfer.Crossing] = []
        self._arrivals: dict[int, jax.Array] = {}  # per call (see __call__)
        self.programs: dict[tuple[int, str], object] = {}
        self._graph: OpGraph | None = plan.graph
        self._built = False

    def __repr__(self) -> str:
        state = "compiled" if self._built else "not compiled"
        return (f"StagedStep({getattr(self.fn, '__name__', 'step')}, strategy="
                f"{self.plan.strategy!r}, {len(self.plan.stages)} stages x "
                f"{self.plan.microbatches} microbatches, {state})")

    # ---- building -------------------------------------------------------------------------
    def _bind_graph(self, args) -> OpGraph:
        self._graph = bind_graph(self.fn, self.plan, self._graph, args)
        return self._graph

    def _check_args(self, args) -> list:
        return check_args(self.plan, args)

    def _sharding(self, k: int, v: int) -> NamedSharding | None:
        spec = self.plan.stages[k].value_specs.get(v)
        return None if spec is None else self._placed(k, v, spec)

    def _placed(self, k: int, v: int, spec: PartitionSpec | None = None) -> NamedSharding:
        """Value ``v`` on stage ``k``'s devices laid out as ``spec`` (replicated without one),
        in the memory the step keeps it in: a value in host memory stays there, across the
        stage's programs too (an activation the step offloads, between its forward and backward
        programs; state it keeps on the host, into and out of the update)."""
        kind = memory_kind(self.full.values[v])
        return NamedSharding(self.meshes[k], PartitionSpec() if spec is None else spec,
                             memory_kind=None if kind == "device" else kind)

    def compile(self, *args):
        """Trace (if needed), then lower and compile every stage program for these arguments
        (arrays or ``ShapeDtypeStruct`` s); returns ``self.programs``."""
        if self._built:
            return self.programs
        g = self._bind_graph(args)
        self._check_args(args)
        plan = self.plan
        M = plan.microbatches
        self.full = g
        stage_of, phase_of = {}, {}
        for k, st in enumerate(plan.stages):
            for ph, nodes in ((F, st.forward), (B, st.backward), (U, st.update)):
                for nid in nodes:
                    if nid in stage_of:
                        raise InvalidPlanError(f"node {nid} is in two stages of the plan.")
                    stage_of[nid] = k
                    phase_of[nid] = ph
        missing = [n.id for n in g.nodes if n.id not in stage_of]
        if missing:
            raise InvalidPlanError(f"the staged plan leaves {len(missing)} operators of the step "
                                   f"to no stage (e.g. node {missing[0]}). Re-plan.")
        self.stage_of, self.phase_of = stage_of, phase_of
        if M > 1:
            micro = microbatch_graph(g, M)
            split = analyze(g, micro)
            if not split.exact:
                raise UnsupportedStepError(
                    f"this step cannot be cut into {M} microbatches exactly: "
                    f"{split.problems[0]}. Plan it with microbatches=1 (hulkjax's planners do so "
                    f"for such steps).")
            per = {n for n, ph in phase_of.items() if ph != U}
            if per != set(split.per_microbatch):
                raise PlanMismatchError(
                    "the plan's per-microbatch operators are not the step's batch-dependent "
                    "ones (was the plan made for another step?). Re-plan.")
            self.micro, self.boundary = micro, split.boundary
            self.split_inputs = set(split.split_inputs)
        else:
            self.micro, self.boundary, self.split_inputs, split = g, {}, set(), None
        self.unreduced = self._check_unreduced(split)
        self.holder = {i: k for k, st in enumerate(plan.stages) for i in st.inputs}
        self._plan_programs()
        self._compile_programs()
        self._built = True
        log.info("compiled %d stage programs for %s", len(self.programs),
                 getattr(self.fn, "__name__", "step"))
        return self.programs

    def _check_unreduced(self, split) -> dict[int, tuple[tuple[str, ...], dict[int, int]]]:
        """``{value: (mesh axes, {operand: batch dimension})}`` of the sums the plan's stages
        accumulate unreduced (``Stage.unreduced``), each checked to be a boundary sum that a
        per-microbatch program of its stage makes by a sum over examples."""
        out = {}
        for k, st in enumerate(self.plan.stages):
            for v, axes in st.unreduced.items():
                prod = self.full.values[v].producer if 0 <= v < len(self.full.values) else None
                c = self.boundary.get(v)
                operands = None if split is None or prod is None else \
                    sum_over_examples(self.full, self.full.nodes[prod], split.flows)
                if c is None or c.kind != "sum" or self.stage_of.get(prod) != k \
                        or self.phase_of.get(prod) == U or not operands:
                    raise InvalidPlanError(
                        f"stage {k} of the plan accumulates value {v} unreduced over {axes}, but "
                        f"with {self.plan.microbatches} microbatch(es) it is not a sum over "
                        f"examples that the stage's forward or backward makes (was the plan "
                        f"made for another step, or edited?). Re-plan.")
                out[v] = (tuple(axes), operands)
        return out

    def _plan_programs(self) -> None:
        plan, g = self.plan, self.full
        M = plan.microbatches
        S = len(plan.stages)
        self.per_mb: dict[tuple[int, str], _Program] = {}
        for k, st in enumerate(plan.stages):
            for ph, nodes in ((F, st.forward), (B, st.backward)):
                if nodes:
                    self.per_mb[(k, ph)] = _Program(f"{ph}{k}", k, self.micro, list(nodes))
        self.segments = self._update_segments()
        programs = list(self.per_mb.values()) + self.segments
        owner = {}
        for p in programs:
            for nid in p.nodes:
                owner[nid] = p
        outputs = [v for v in g.outputs if v is not None]
        sums = {v for v, c in self.boundary.items() if c.kind == "sum"} if M > 1 else set()
        for p in programs:
            mine = set(p.nodes)
            reads: dict[int, None] = {}
            writes: dict[int, None] = {}
            for nid in p.nodes:
                for v in g.nodes[nid].inputs:
                    if v is None or v in self._constants:
                        continue
                    prod = g.values[v].producer
                    if prod is None or prod not in mine:
                        reads[v] = None
                for o in g.nodes[nid].outputs:
                    uses = [c for c, _ in g.consumers(o) if c not in mine]
                    if (uses or o in outputs or o in self.boundary) and o not in sums:
                        writes[o] = None
                    if o in sums:
                        p.accs.append(o)
            p.reads, p.writes = list(reads), list(writes)
        self._order_per_microbatch(S, M)
        self._releases(outputs)
        self._plan_reductions()

    def _releases(self, outputs) -> None:
        """What a microbatch's values may be dropped after: each once its last reader among the
        microbatch's programs has run (1F1B then holds a stage's activations only while its
        microbatches are in flight), unless the update or the step's results need it."""
        keep = set(outputs) | set(self.boundary)
        for seg in self.segments:
            keep.update(seg.reads)
        sequence = [(k, ph) for k, ph, m in self.order if m == 0]
        last: dict[int, tuple[int, str]] = {}
        for key in sequence:
            for v in self.per_mb[key].reads + self.per_mb[key].writes:
                last[v] = key
        self.release: dict[tuple[int, str], list[int]] = defaultdict(list)
        for v, key in last.items():
            if v not in keep:
                self.release[key].append(v)
        # A microbatch's value moved to a stage stays there until that stage's last reader of it
        # (1F1B: a boundary activation a stage's forward received is read again by its
        # backward; sending it twice doubles the link's load).
        last_here: dict[tuple[int, int], str] = {}
        for k, ph in sequence:
            for v in self.per_mb[(k, ph)].reads:
                last_here[(k, v)] = ph
        self.release_moved: dict[tuple[int, str], list[int]] = defaultdict(list)
        for (k, v), ph in last_here.items():
            self.release_moved[(k, ph)].append(v)
        # Where a microbatch's value goes once its program has run: the other stages reading it,
        # by first reader. The step sends it at once rather than when the host reaches its
        # reader: a receive is posted only when the receiving process asks for it (the
        # transfer then starts), so sending at the reader would make each transfer wait for
        # the host loops of both ends to get there (transfer module docstring).
        producer = {v: key for key in sequence for v in self.per_mb[key].writes}
        # A value of the step (a summed gradient) goes to the update's stages once the program
        # writing it has run for the last microbatch, not after the last stage's backward.
        self.finals: dict[tuple[int, str], list[int]] = defaultdict(list)
        for key in sequence:
            p = self.per_mb[key]
            for v in dict.fromkeys(p.writes + p.accs):
                if v in self.boundary and v not in self.unreduced:  # (those: _plan_reductions)
                    self.finals[key].append(v)
        self.final_readers: dict[int, list[int]] = defaultdict(list)
        for seg in self.segments:
            for v in seg.reads:
                if v in self.boundary and seg.stage not in self.final_readers[v]:
                    self.final_readers[v].append(seg.stage)
        self.step_sends: list[tuple[int, int]] = []  # (reader stage, value), by first reader
        for k, ph in sequence:
            for v in self.per_mb[(k, ph)].reads:
                if v not in producer and (k, v) not in self.step_sends:
                    self.step_sends.append((k, v))
        self.sends: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
        for k, ph in sequence:
            for v in self.per_mb[(k, ph)].reads:
                src = producer.get(v)
                if src is not None and src[0] != k and (k, v) not in self.sends[src]:
                    self.sends[src].append((k, v))

    def _plan_reductions(self) -> None:
        """One program per stage that reduces the sums it accumulated unreduced (``R<stage>``),
        run right after the stage's last forward or backward (as the cost model's
        :func:`~hulkjax.cost.pipeline.pipeline_cost` has it: its group's later programs, the
        other chunks of an interleaved plan, wait for it; the drain hides what it can)."""
        self.reductions: list[_Program] = []
        self.reduce_after: dict[tuple, list[_Program]] = defaultdict(list)
        if not self.unreduced:
            return
        last: dict[int, tuple] = {}  # stage -> its last (stage, phase, microbatch)
        for key in self.order:
            last[key[0]] = key
        for k in range(len(self.plan.stages)):
            mine = [v for key in ((k, F), (k, B)) if key in self.per_mb
                    for v in self.per_mb[key].accs if v in self.unreduced]
            if not mine:
                continue
            r = _Program(f"R{k}", k, self.full, [])
            r.accs, r.writes = mine, list(mine)
            self.reductions.append(r)
            self.reduce_after[last[k]].append(r)

    @property
    def _constants(self) -> set[int]:
        return set(self.full.constants)

    def _update_segments(self) -> list[_Program]:
        """The update's nodes in runs of one stage, in a dependency order with fewest runs."""
        g = self.full
        nodes = [n.id for n in g.nodes if self.phase_of[n.id] == U]
        todo = set(nodes)
        deps = {}
        for nid in nodes:
            deps[nid] = {g.values[v].producer for v in g.nodes[nid].inputs
                         if v is not None and g.values[v].producer in todo}
        done: set[int] = set()
        segments: list[_Program] = []
        current = None
        while todo:
            ready = [n for n in nodes if n in todo and deps[n] <= done]
            by_stage = defaultdict(list)
            for n in ready:
                by_stage[self.stage_of[n]].append(n)
            k = current if current in by_stage else max(by_stage, key=lambda s: len(by_stage[s]))
            run = []
            while True:
                batch = [n for n in nodes if n in todo and self.stage_of[n] == k
                         and deps[n] <= done]
                if not batch:
                    break
                for n in batch:
                    todo.discard(n)
                    done.add(n)
                run.extend(batch)
            run.sort()
            segments.append(_Program(f"U{len(segments)}", k, g, run))
            current = None
        return segments

    def _order_per_microbatch(self, S: int, M: int) -> None:
        """The host's dispatch order of (stage, phase, microbatch)."""
        has = lambda k, ph: (k, ph) in self.per_mb  # noqa: E731
        order = []
        if self.plan.schedule == "gpipe":
            for m in range(M):
                order += [(k, F, m) for k in range(S) if has(k, F)]
            for m in range(M):
                order += [(k, B, m) for k in reversed(range(S)) if has(k, B)]
        else:  # 1F1B or interleaved 1F1B: each device group's order, merged as they get ready
            v = self.plan.virtual_stages
            queues = [[(k, ph, m) for k, ph, m in q if has(k, ph)]
                      for q in schedule_queues(self.plan.schedule, S // v, v, M)]
            done = set()
            heads = [0] * len(queues)
            while any(h < len(q) for h, q in zip(heads, queues)):
                progressed = False
                for d, q in enumerate(queues):
                    while heads[d] < len(q):
                        k, ph, m = q[heads[d]]
                        if not self._ready(k, ph, m, done, S):
                            break
                        order.append((k, ph, m))
                        done.add((k, ph, m))
                        heads[d] += 1
                        progressed = True
                if not progressed:
                    raise InvalidPlanError("the stages' forward and backward programs depend on "
                                           "each other in a cycle; re-plan.")
            # Walked in the order the programs are predicted to start. Every process walks this
            # order, and a process waiting for one program's inputs posts no transfer behind
            # it; walked group by group instead, a stage's send waits for unrelated programs
            # of the stages merged before it (on the WAN testbed most sends then added up).
            start = self._predicted_starts(S, M, v)
            if start:
                index = {key: i for i, key in enumerate(order)}
                order.sort(key=lambda key: (start.get(key, 0.0), index[key]))
        self.order = order

    def _predicted_starts(self, S: int, M: int, v: int) -> dict:
        """``{(stage, phase, microbatch): seconds}`` from the plan's cost (its stages' forward
        and backward per microbatch, its transfers), or ``{}`` where the cost has none."""
        cost = self.plan.cost
        if cost is None or not cost.stages or len(cost.stages) != S:
            return {}
        delays: dict[tuple[int, int], dict[str, float]] = {}
        for t in cost.transfers or ():
            if t.microbatch_bytes and t.bandwidth:  # forward values down the pipeline, gradients up
                c = t.latency + t.microbatch_bytes / t.bandwidth
                delays[(t.src, t.dst)] = {"fwd": c} if t.src < t.dst else {"bwd": c}
        try:
            times = schedule_times(self.plan.schedule, S // v, v, M,
                                   [st.forward for st in cost.stages],
                                   [st.backward for st in cost.stages], delays,
                                   tails=[st.reduction for st in cost.stages])
        except InvalidPlanError:
            return {}
        return {key: t0 for key, (t0, _) in times.items()}

    def _ready(self, k, ph, m, done, S) -> bool:
        if ph == F:
            return all((j, F, m) in done for j in range(k) if (j, F) in self.per_mb)
        return all((j, F, m) in done for j in range(S) if (j, F) in self.per_mb) and all(
            (j, B, m) in done for j in range(k + 1, S) if (j, B) in self.per_mb)

    # ---- compiling --------------------------------------------------------------------------
    def _program_fn(self, p: _Program):
        st = self.plan.stages[p.stage]
        mesh = self.meshes[p.stage]
        graph = p.graph
        eqns = self._equations(graph)
        consts = self._constant_env(graph)
        on_operand, on_result, on_bind = node_hooks(mesh, st.operand_specs, st.result_specs,
                                                    st.operand_paths)
        partial = {graph.values[v].producer: v for v in p.accs if v in self.unreduced}
        if partial:
            on_bind, on_result = self._partial_hooks(p, partial, on_bind, on_result)
        on_body = body_hooks(mesh, st.bodies)
        n_reads, accs = len(p.reads), p.accs
        mine = set(p.nodes)
        nodes = [n for n in p.nodes if n in mine]

        def fn(*args):
            env = dict(consts)
            env.update(zip(p.reads, args[:n_reads]))
            evaluate(graph, eqns, nodes, env, on_operand=on_operand, on_result=on_result,
                     on_body=on_body, on_bind=on_bind)
            outs = [env[v] for v in p.writes]
            new = [a + env[v].astype(jnp.float32)
                   for a, v in zip(args[n_reads:], accs)]
            return outs, new

        return fn

    def _partial_hooks(self, p: _Program, partial: dict[int, int], on_bind, on_result):
        """``(on_bind, on_result)`` for a program making sums it leaves unreduced (``partial``:
        node -> value): each such node runs per device on its piece of the batch
        (:func:`_partial_sums`) and hands on its partial sums, stacked along a new leading
        dimension over the stage's batch axes, in the accumulator's layout."""
        mesh = self.meshes[p.stage]
        wsc = jax.lax.with_sharding_constraint

        def bind(nid, prim, invals, params):
            v = partial.get(nid)
            if v is None:
                return None if on_bind is None else on_bind(nid, prim, invals, params)
            axes, operands = self.unreduced[v]
            return [_partial_sums(mesh, axes, operands, prim, invals, params)]

        def result(nid, outs):
            v = partial.get(nid)
            if v is not None:
                return [wsc(outs[0], self._acc_sharding[v])]
            return outs if on_result is None else on_result(nid, outs)

        return bind, result

    def _acc_shape(self, v: int) -> tuple[int, ...]:
        """An accumulator's shape: the value's, with a leading dimension of one partial sum per
        device over its axes where it is accumulated unreduced."""
        shape = tuple(self.micro.values[v].shape)
        if v not in self.unreduced:
            return shape
        mesh = self.meshes[self.stage_of[self.micro.values[v].producer]]
        return (math.prod(mesh.shape[a] for a in self.unreduced[v][0]),) + shape

    def _reduction_fn(self, r: _Program):
        """The program reducing a stage's unreduced accumulators once per step: the sum over
        their leading dimension (one all-reduce over its axes), times the microbatches' scale
        (``M ** e``), in the value's dtype and planned layout."""
        M = self.plan.microbatches
        scales = [self.boundary[v].scale(M) for v in r.accs]
        dtypes = [self._dtype_of(self.full, v) for v in r.accs]

        def fn(*accs):
            return [_combine(jnp.sum(a, axis=0), c, d)
                    for a, c, d in zip(accs, scales, dtypes)], []

        return fn

    def _equations(self, graph):
        key = id(graph)
        cache = self.__dict__.setdefault("_eqn_cache", {})
        if key not in cache:
            cache[key] = equations(graph.jaxpr)
        return cache[key]

    def _constant_env(self, graph) -> dict:
        return dict(zip(graph.constants, constant_values(graph.jaxpr)))

    def _compile_programs(self) -> None:
        g = self.full
        shard: dict[tuple[int, int], object] = {}  # (stage, value) -> sharding it arrives in
        input_index = {v: i for i, v in enumerate(g.inputs)}
        jaxpr_avals = {v: a for v, a in zip(g.inputs, g.jaxpr.in_avals)}
        micro_avals = {v: a for v, a in zip(self.micro.inputs, self.micro.jaxpr.in_avals)}

        def target(k, v):
            s = self._sharding(k, v)
            if s is None and v in input_index:
                i = input_index[v]
                s = self._placed(k, v, self.plan.inputs[i].spec if self.holder.get(i) == k
                                 else None)
            return s

        def abstract(k, v, graph, sharding):
            if v in (jaxpr_avals if graph is g else micro_avals):
                a = (jaxpr_avals if graph is g else micro_avals)[v]
                return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                            weak_type=getattr(a, "weak_type", False))
            val = graph.values[v]
            dtype = self._dtype_of(graph, v)
            return jax.ShapeDtypeStruct(val.shape, dtype, sharding=sharding)

        self._acc_sharding = {}
        produced: dict[int, tuple[int, object]] = {}  # value -> (stage, sharding) as produced
        M = self.plan.microbatches

        def compile_one(p: _Program, key):
            k = p.stage
            for v in p.accs:
                if v in self._acc_sharding:
                    continue
                s = self._sharding(k, v) or NamedSharding(self.meshes[k], PartitionSpec())
                if v in self.unreduced:  # one row per device over the axes, the rest as planned
                    axes = self.unreduced[v][0]
                    rest = list(s.spec) + [None] * (len(self.micro.values[v].shape) - len(s.spec))
                    s = NamedSharding(self.meshes[k], PartitionSpec(
                        axes[0] if len(axes) == 1 else tuple(axes), *rest))
                self._acc_sharding[v] = s
            if k not in self.local_stages:  # another process runs it
                return
            ins = []
            for v in p.reads:
                src = produced.get(v)
                if src is not None and src[0] == k and self._sharding(k, v) is None:
                    s = src[1]  # stays on this stage: as its producer left it
                else:
                    s = target(k, v) or self._placed(k, v)
                shard[(k, v)] = s
                ins.append(abstract(k, v, p.graph, s))
            accs = []
            for v in p.accs:
                s = self._acc_sharding[v]
                accs.append(jax.ShapeDtypeStruct(self._acc_shape(v), jnp.float32, sharding=s))
            reduces = p in self.reductions
            outs = []
            for v in p.writes:
                s = self._out_sharding(k, v)
                outs.append(NamedSharding(self.meshes[k], PartitionSpec())
                            if s is None and reduces else s)
            fn = self._reduction_fn(p) if reduces else self._program_fn(p)
            donate = tuple(range(len(ins), len(ins) + len(accs)))
            donate += tuple(j for j in p.donate if j < len(ins))
            new_sh = [] if reduces else [self._acc_sharding[v] for v in p.accs]
            jitted = jax.jit(fn, out_shardings=(outs, new_sh), donate_argnums=donate)
            compiled = jitted.lower(*ins, *accs).compile()
            p.compiled = compiled
            self.programs[key] = compiled
            out_sh, _ = compiled.output_shardings
            for v, s in zip(p.writes, out_sh):
                produced[v] = (k, s)

        order = [(k, F) for k in range(len(self.plan.stages)) if (k, F) in self.per_mb]
        order += [(k, B) for k in reversed(range(len(self.plan.stages))) if (k, B) in self.per_mb]
        for key in order:
            compile_one(self.per_mb[key], key)
        for r in self.reductions:
            compile_one(r, (r.stage, r.name))
        if M > 1:
            for v in self.boundary:
                prod = self.micro.values[v].producer
                k = self.stage_of[prod]
                if v in self.unreduced:  # the reduction's result, as planned
                    s = self._sharding(k, v) or self._placed(k, v)
                else:
                    s = self._acc_sharding.get(v) or self._sharding(k, v) or \
                        produced.get(v, (k, self._placed(k, v)))[1]
                produced[v] = (k, s)
        self._donations()
        for seg in self.segments:
            compile_one(seg, (seg.stage, seg.name))
        self._produced = produced

    def _dtype_of(self, graph, v):
        return self._value_dtypes(graph)[v]

    def _value_dtypes(self, graph):
        cache = self.__dict__.setdefault("_dtype_cache", {})
        if id(graph) not in cache:
            dt = {}
            for v, a in zip(graph.inputs, graph.jaxpr.in_avals):
                dt[v] = a.dtype
            for e, n in zip(self._equations(graph), graph.nodes):
                for o, ov in zip(n.outputs, e.eqn.outvars):
                    dt[o] = ov.aval.dtype
            for v in graph.constants:
                dt.setdefault(v, None)
            cache[id(graph)] = dt
        return cache[id(graph)]

    def _out_sharding(self, k: int, v: int):
        g = self.full
        carried = {g.outputs[o]: i for i, o in g.carried.items()}
        if v in carried and self.holder.get(carried[v]) == k:
            return self._placed(k, v, self.plan.inputs[carried[v]].spec)
        return self._sharding(k, v)

    def _donations(self) -> None:
        """Give each held state leaf's buffer to the update segment writing its new value, when
        no later program reads it."""
        if not self.donate:
            return
        g = self.full
        last_read: dict[int, int] = {}
        for j, seg in enumerate(self.segments):
            for v in seg.reads:
                last_read[v] = j
        for i, o in g.carried.items():
            vin, vout = g.inputs[i], g.outputs[o]
            if vout is None:
                continue
            prod = g.values[vout].producer
            for j, seg in enumerate(self.segments):
                if prod in seg.nodes and vin in seg.reads and last_read.get(vin) == j \
                        and self.holder.get(i) == seg.stage:
                    seg.donate = seg.donate + (seg.reads.index(vin),)

    # ---- running ----------------------------------------------------------------------------
    def __call__(self, *args):
        self.compile(*args)
        leaves = self._check_args(args)
        g, plan = self.full, self.plan
        M = plan.microbatches
        job = jax.process_count() > 1
        for x, t in zip(leaves, plan.inputs):
            if isinstance(x, jax.Array) and x.is_deleted():
                raise DonatedArgumentError(
                    f"argument {t.path!r} has been deleted: its buffer was donated to an earlier "
                    f"call of this step. Pass the state the step returned, or emit with "
                    f"donate=False.")
        self.crossings = []
        # Values this process received from another one in this call and has not waited for yet
        # (by id, kept alive while listed): the only inputs a program waits for before it is
        # dispatched (see _run).
        self._arrivals: dict[int, jax.Array] = {}
        env: dict[int, object] = {}
        # State leaves on the stage holding them (passed through when already in place).
        donated = set()
        if self.donate:
            for seg in self.segments:
                donated.update(seg.reads[j] for j in seg.donate)
        for i, (x, t) in enumerate(zip(leaves, plan.inputs)):
            k = self.holder.get(i)
            if k is None:
                continue
            v = g.inputs[i]
            s = self._placed(k, v, t.spec)
            in_place = isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
            if in_place and not (v in donated and any(y is x for y in leaves[:i])):
                env[v] = x
            elif k not in self.local_stages:  # the same value is placed by its holder
                env[v] = transfer.placeholder(t.shape, leaf_aval(x).dtype, s)
            else:
                x = self._host_view(x, t.path) if job and not in_place else x
                env[v] = place_copy(x, s, force=v in donated and isinstance(x, jax.Array))
        data = {g.inputs[i]: (self._host_view(x, plan.inputs[i].path) if job else x)
                for i, x in enumerate(leaves) if self.holder.get(i) is None}
        for v, x in data.items():  # data no microbatch splits is the same for every one
            if g.inputs.index(v) not in self.split_inputs:
                env[v] = x
        moved: dict[tuple[int, int], object] = {}  # per-step copies on other stages

        def fetch(k, v, local, local_moved=None):
            if v in local:
                x = local[v]
            elif v in env:
                x = env[v]
            else:
                raise InvalidPlanError(f"value {v} is read on stage {k} before it is computed; "
                                       f"re-plan.")
            want = self._want(k, v)
            if _on(x, want):
                return x
            copies = moved if v in env else local_moved
            key = (k, v)
            if copies is not None and key in copies:
                return copies[key]
            sent = len(self.crossings)
            y = transfer.move(x, want, self.crossings)
            if len(self.crossings) > sent or id(x) in self._arrivals:
                self._arrivals[id(y)] = y  # from another process (or a copy of such a value)
            if copies is not None:
                copies[key] = y
            return y

        micro_envs = [dict() for _ in range(M)]
        micro_moved: list[dict] = [dict() for _ in range(M)]  # per microbatch: (stage, value) copies
        b = None
        for m in range(M):
            for v, x in data.items():
                i = g.inputs.index(v)
                if i in self.split_inputs:
                    b = x.shape[0] // M
                    micro_envs[m][v] = x[m * b:(m + 1) * b]
                else:
                    micro_envs[m][v] = x
        accs: dict[int, object] = {}
        for p in self.per_mb.values():
            for v in p.accs:
                s = self._acc_sharding[v]
                shape = self._acc_shape(v)
                accs[v] = jnp.zeros(shape, jnp.float32, device=s) if p.stage in self.local_stages \
                    else transfer.placeholder(shape, jnp.float32, s)
        kept: dict[int, list] = defaultdict(list)  # concat boundaries, per microbatch

        def finish(v):
            """Combine a value of the step over the microbatches: sums scaled by M ** e,
            per-example results concatenated, independent values from the last microbatch."""
            c = self.boundary[v]
            dtype = self._dtype_of(self.full, v)
            here = self.stage_of[self.micro.values[v].producer] in self.local_stages
            if c.kind not in ("sum", "concat"):  # "same": any microbatch's
                env[v] = micro_envs[-1][v]
            elif not here:  # combined by the process holding its stage
                src = accs[v] if c.kind == "sum" else kept[v][0]
                env[v] = transfer.placeholder(self.full.values[v].shape, dtype, src.sharding)
            elif c.kind == "sum":
                env[v] = _combine(accs[v], c.scale(M), dtype)
            else:
                env[v] = (jnp.concatenate(kept[v], axis=c.dim) * c.scale(M)).astype(dtype)

        # Values of the step (parameters) that another stage's programs read go first, as the
        # cost model has them: at the start of the step, before any microbatch's activations.
        for k, v in self.step_sends:
            if v in env:
                fetch(k, v, {})
        for k, ph, m in self.order:
            p = self.per_mb[(k, ph)]
            local = micro_envs[m]
            # Every process fetches (values crossing processes need every process), only the
            # stage's own process runs the program.
            args_ = [fetch(k, v, local, micro_moved[m]) for v in p.reads]
            outs, new = self._run(p, args_, [accs[v] for v in p.accs])
            for v, x in zip(p.writes, outs):
                local[v] = x
                c = self.boundary.get(v)
                if c is not None and c.kind == "concat":
                    kept[v].append(x)
            for v, x in zip(p.accs, new):
                accs[v] = x
            for k2, v in self.sends.get((k, ph), ()):
                if not transfer.relayout_on_arrival(local[v], self._want(k2, v)):
                    fetch(k2, v, local, micro_moved[m])
            for v in self.release.get((k, ph), ()):
                local.pop(v, None)
            for v in self.release_moved.get((k, ph), ()):
                micro_moved[m].pop((k, v), None)
            if M > 1 and m == M - 1:  # values of the step this program ends: on to the update
                for v in self.finals.get((k, ph), ()):
                    finish(v)
                    for k2 in self.final_readers.get(v, ()):
                        fetch(k2, v, {})
            for r in self.reduce_after.get((k, ph, m), ()):  # the stage's last program: reduce
                outs, _ = self._run(r, [], [accs.pop(v) for v in r.accs])
                for v, x in zip(r.writes, outs):
                    env[v] = x
                    for k2 in self.final_readers.get(v, ()):
                        fetch(k2, v, {})
        if M > 1:
            for v in self.boundary:
                if v not in env:
                    finish(v)
        else:
            env.update({v: x for v, x in micro_envs[0].items() if v not in data})
        for seg in self.segments:
            args_ = [fetch(seg.stage, v, {}) for v in seg.reads]
            outs, _ = self._run(seg, args_, [])
            env.update(zip(seg.writes, outs))
        result = []
        for v in g.outputs:
            if v is None:
                result.append(transfer.move(np.zeros((), np.float32), NamedSharding(
                    self.meshes[0], PartitionSpec())) if job else jnp.zeros((), jnp.float32))
                continue
            x = env.get(v, data.get(v))
            if x is None and v in micro_envs[0]:
                x = micro_envs[0][v]
            result.append(x)
        if job:  # return once every process holds what it was sent (see transfer.settle)
            transfer.settle(result)
        return jax.tree_util.tree_unflatten(plan.out_tree, result)

    def _run(self, p: _Program, args, accs):
        """``(outputs, accumulators)`` of one program: run here if this process holds its stage,
        else placeholders laid out on the stage's devices."""
        if p.stage in self.local_stages:
            if jax.process_count() > 1:
                # Never queue a program on values still in transit from another process
                # (transfer module docstring: the job deadlocks). Values of this process's own
                # programs are not waited for: a host blocked on its own compute posts no
                # receive behind it, and a receive starts the transfer (the bytes are pulled), so
                # a transfer into this process could not start before its earlier programs ended.
                arriving = [x for x in args if id(x) in self._arrivals]
                if arriving:
                    jax.block_until_ready(arriving)
                    for x in arriving:  # here now: not held for the rest of the step
                        self._arrivals.pop(id(x), None)
            return p.compiled(*args, *accs)
        outs = [transfer.placeholder(
                    p.graph.values[v].shape, self._dtype_of(p.graph, v),
                    self._out_sharding(p.stage, v) or self._placed(p.stage, v))
                for v in p.writes]
        return outs, list(accs)

    @staticmethod
    def _host_view(x, path: str):
        """An argument of a multi-process call as a host value (the same on every process):
        a numpy array for arrays on this process's devices."""
        if not isinstance(x, jax.Array):
            return x
        if not x.is_fully_addressable:
            raise UnsupportedStepError(
                f"argument {path!r} is a jax.Array on other processes' devices "
                f"({sorted(transfer.processes(x.sharding))}) that the staged plan does not hold "
                f"there. In a multi-process job pass the same host values (numpy) on every "
                f"process, or the state the step returned.")
        try:
            return np.asarray(x)
        except (TypeError, ValueError):  # PRNG key arrays stay as they are
            return x

    def _want(self, k: int, v: int):
        s = self._sharding(k, v)
        if s is not None:
            return s
        prod = self._produced.get(v)
        if prod is not None and prod[0] == k:
            return prod[1]
        g = self.full
        if v in g.inputs:
            i = g.inputs.index(v)
            if self.holder.get(i) == k:
                return self._placed(k, v, self.plan.inputs[i].spec)
        return self._placed(k, v)

    def _all_programs(self) -> list[_Program]:
        return list(self.per_mb.values()) + self.reductions + self.segments

    def _compiled(self) -> list[_Program]:
        return [p for p in self._all_programs() if p.compiled is not None]

    def program_collectives(self) -> dict[str, list[Collective]]:
        """``{program: collectives}`` read from each compiled stage program's HLO (names
        ``"F0"``, ``"B1"``, ``"R1"``, ``"U0"``, ...); axes are those of the program's stage
        mesh. A microbatch program's collectives run once per microbatch, a reduction's and an
        update's once per step. In a multi-process job: the programs of the stages this process
        holds."""
        if not self._built:
            raise NotCompiledError(
                f"{type(self).__name__}.program_collectives(): the step is not compiled yet (it "
                "compiles on its first call). Call it once, step(*args), or compile it without "
                "running it: step.compile(*args).")
        out = {}
        for p in self._compiled():
            mesh = self.meshes[p.stage]
            out[p.name] = collectives_from_hlo(p.compiled.as_text(),
                                               tuple(mesh.devices.shape), tuple(mesh.axis_names))
        return out

    def collectives(self) -> list[Collective]:
        """Every compiled program's collectives, once per execution in a step (microbatch
        programs ``microbatches`` times), axes named ``"s<stage>/<axis>"``."""
        out = []
        progs = {p.name: p for p in self._all_programs()}
        for name, colls in self.program_collectives().items():
            p = progs[name]
            times = self.plan.microbatches if p in self.per_mb.values() else 1
            for c in colls:
                out += [dataclasses.replace(c, axes=tuple(f"s{p.stage}/{a}" for a in c.axes))
                        ] * times
        return out

    def memory_per_device(self) -> float:
        """The largest per-device footprint of one compiled program (arguments + temporaries +
        results - aliased), bytes: what XLA says a stage needs while one program runs (in a
        multi-process job: of the stages this process holds)."""
        best = 0.0
        for p in self._compiled():
            ma = p.compiled.memory_analysis()
            best = max(best, ma.argument_size_in_bytes + ma.temp_size_in_bytes
                       + ma.output_size_in_bytes - ma.alias_size_in_bytes)
        return best


def _on(x, sharding) -> bool:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and \
        x.sharding.is_equivalent_to(sharding, x.ndim)


def _partial_sums(mesh, axes: tuple[str, ...], operands: dict[int, int], prim, invals, params):
    """A sum over examples (``prim`` on ``invals``; ``operands``: the batch dimensions of the
    operands it reads example by example) left unreduced over mesh ``axes``: the per-device
    partial sums, stacked along a new leading dimension split over ``axes``.

    Each device runs the operator on its piece of the batch inside ``jax.shard_map``, manual
    over ``axes`` only (the partitioner still lays out the other axes, and makes the operator's
    collectives over them), the operands independent of the batch whole over ``axes``: no
    collective over ``axes``. The pieces' results add up to the operator's result
    (:func:`~hulkjax.trace.microbatch.sum_over_examples`). A mesh with ``Explicit`` axes could
    say the same with ``unreduced`` shardings; the stages' meshes have ``Auto`` axes (the
    plan's layouts are hints the partitioner completes), where JAX 0.10 refuses them."""
    entry = axes[0] if len(axes) == 1 else tuple(axes)
    specs = tuple(PartitionSpec(*([None] * operands[k]), entry) if k in operands
                  else PartitionSpec() for k in range(len(invals)))
    bind_params = prim.get_bind_params(params)

    def per_shard(*xs):
        out = prim.bind(*xs, **bind_params)
        return (out[0] if prim.multiple_results else out)[None]

    return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=PartitionSpec(entry),
                         axis_names=frozenset(axes), check_vma=False)(
        *(jnp.asarray(x) for x in invals))


def _combine(acc, scale: float, dtype):
    return (acc * scale).astype(dtype) if scale != 1.0 else acc.astype(dtype)



