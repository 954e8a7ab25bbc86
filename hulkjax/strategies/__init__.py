"""Planners, registered by name: each is ``(graph, topology, options) -> Plan``.

Where this sits::

    cost + gnn  ->  strategies (this package)  ->  explain  ->  api

Built-ins: the baselines (``replicate``, ``dp``, ``fsdp``, ``megatron``, ``dp_tp``, ``expert``,
``zero``), ``ilp`` (the cost model's exact optimum) and ``auto`` (the learned planner: GNN prior +
search). Every planner ends in :func:`~hulkjax.strategies.realize.plan_from_assignment`, so every
plan is judged by the one cost model (:func:`cost_model`; a plan's own: :func:`plan_cost_model`).

>>> import hulkjax as hj
>>> hj.strategies.names()
['replicate', 'dp', 'fsdp', 'megatron', 'dp_tp', 'expert', 'zero', 'pipeline', 'ilp', 'auto']
"""

from hulkjax.strategies import auto as _auto  # noqa: F401  (registers "auto")
from hulkjax.strategies import baselines as _baselines  # noqa: F401  (registers the baselines)
from hulkjax.strategies import ilp as _ilp  # noqa: F401  (registers "ilp")
from hulkjax.strategies import stages as _stages  # noqa: F401  (registers "pipeline")
from hulkjax.strategies.auto import AutoOptions as AutoOptions
from hulkjax.strategies.auto import predict as predict
from hulkjax.strategies.baselines import BASELINES as BASELINES
from hulkjax.strategies.baselines import baseline_assignments as baseline_assignments
from hulkjax.strategies.ilp import ILPOptions as ILPOptions
from hulkjax.strategies.loops import cost_model as cost_model
from hulkjax.strategies.realize import plan_cost_model as plan_cost_model
from hulkjax.strategies.registry import Strategy as Strategy
from hulkjax.strategies.registry import get_strategy as get_strategy
from hulkjax.strategies.registry import names as names
from hulkjax.strategies.registry import option_fields as option_fields
from hulkjax.strategies.registry import options_of as options_of
from hulkjax.strategies.registry import register_strategy as register_strategy
from hulkjax.strategies.registry import run_planner as run_planner
from hulkjax.strategies.registry import strategies as strategies
from hulkjax.strategies.specbuilder import SpecBuilder as SpecBuilder
from hulkjax.strategies.stages import PipelineOptions as PipelineOptions
