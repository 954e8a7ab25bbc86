"""Errors and warnings raised by hulkjax.

Every error says what was wrong, shows the values, and says how to fix it. They all derive from
:class:`HulkjaxError`, so ``except hj.HulkjaxError`` catches anything hulkjax raises on bad input.

>>> import hulkjax as hj
>>> issubclass(hj.errors.InvalidTopologyError, hj.HulkjaxError)
True
"""

from __future__ import annotations


class HulkjaxError(Exception):
    """Base class of every error hulkjax raises on bad input or an impossible request."""


class InvalidTopologyError(HulkjaxError, ValueError):
    """A topology (JSON, preset arguments or grid) is malformed or inconsistent.

    Attributes:
      where: the field the message names (``"LinkSpec.bandwidth"``, ``"Topology.shape"``), so the
        JSON layer can name it by its JSON path instead (``None`` when the message names several).
    """

    def __init__(self, message: str, *, where: str | None = None):
        super().__init__(message)
        self.where = where


class NotEnoughDevicesError(HulkjaxError, RuntimeError):
    """The topology needs more devices than JAX can see."""


class UnsupportedPrimitiveError(HulkjaxError, NotImplementedError):
    """Strict mode: an operator has no sharding rule."""


class UnsupportedStepError(HulkjaxError, TypeError):
    """The training step or its arguments cannot be traced (non-array leaves, bad kwargs, ...)."""


class UnknownStrategyError(HulkjaxError, KeyError):
    """A strategy name is not in the registry."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class UnknownModelError(HulkjaxError, KeyError):
    """A zoo model name is not known."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownOptionError(HulkjaxError, TypeError):
    """A planner was given an option it does not have (the message lists the valid ones)."""


class InvalidOptionError(HulkjaxError, ValueError):
    """A planner option has a value the planner cannot use."""


class StrategyNotApplicableError(HulkjaxError, ValueError):
    """A strategy cannot be applied to this topology (e.g. 2-D ``dp_tp`` on a 1-D mesh)."""


class InfeasiblePlanError(HulkjaxError, RuntimeError):
    """No plan fits the devices' memory."""


class PlanMismatchError(HulkjaxError, ValueError):
    """A plan was made for another model, another topology, or other input shapes."""


class InvalidPlanError(HulkjaxError, ValueError):
    """A plan file is malformed, or a spec in it does not fit the value it names."""


class InvalidModelConfigError(HulkjaxError, ValueError):
    """A zoo config field has a value the model cannot be built with (bad dtype, heads not dividing
    the width, ...)."""


class InvalidHloError(HulkjaxError, ValueError):
    """HLO text (or the mesh it is read against) that the collective reader cannot make sense of."""


class UncompilableLayoutChangeError(HulkjaxError, ValueError):
    """A layout change XLA's SPMD partitioner fails on (one constraint, as jaxlib compiles it):
    the cost model makes it in two steps (``CostModel.reshard_via``) or prices it out."""


class DonatedArgumentError(HulkjaxError, RuntimeError):
    """An argument's buffer was donated to (and deleted by) an earlier call of the step: pass the
    state the step returned, or emit with ``donate=False``."""


class ProcessLayoutError(HulkjaxError, ValueError):
    """A multi-process job's processes x local devices do not match the topology, or would split
    one of its nodes across processes (``hulkjax launch``)."""


class NotCompiledError(HulkjaxError, RuntimeError):
    """A compiled program was asked for (its HLO, its collectives) before the step was compiled."""


class WorkerFailedError(HulkjaxError, RuntimeError):
    """A process of a multi-process job failed or timed out; the message carries its stderr.

    Attributes:
      process_id: the failed process (``None`` when the whole job timed out).
      returncode: its exit status (``None`` on a timeout).
      stderr: the tail of its stderr (``[Gloo]`` connection chatter removed).
    """

    def __init__(self, message: str, *, process_id: int | None = None,
                 returncode: int | None = None, stderr: str = ""):
        super().__init__(message)
        self.process_id, self.returncode, self.stderr = process_id, returncode, stderr


class HulkjaxWarning(UserWarning):
    """Base class of hulkjax's warnings (tests turn these into errors)."""


class UnsupportedPrimitiveWarning(HulkjaxWarning):
    """An operator without a sharding rule was replicated."""
