"""hulkjax: topology-aware auto-sharding for JAX training steps.

The public names only; the layers behind them are drawn in ``docs/architecture.md``.

>>> import hulkjax as hj
>>> hj.strategies.names()[:2]
['replicate', 'dp']
"""

from hulkjax import errors as errors
from hulkjax import gnn as gnn
from hulkjax import rules as rules
from hulkjax import strategies as strategies
from hulkjax import viz as viz
from hulkjax.api import HulkShardedFunction as HulkShardedFunction
from hulkjax.api import compare as compare
from hulkjax.api import estimate as estimate
from hulkjax.api import hulk_shard as hulk_shard
from hulkjax.api import plan as plan
from hulkjax.emit import Collective as Collective
from hulkjax.emit import ShardedStep as ShardedStep
from hulkjax.emit import StagedStep as StagedStep
from hulkjax.emit import emit as emit
from hulkjax.errors import HulkjaxError as HulkjaxError
from hulkjax.explain import explain as explain
from hulkjax.plan import Cost as Cost
from hulkjax.plan import Plan as Plan
from hulkjax.plan import Stage as Stage
from hulkjax.topology import DeviceSpec as DeviceSpec
from hulkjax.topology import LinkSpec as LinkSpec
from hulkjax.topology import Topology as Topology
from hulkjax.trace import OpGraph as OpGraph
from hulkjax.trace import trace as trace

__version__ = "0.1.0"

