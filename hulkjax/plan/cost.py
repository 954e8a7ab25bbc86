"""The cost model's verdict on a plan: a record (the cost model in :mod:`hulkjax.cost` fills it).

>>> c = Cost(step_time=2e-3, compute_time=1.5e-3, comm_time=5e-4, ideal_time=1e-3)
>>> c.efficiency, c.fits
(0.5, True)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hulkjax.formatting import format_bytes


@dataclass(frozen=True, kw_only=True)
class PredictedCollective:
    """Collectives of one kind over one set of axes, as the cost model predicts them.

    Attributes:
      kind: ``"all-reduce" | "reduce-scatter" | "all-gather" | "all-to-all"``.
      axes: mesh axes.  # tuple of str
      count: how many.  # int
      bytes: total per-device bytes (same convention as ``hulkjax.Collective.bytes``).  # int
      time: seconds.  # float
    """

    kind: str
    axes: tuple[str, ...]
    count: int
    bytes: int
    time: float


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """Predicted time and memory of one stage of a staged plan.

    Attributes:
      devices: the stage's devices (indices into the topology's).  # tuple of int
      forward / backward: seconds per microbatch on the stage's devices: compute and the
        collectives of its SPMD plan (gradients the stage accumulates unreduced are not reduced
        there: see ``reduction``; the others are, in each microbatch's backward).
      update: seconds of the optimizer update, once per step.  # float
      reduction: seconds per step of the all-reduces of the gradients it accumulates unreduced
        over the microbatches (:mod:`hulkjax.cost.unreduced`), run right after its last
        forward or backward (its group's later programs wait for them).  # float
      reduction_exposed: how far past the end of the pipeline without reductions its
        reduction ends (0: the drain hides it).  # float
      compute / comm: seconds per step of compute and of collectives inside the stage.  # float
      peak_memory: bytes per device at the peak: parameters, gradients, optimizer state, gradient
        accumulators, and the activations of ``in_flight`` microbatches; in an interleaved plan,
        of every chunk its device group hosts (the same number for each of them).  # float
      memory_capacity: the smallest device memory in the stage, bytes.  # float
      in_flight: microbatches whose activations the stage holds at once.  # int
      memory_breakdown: ``peak_memory`` by kind, bytes.  # dict
    """

    devices: tuple[int, ...]
    forward: float
    backward: float
    update: float
    reduction: float = 0.0
    reduction_exposed: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    peak_memory: float = 0.0
    memory_capacity: float = float("inf")
    in_flight: int = 1
    memory_breakdown: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.memory_capacity


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """What one stage sends another over the link between their devices (alpha-beta).

    Attributes:
      src / dst: stage indices.  # int
      link: the link class the transfer crosses (``"node" | "region" | "wan"``).  # str
      bandwidth / latency: that link (bytes/s per device, seconds).  # float
      microbatch_bytes: bytes per device per microbatch (activations forward, or their
        gradients backward).  # float
      step_bytes: bytes per device once per step (parameters a stage reads from the stage that
        holds them, and the gradients sent back).  # float
      time: seconds per step on the link (``microbatches`` x per-microbatch + per-step).  # float
      exposed: seconds of the per-step part the pipeline does not hide (a parameter sent while
        the stages before its reader fill, a gradient sent back while the stages before its
        sender drain: only the excess adds to the step).  # float
    """

    src: int
    dst: int
    link: str
    bandwidth: float
    latency: float
    microbatch_bytes: float = 0.0
    step_bytes: float = 0.0
    time: float = 0.0
    exposed: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Cost:
    """Predicted time and memory of one training step under a plan (per device, worst device).

    Attributes:
      step_time: compute + communication, seconds (no overlap assumed: what planners minimize,
        and an upper bound on the step with collectives overlapped with independent compute,
        which ``CostModel.overlapped`` / :func:`hulkjax.cost.overlap.overlap` compute on
        request).  # float
      compute_time: roofline time of the operators at the slowest device's pace, and the time
        its programs spend on fresh pages (``page_time``).  # float
      page_time: of ``compute_time``, the seconds spent on the pages of buffers each program
        call allocates anew (``DeviceSpec.fresh_page_time`` per 4 KiB page of the temporaries
        above ``Backend.fresh_buffer_threshold``: XLA:CPU; 0 where allocators pool memory).
        Staged plans: the busiest device group's, per step.  # float
      comm_time: time in collectives (partial sums and layout changes).  # float
      comm_time_by_axis: ``{mesh axis: seconds}``. Staged plans: per step, ``{"s<k>/<axis>":
        seconds}`` of each stage's own mesh, summing to its ``StageTime.comm``.  # dict
      comm_bytes: ``{mesh axis: bytes each device sends over that axis's links}`` (staged plans:
        per step, keyed as ``comm_time_by_axis``).  # dict
      link_class: ``{mesh axis: "node" | "region" | "wan" | ...}``: which links each axis crosses.
      peak_memory: parameters + gradients + optimizer state + saved activations, bytes.  # float
      memory_breakdown: the same split by kind, bytes.  # dict
      memory_capacity: the smallest device memory of the topology, bytes.  # float
      ideal_time: total FLOPs / total peak FLOP/s of all devices (perfect scaling).  # float
      collectives: predicted collectives grouped by kind and axes. Staged plans: per step, each
        stage's on its axes (``s<stage>/<axis>``): its microbatch programs' ``microbatches``
        times, a value brought to a layout once per program, and the sums it accumulates
        unreduced once, combined as its backend combines them.
      stages: per-stage times and memory of a staged plan (empty for SPMD plans).
      bubble: seconds of a staged step in which the busiest stage idles (pipeline fill and drain,
        waiting on transfers); ``step_time = compute_time + comm_time + bubble`` there, with
        compute and communication those of the busiest stage.  # float
      transfers: what stages send each other, per pair of stages.
      microbatches / schedule: of a staged plan (1 / ``None`` for SPMD plans).
      virtual_stages: chunks per device group of an interleaved plan (1 otherwise); ``stages``
        then has one entry per chunk.  # int
    """

    step_time: float
    compute_time: float
    comm_time: float
    comm_time_by_axis: dict = field(default_factory=dict)
    comm_bytes: dict = field(default_factory=dict)
    link_class: dict = field(default_factory=dict)
    peak_memory: float = 0.0
    memory_breakdown: dict = field(default_factory=dict)
    memory_capacity: float = float("inf")
    ideal_time: float = 0.0
    page_time: float = 0.0
    collectives: tuple[PredictedCollective, ...] = ()
    stages: tuple[StageTime, ...] = ()
    bubble: float = 0.0
    transfers: tuple[Transfer, ...] = ()
    microbatches: int = 1
    schedule: str | None = None
    virtual_stages: int = 1

    @property
    def efficiency(self) -> float:
        """``ideal_time / step_time``: 1.0 is perfect scaling."""
        return self.ideal_time / self.step_time if self.step_time > 0 else 0.0

    @property
    def fits(self) -> bool:
        """Whether the peak memory fits the smallest device."""
        return self.peak_memory <= self.memory_capacity

    def __str__(self) -> str:
        axes = ", ".join(f"{a} {t * 1e3:.3g} ms" for a, t in self.comm_time_by_axis.items() if t)
        if self.stages:
            v = self.virtual_stages
            chunks, who = (f", {v} chunks per group", "group") if v > 1 else ("", "stage")
            return (f"step {self.step_time * 1e3:.4g} ms over {len(self.stages)} stages x "
                    f"{self.microbatches} microbatches ({self.schedule}{chunks}): busiest {who} "
                    f"compute "
                    f"{self.compute_time * 1e3:.4g} ms, comm {self.comm_time * 1e3:.4g} ms, "
                    f"bubble {self.bubble * 1e3:.4g} ms; efficiency {self.efficiency:.1%}; peak "
                    f"memory {format_bytes(self.peak_memory)} of "
                    f"{format_bytes(self.memory_capacity)}")
        pages = f" incl. fresh pages {self.page_time * 1e3:.4g} ms" if self.page_time else ""
        return (f"step {self.step_time * 1e3:.4g} ms (compute {self.compute_time * 1e3:.4g} ms"
                f"{pages}, comm {self.comm_time * 1e3:.4g} ms{': ' + axes if axes else ''}); "
                f"efficiency {self.efficiency:.1%}; peak memory {format_bytes(self.peak_memory)}"
                f" of {format_bytes(self.memory_capacity)}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["collectives"] = [asdict(c) | {"axes": list(c.axes)} for c in self.collectives]
        if d["memory_capacity"] == float("inf"):
            d["memory_capacity"] = None
        d["stages"] = [asdict(st) | {"devices": list(st.devices),
                                     "memory_capacity": _finite(st.memory_capacity)}
                       for st in self.stages]
        d["transfers"] = [asdict(t) for t in self.transfers]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Cost:
        d = dict(d)
        d["collectives"] = tuple(PredictedCollective(**(c | {"axes": tuple(c["axes"])}))
                                 for c in d.get("collectives", ()))
        if d.get("memory_capacity") is None:
            d["memory_capacity"] = float("inf")
        d["stages"] = tuple(
            StageTime(**(st | {"devices": tuple(st["devices"]),
                               "memory_capacity": float("inf") if st.get("memory_capacity") is None
                               else st["memory_capacity"]}))
            for st in d.get("stages", ()))
        d["transfers"] = tuple(Transfer(**t) for t in d.get("transfers", ()))
        return cls(**d)


def _finite(x: float):
    return None if x == float("inf") else x
