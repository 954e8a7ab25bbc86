"""Per-primitive rule tables: how an operator runs for given layouts, and which operators are known.

Where this sits::

    trace | topology -> plan -> rules (this package) -> cost -> strategies -> ...

Pure tables keyed by primitive, as JAX keys its lowering and batching rules; nothing here plans or
costs. Each table has a public registrar, and a rule registered for a primitive hulkjax did not
know is honoured by the cost model and the emitter:

* :func:`register_dim_rule` (or :func:`register_sharding_rule`): where an operand's dimension goes
  in the result. A follower with only a dimension rule keeps its lead operand's layout through it.
* :func:`register_follow_rule`: how a follower runs for its lead operand's layout.
* :func:`register_candidate_rule`: every way a leader (a matmul-like operator) can run.
* :func:`register_loop_rule`: how a control-flow primitive's operands map onto its bodies.
* :func:`register_flops`: an operator's FLOPs (for the roofline).

An operator whose primitive no rule covers is replicated by the emitter, with one warning naming
the primitive (strict mode raises :class:`~hulkjax.errors.UnsupportedPrimitiveError`); operators
inside loop bodies are checked too.

>>> import hulkjax as hj
>>> sorted(n for n in dir(hj.rules) if n.startswith("register_"))[:3]
['register_candidate_rule', 'register_dim_rule', 'register_flops']
"""

from hulkjax.rules.dims import CONTRACTED as CONTRACTED
from hulkjax.rules.dims import dim_rules as dim_rules
from hulkjax.rules.dims import dot_partner as dot_partner
from hulkjax.rules.dims import map_dim as map_dim
from hulkjax.rules.dims import register_dim_rule as register_dim_rule
from hulkjax.rules.leaders import is_leader as is_leader
from hulkjax.rules.leaders import leader_candidates as leader_candidates
from hulkjax.rules.loops import Boundary as Boundary
from hulkjax.rules.loops import LoopResolution as LoopResolution
from hulkjax.rules.loops import loop_rules as loop_rules
from hulkjax.rules.loops import register_loop_rule as register_loop_rule
from hulkjax.rules.sharding import Mesh as Mesh
from hulkjax.rules.sharding import Resolution as Resolution
from hulkjax.rules.sharding import candidate_rules as candidate_rules
from hulkjax.rules.sharding import follow_rules as follow_rules
from hulkjax.rules.sharding import register_candidate_rule as register_candidate_rule
from hulkjax.rules.sharding import register_follow_rule as register_follow_rule
from hulkjax.rules.support import check_supported as check_supported
from hulkjax.rules.support import handling as handling
from hulkjax.rules.support import is_supported as is_supported
from hulkjax.rules.support import register_sharding_rule as register_sharding_rule
from hulkjax.trace.flops import register_flops as register_flops
