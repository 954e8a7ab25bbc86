"""The public entry points: ``hulk_shard``, ``plan``, ``emit``, ``compare``. Orchestration only.

Where this sits::

    trace + topology  ->  strategies (planners)  ->  rules.support (unknown primitives)  ->  emit
                                         api (this module) strings them together

>>> import hulkjax as hj, jax.numpy as jnp
>>> @hj.hulk_shard(topology=hj.Topology.grid((8,), ("d",)), strategy="dp")
... def step(w, x):
...     return w - 0.1 * jnp.mean(x @ w, axis=0)
>>> step(jnp.ones((4, 4)), jnp.ones((8, 4))).shape
(4, 4)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import jax

from hulkjax.emit.dispatch import emit
from hulkjax.emit.mpmd import StagedStep
from hulkjax.emit.spmd import ShardedStep
from hulkjax.errors import HulkjaxError, StrategyNotApplicableError, UnsupportedStepError
from hulkjax.formatting import format_bytes, format_count, format_time
from hulkjax.plan.records import Plan
from hulkjax.rules.support import check_supported
from hulkjax.strategies.realize import plan_cost_model
from hulkjax.strategies.registry import names as strategy_names
from hulkjax.strategies.registry import options_of, run_planner
from hulkjax.strategies.specbuilder import complete
from hulkjax.strategies.stages import plan_cost as staged_plan_cost
from hulkjax.topology.model import resolve as resolve_topology
from hulkjax.trace.graph import OpGraph
from hulkjax.trace.tracer import argument_avals, leaf_aval, trace

log = logging.getLogger("hulkjax")

DEFAULT_STRATEGY = "auto"  # the learned planner (GNN prior + cost-model search)


def plan(fn: Callable, *args, topology, strategy: str = DEFAULT_STRATEGY, strict: bool = False,
         graph: OpGraph | None = None, **options) -> Plan:
    """Plan how to shard ``fn(*args)`` over ``topology`` (nothing is compiled or run).

    Args:
      fn: the training step.
      *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` leaves.
      topology: a :class:`hulkjax.Topology`, a preset name, or a topology JSON path.
      strategy: a registered strategy name (``hulkjax.strategies.names()``).
      strict: raise on operators without a sharding rule instead of replicating them.
      graph: an already traced graph of ``fn(*args)`` (skips tracing).
      **options: the planner's options (``hj.strategies.option_fields(strategy)`` lists them; an
        unknown one raises :class:`~hulkjax.errors.UnknownOptionError`).

    >>> import jax, hulkjax as hj, jax.numpy as jnp
    >>> def step(w, x):  # w is carried to the result and computes with x: a parameter
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> p = hj.plan(step, jnp.ones((8, 4)), jnp.ones((16, 8)),
    ...             topology=hj.Topology.grid((8,), ("d",)), strategy="fsdp")
    >>> p.in_specs
    (P('d',), P('d',))
    """
    topo = resolve_topology(topology)
    g = graph if graph is not None else trace(fn, *args)
    p = run_planner(strategy, g, topo, **options)
    check_supported(g, p, strict=strict, gather_cost=_gather_cost(p))
    return p


def _gather_cost(plan: Plan) -> Callable[[list], str]:
    """What replicating some operators forces, in the plan's own cost: the collectives that bring
    their operands to every device (a phrase for :func:`check_supported`'s warning)."""

    def cost(nodes) -> str:
        cm = plan_cost_model(plan.graph, plan.topology, plan)
        ids = {n.id for n in nodes}
        comms = [m.comm for m in cm.breakdown(plan.assignment, memory=False).moves
                 if m.node in ids and not m.repeat]
        if not comms:
            return "its operands were whole on every device already (no collective)"
        seconds = sum(cm.comm_time(c) for c in comms)
        return (f"gathering its operands costs {format_time(seconds)} per step "
                f"({format_count(len(comms), 'collective')}, {format_bytes(sum(c.bytes for c in comms))})")

    return cost


def estimate(fn: Callable, *args, plan: Plan | None = None, topology=None,
             strategy: str | None = None, **options):
    """The cost model's prediction (:class:`hulkjax.Cost`) for ``fn(*args)`` under a plan.

    Pass a ``plan`` (its topology is used), or a ``topology`` and a ``strategy`` to plan first. A
    plan made for this step reuses its choices; a loaded plan is re-completed from its argument
    layouts, as the baselines are.

    >>> import hulkjax as hj, jax.numpy as jnp
    >>> c = hj.estimate(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)),
    ...                 topology=hj.Topology.grid((8,), ("d",)), strategy="dp")
    >>> c.step_time > 0
    True
    """
    if plan is None:
        if topology is None or strategy is None:
            raise HulkjaxError("estimate needs plan=..., or topology=... and strategy=...")
        return globals()["plan"](fn, *args, topology=topology, strategy=strategy, **options).cost
    topo = plan.topology if topology is None else resolve_topology(topology)
    g = trace(fn, *args)
    if plan.stages is not None:
        return staged_plan_cost(g, topo, plan)
    cm = plan_cost_model(g, topo, plan)
    if plan.assignment is not None and plan.graph_fingerprint == g.fingerprint() \
            and plan.topology_fingerprint == topo.fingerprint():
        return cm.evaluate(plan.assignment)
    return cm.evaluate(complete(cm, [t.spec for t in plan.inputs]))


def compare(fn: Callable, *args, topology, strategies: Sequence[str] | None = None,
            **options) -> dict[str, Plan]:
    """One plan per strategy for the same step and topology (traced once).

    Strategies that do not apply to the topology (``dp_tp`` on a 1-D mesh) are left out with a
    log message.
    """
    topo = resolve_topology(topology)
    g = trace(fn, *args)
    out: dict[str, Plan] = {}
    for name in strategies or strategy_names():
        try:
            out[name] = plan(fn, *args, topology=topo, strategy=name, graph=g, **options)
        except StrategyNotApplicableError as e:
            log.info("skipping %s: %s", name, e)
    return out


class HulkShardedFunction:
    """A step decorated with :func:`hulk_shard`.

    The first call with given argument shapes traces, plans and compiles; later calls with the same
    shapes and dtypes reuse the compiled program; new shapes plan and compile again.

    Attributes:
      plan: the plan of the most recent call (``None`` before the first call).
      sharded: the :class:`ShardedStep` of the most recent call.
    """

    def __init__(self, fn: Callable, *, topology, strategy: str, strict: bool, donate: bool,
                 options: dict):
        options_of(strategy, **options)  # an unknown strategy or option fails here, not at call
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.topology = resolve_topology(topology)
        self.strategy = strategy
        self.strict = strict
        self.donate = donate
        self.options = options
        self._cache: dict = {}
        self.sharded: ShardedStep | StagedStep | None = None

    @property
    def plan(self) -> Plan | None:
        return None if self.sharded is None else self.sharded.plan

    def _key(self, args):
        """What ``jax.jit`` would cache on: the tree and every leaf's shape, dtype and weak type.

        A Python ``0`` and the weakly typed ``int32`` array the step returns for it have one key,
        so feeding a step its own result never plans or compiles again.
        """
        leaves, tree = jax.tree_util.tree_flatten(args)
        try:
            avals = [leaf_aval(x) for x in leaves]
        except OverflowError:
            avals = [None]
        if any(a is None for a in avals):
            argument_avals(self.fn, args)  # raises the error naming the leaf's path
        return tree, tuple((a.shape, str(a.dtype), a.weak_type) for a in avals)

    def get_sharded(self, *args) -> ShardedStep | StagedStep:
        """The compiled step for these arguments (planning and compiling on a cache miss)."""
        key = self._key(args)
        step = self._cache.get(key)
        if step is None:
            p = plan(self.fn, *args, topology=self.topology, strategy=self.strategy,
                     strict=self.strict, **self.options)
            step = emit(self.fn, p, donate=self.donate)
            step.compile(*args)
            self._cache[key] = step
        self.sharded = step
        return step

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise UnsupportedStepError(
                f"{self.__name__} was called with keyword arguments {sorted(kwargs)}; hulk_shard "
                f"steps take positional pytrees of arrays. Bind static settings with functools.partial.")
        return self.get_sharded(*args)(*args)

    def summary(self) -> str:
        """The current plan's summary (call the step first)."""
        if self.plan is None:
            return f"{self.__name__}: not planned yet (call it once)"
        return self.plan.summary()

    def collectives(self):
        """Collectives of the current compiled program."""
        if self.sharded is None:
            raise RuntimeError("call the step once first")
        return self.sharded.collectives()


def hulk_shard(fn: Callable | None = None, *, topology, strategy: str = DEFAULT_STRATEGY,
               strict: bool = False, donate: bool = True, **options):
    """Decorate a training step so that it runs sharded over ``topology``.

    Args:
      fn: the step ``train_step(state, batch) -> (state, metrics)`` (pure, positional pytrees).
      topology: a :class:`hulkjax.Topology`, preset name or topology JSON path.
      strategy: a registered strategy name.
      strict: raise on operators without a sharding rule instead of replicating them.
      donate: donate the state buffers (the step's carried inputs) to the new state.
      **options: the planner's options (checked here: an unknown one raises
        :class:`~hulkjax.errors.UnknownOptionError`).
    """
    def wrap(f):
        return HulkShardedFunction(f, topology=topology, strategy=strategy, strict=strict,
                                   donate=donate, options=options)

    return wrap if fn is None else wrap(fn)


__all__ = ["hulk_shard", "plan", "emit", "compare", "estimate", "HulkShardedFunction", "ShardedStep",
           "StagedStep"]
