"""A baseline's input layouts, completed and costed by the shared cost model.

A baseline says how the step's arguments are laid out (:mod:`hulkjax.strategies.layouts`);
:meth:`SpecBuilder.build` completes every operator from those layouts as a propagating partitioner
would and costs the result with the one cost model every planner uses.

>>> import jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((4, 4)), jnp.ones((8, 4)))
>>> sb = SpecBuilder(g, hj.Topology.grid((8,), ("d",)), "mine")
>>> sb.set_input(1, sb.dim_spec((8, 4), 0, ("d",)))
>>> [t.spec for t in sb.build().inputs]
[P(), P('d',)]
"""

from __future__ import annotations

from hulkjax.plan.records import Plan
from hulkjax.strategies.layouts import InputLayouts
from hulkjax.strategies.realize import (
    assignment_for_inputs,
    cost_model,
    plan_from_assignment,
    state_apart,
)
from hulkjax.strategies.search import finish_sums, propagate, sequence_parallel


def complete(cm, input_specs, *, param_use: str = "keep",
             gather_axes: tuple[str, ...] | None = None) -> list[int]:
    """The cost-model assignment of input layouts (one ``PartitionSpec`` per argument), completed
    as a propagating partitioner completes them (:func:`~hulkjax.strategies.search.propagate`);
    where optimizer state is laid out apart from its parameter (``cm`` must then be the model
    with ``optimizer_apart``), each split operator's sum is finished onto the state's layout where
    that is cheaper (:func:`~hulkjax.strategies.search.finish_sums`: ZeRO's reduce-scatter, which
    propagation in program order, all-reducing before it meets the state, does not find)."""
    a = propagate(cm, assignment_for_inputs(cm, input_specs), param_use=param_use,
                  gather_axes=gather_axes)
    return finish_sums(cm, a) if state_apart(cm.graph, input_specs) else a


class SpecBuilder(InputLayouts):
    """Input layouts (see :class:`~hulkjax.strategies.layouts.InputLayouts`) that build a plan."""

    def assignment(self) -> list[int]:
        """The cost-model assignment: these input layouts (optimizer state following its
        parameter, or laid out apart in :attr:`state_specs`) completed by :func:`complete`,
        and sequence parallelism over :attr:`sequence_axes` where it is set."""
        return self._complete()[0]

    def _complete(self) -> tuple[list[int], int]:
        g = self.graph
        for opt, param in g.state_pairs():
            self.input_specs[opt] = self.state_specs.get(opt, self.input_specs[param])
        cm = cost_model(g, self.topology, optimizer_apart=self.optimizer_apart)
        a = complete(cm, self.input_specs, param_use=self.param_use, gather_axes=self.gather_axes)
        if not self.sequence_axes:
            return a, 0
        return sequence_parallel(cm, a, self.sequence_axes)

    def build(self) -> Plan:
        """The plan of :meth:`assignment`, costed by the shared cost model."""
        assignment, reduced = self._complete()
        notes = list(self.notes)
        if self.sequence_axes:
            notes.append(f"sequence parallel over {self.sequence_axes}: {reduced} tensor-parallel "
                         f"sum(s) reduce-scattered onto the sequence" if reduced else
                         f"no sequence parallelism: no tensor-parallel sum over "
                         f"{self.sequence_axes} has a (batch, sequence, features) result "
                         f"whose sequence they divide")
        return plan_from_assignment(
            cost_model(self.graph, self.topology, optimizer_apart=self.optimizer_apart),
            assignment, self.strategy, notes)
