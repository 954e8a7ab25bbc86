"""What a plan does, layer by layer: layouts, collectives on each link class, time and memory.

Where this sits::

    strategies  ->  explain (this package)  ->  api | cli | viz

    Plan (graph + assignment + topology) --> cost model records --> explanation(plan): Explanation
                                                                           |
                          explain(plan, fmt="text" | "markdown" | "rich")  +--> Plan.summary()
                                                                           +--> hulkjax explain

The rows are read from the cost model's records and add up to ``plan.cost``.

>>> import hulkjax as hj, jax.numpy as jnp
>>> plan = hj.plan(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((128, 64)),
...                topology=hj.Topology.grid((8,), ("d",)), strategy="fsdp")
>>> explain(plan, fmt="markdown").splitlines()[0]
"### Plan 'fsdp' on grid-8 (mesh d=8)"
"""

from hulkjax.explain.model import BATCH as BATCH
from hulkjax.explain.model import CONSTANTS as CONSTANTS
from hulkjax.explain.model import OPTIMIZER_ROW as OPTIMIZER_ROW
from hulkjax.explain.model import UNSCOPED as UNSCOPED
from hulkjax.explain.model import Attribution as Attribution
from hulkjax.explain.model import AxisInfo as AxisInfo
from hulkjax.explain.model import Charge as Charge
from hulkjax.explain.model import CollectiveUse as CollectiveUse
from hulkjax.explain.model import Explanation as Explanation
from hulkjax.explain.model import LayerRow as LayerRow
from hulkjax.explain.model import attribute as attribute
from hulkjax.explain.model import explanation as explanation
from hulkjax.explain.model import layer_label as layer_label
from hulkjax.explain.render import explain as explain
from hulkjax.explain.render import render_markdown as render_markdown
from hulkjax.explain.render import render_rich as render_rich
from hulkjax.explain.render import render_text as render_text
from hulkjax.explain.render import summary_section as _summary_section
from hulkjax.plan.records import register_summary_section as _register_summary_section

_register_summary_section(_summary_section)
