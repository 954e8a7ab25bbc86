"""``hj.emit``: a plan's program, SPMD or staged.

>>> import hulkjax as hj, jax.numpy as jnp
>>> topo = hj.Topology.grid((8,), ("d",))
>>> f = lambda w, x: (x @ w).sum()
>>> type(emit(f, hj.plan(f, jnp.ones((4, 4)), jnp.ones((8, 4)), topology=topo, strategy="dp")))
<class 'hulkjax.emit.spmd.ShardedStep'>
"""

from __future__ import annotations

from collections.abc import Callable

from hulkjax.emit.mpmd import StagedStep
from hulkjax.emit.spmd import ShardedStep
from hulkjax.emit.spmd import emit as emit_spmd
from hulkjax.errors import InvalidPlanError
from hulkjax.plan.records import Plan


def emit(fn: Callable, plan: Plan, *, donate: bool = True, mesh=None) -> ShardedStep | StagedStep:
    """Build the program for ``plan`` (compiled on the first call or by ``.compile(*args)``).

    SPMD plans (``plan.stages is None``) become one :class:`~hulkjax.emit.spmd.ShardedStep`;
    staged plans a :class:`~hulkjax.emit.mpmd.StagedStep`: one program per stage and phase on
    the stage's sub-mesh, ``jax.device_put`` between stages and a host-driven schedule.

    Args:
      fn: the step the plan was made for.
      plan: a :class:`Plan` from :func:`hulkjax.plan` or ``Plan.load``.
      donate: donate the state buffers the step carries to its results.
      mesh: SPMD plans only: use this mesh instead of ``plan.topology.mesh()``.
    """
    if isinstance(plan, Plan) and plan.stages is not None:
        if mesh is not None:
            raise InvalidPlanError("a staged plan runs on sub-meshes of its topology's devices; "
                                   "mesh= applies to SPMD plans only.")
        return StagedStep(fn, plan, donate=donate)
    return emit_spmd(fn, plan, donate=donate, mesh=mesh)
