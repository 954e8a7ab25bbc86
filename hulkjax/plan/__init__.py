"""The plan vocabulary: records only, no behaviour that plans or costs.

Where this sits::

    trace | topology  ->  plan (this package)  ->  rules | emit  ->  cost  ->  strategies  -> ...

What every layer above shares: layouts (:mod:`~hulkjax.plan.specs`), collective kinds
(:mod:`~hulkjax.plan.collectives`), the cost record (:class:`Cost`) and the plan records
(:class:`Plan`, :class:`TensorPlan`, :class:`BodyPlan`, :class:`Stage`) with their JSON form.

>>> from hulkjax.plan import Plan, to_pspec
>>> to_pspec(((), ("data",)))
P(None, 'data')
"""

from hulkjax.plan.collectives import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from hulkjax.plan.collectives import Comm as Comm
from hulkjax.plan.cost import Cost as Cost
from hulkjax.plan.cost import PredictedCollective as PredictedCollective
from hulkjax.plan.cost import StageTime as StageTime
from hulkjax.plan.cost import Transfer as Transfer
from hulkjax.plan.records import BodyPlan as BodyPlan
from hulkjax.plan.records import Plan as Plan
from hulkjax.plan.records import TensorPlan as TensorPlan
from hulkjax.plan.records import register_summary_section as register_summary_section
from hulkjax.plan.specs import Spec as Spec
from hulkjax.plan.specs import from_pspec as from_pspec
from hulkjax.plan.specs import replicated as replicated
from hulkjax.plan.specs import to_pspec as to_pspec
from hulkjax.plan.stages import SCHEDULES as SCHEDULES
from hulkjax.plan.stages import Stage as Stage
