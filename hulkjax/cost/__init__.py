"""The cost model: compute (roofline), communication (alpha-beta per mesh axis), memory -> Cost.

Where this sits::

    rules | emit  ->  cost (this package)  ->  gnn  ->  strategies  ->  explain  ->  api

One :class:`CostModel` per (graph, topology) judges every planner. What a lower layer cannot know
(how to plan a loop's body) is injected: ``CostModel(graph, topology, loop_planner=...)``.

>>> import jax.numpy as jnp, hulkjax as hj
>>> g = hj.trace(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)))
>>> CostModel(g, hj.Topology.grid((8,), ("d",))).evaluate([0] * 4).comm_time
0.0
"""

from hulkjax.cost.comm import axis_bytes as axis_bytes
from hulkjax.cost.comm import collective_time as collective_time
from hulkjax.cost.comm import reshard_comms as reshard_comms
from hulkjax.cost.model import FREE as FREE
from hulkjax.cost.model import INPUT as INPUT
from hulkjax.cost.model import LEADER as LEADER
from hulkjax.cost.model import Breakdown as Breakdown
from hulkjax.cost.model import CostModel as CostModel
from hulkjax.cost.model import Group as Group
from hulkjax.cost.model import Local as Local
from hulkjax.cost.model import MemoryUse as MemoryUse
from hulkjax.cost.model import Move as Move
from hulkjax.cost.overlap import Overlap as Overlap
from hulkjax.cost.overlap import ScheduledCollective as ScheduledCollective
from hulkjax.cost.overlap import overlap as overlap
from hulkjax.plan.cost import Cost as Cost
from hulkjax.plan.cost import PredictedCollective as PredictedCollective
