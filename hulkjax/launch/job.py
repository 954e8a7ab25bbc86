"""The job every process of a launch runs, saved as ``job.json`` in the run directory."""

from __future__ import annotations

import dataclasses
import json

from hulkjax.errors import InvalidPlanError, UnsupportedStepError
from hulkjax.launch.arrays import SAFETY

REPORT_FORMAT = 1
"""Version of ``report.json``."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What every process of a launch runs; saved as ``job.json`` in the run directory.

    Attributes:
      model: a zoo name (``hulkjax.zoo.names()``) or ``module:function`` / ``path/file.py:function``
        returning ``(step, state, batch)`` with concrete arrays.  # str
      size: zoo size preset (``None``: the model's default).  # str | None
      overrides: zoo config overrides, e.g. ``{"batch": 8}``.  # dict
      plans: plan JSON files, run one after another in the same job.  # tuple[str, ...]
      strategies: when ``plans`` is empty, process 0 plans with these strategies on ``topology``
        and broadcasts the plans to the others (so planners with time limits need not be
        deterministic).  # tuple[str, ...]
      topology: the topology's JSON form, for ``strategies``.  # dict | None
      steps: timed training steps per plan.  # int
      seed: zoo ``init`` seed (the same on every process).  # int
      check: run the unsharded step on process 0 and compare losses and the final state.  # bool
      rtol / atol: fixed tolerances of that comparison; ``None`` (default): the tolerance of each
        leaf is ``safety`` x how far a float64 run of the unsharded step is from the float32 one
        (:func:`hulkjax.launch.arrays.tree_error`).  # float | None
      safety: the factor on that measured spread.  # float
      local_devices: fake CPU devices per process; ``None`` leaves devices to the platform (GPU
        and TPU hosts).  # int | None
      out: directory process 0 writes ``report.json`` (and a planned ``plan-*.json``) to.  # str
      init_timeout: seconds to wait for every process to join the job.  # int
    """

    model: str
    size: str | None = None
    overrides: dict = dataclasses.field(default_factory=dict)
    plans: tuple[str, ...] = ()
    strategies: tuple[str, ...] = ()
    topology: dict | None = None
    steps: int = 3
    seed: int = 0
    check: bool = True
    rtol: float | None = None
    atol: float | None = None
    safety: float = SAFETY
    local_devices: int | None = None
    out: str = "."
    init_timeout: int = 300

    def __post_init__(self):
        object.__setattr__(self, "plans", tuple(self.plans))
        object.__setattr__(self, "strategies", tuple(self.strategies))
        if not self.plans and not (self.strategies and self.topology):
            raise InvalidPlanError("a launch job needs plan files (--plan), or strategies and a "
                                   "topology to plan on process 0.")
        if (self.rtol is None) != (self.atol is None):
            raise UnsupportedStepError(f"rtol={self.rtol!r}, atol={self.atol!r}: give both (fixed "
                                       f"tolerances) or neither (measured from a float64 run).")
        if not self.safety > 0:
            raise UnsupportedStepError(f"safety={self.safety!r} must be positive.")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise UnsupportedStepError(f"steps={self.steps!r} must be a positive integer.")

    def to_dict(self) -> dict:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Job:
        return cls(**d)

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path) -> Job:
        with open(path) as f:
            return cls.from_dict(json.load(f))
