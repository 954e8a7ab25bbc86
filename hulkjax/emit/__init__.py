"""Emission: a Plan becomes compiled multi-device programs; the compiled HLO is read back.

SPMD plans become one program (:mod:`hulkjax.emit.spmd`); staged plans one program per stage
and phase with transfers between them (:mod:`hulkjax.emit.mpmd`). :func:`emit` picks.
"""

from hulkjax.emit.dispatch import emit as emit
from hulkjax.emit.hlo import Collective as Collective
from hulkjax.emit.hlo import collectives_from_hlo as collectives_from_hlo
from hulkjax.emit.hlo import summarize as summarize
from hulkjax.emit.mpmd import StagedStep as StagedStep
from hulkjax.emit.spmd import ShardedStep as ShardedStep
