"""Per-primitive rules: how dimensions flow through an operator, and which operators are known.

An operator whose primitive no rule covers is replicated by the emitter, with one warning naming
the primitive (strict mode raises :class:`~hulkjax.errors.UnsupportedPrimitiveError`); operators
inside loop bodies are checked too. ``scan`` / ``while`` / ``cond`` are sharded through their
bodies by the loop rules (:mod:`hulkjax.rules.loops`).
"""

from hulkjax.rules.dims import (
    CONTRACTED as CONTRACTED,
)
from hulkjax.rules.dims import (
    dim_rules as dim_rules,
)
from hulkjax.rules.dims import (
    dot_partner as dot_partner,
)
from hulkjax.rules.dims import (
    map_dim as map_dim,
)
from hulkjax.rules.dims import (
    register_dim_rule as register_dim_rule,
)
from hulkjax.rules.loops import (
    loop_rules as loop_rules,
)
from hulkjax.rules.loops import (
    register_loop_rule as register_loop_rule,
)
from hulkjax.rules.support import (
    check_supported as check_supported,
)
from hulkjax.rules.support import (
    is_supported as is_supported,
)
from hulkjax.rules.support import (
    register_sharding_rule as register_sharding_rule,
)
