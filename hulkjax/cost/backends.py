"""What the compiler and the collective library do with collectives, per backend.

The cost model predicts the program XLA compiles, and XLA treats collectives differently on each
platform:

* **Combining.** XLA merges independent collectives of one kind over the same devices into one
  (``AllReduceCombiner`` and friends), up to a size threshold, so a step's gradient reductions
  become a few large all-reduces rather than one per parameter. XLA:CPU combines all-reduces without
  a practical limit and does not combine all-gathers (measured on jax 0.10 by
  ``tests/cost/test_backends.py``); XLA:GPU's defaults combine all-reduces, all-gathers and
  reduce-scatters up to 30 MiB each (``xla_gpu_*_combine_threshold_bytes``); TPUs are modelled like
  GPUs.
* **Calls per combined collective.** NCCL runs a combined all-reduce as one collective over the
  concatenated operands, paying one latency. XLA:CPU does not: its collective thunks
  (``xla/backends/cpu/runtime/all_reduce_thunk.cc`` and the all-gather, permute and all-to-all
  ones) call the communicator once per operand, so a combined all-reduce of 40 gradients is 40
  all-reduces, each paying the link's latency. Measured on jax 0.10 (one program, a ``psum`` of
  ``k`` float32 arrays of 512 KiB in all, one all-reduce in the HLO): two processes of two
  fake devices joined by ``jax.distributed`` (gloo), over the two devices of each process, took
  4.0, 16.0, 60.0 and 156.1 ms for ``k`` = 1, 4, 16 and 40; between the processes 2.8, 2.8, 7.2
  and 17.0 ms; one process, four devices, 64 KiB in all: 0.18, 0.42, 1.54 and 5.22 ms for
  ``k`` = 1, 4, 16 and 64. Combining saves XLA:CPU instructions, not latencies.
* **Reduce-scatter.** XLA:CPU does not form reduce-scatters: it all-reduces and slices.
* **Reassociation.** XLA:GPU all-reduces the sum of two all-reduced partial sums once
  (``AllReduceReassociate``: a tied embedding's two gradients, Megatron's input gradients;
  ``benchmarks/GPU_SHARDED.md``); XLA:CPU combines them into one tuple all-reduce of both.
* **Narrow floats.** XLA:CPU has no bfloat16 / float16 arithmetic and no such collectives: it
  converts narrow floats to f32 around every operator and collective (all-reduce, all-gather,
  all-to-all, permute alike) and then removes the convert pairs between them, so collectives move
  twice the bytes and the step's intermediates are held in f32 (its arguments and results keep
  their dtype). GPUs and TPUs compute and move them as they are.
* **Buffers.** XLA:GPU runs an all-reduce in place (NCCL writes the sum into the operand's
  buffer: ``CanShareBufferHint`` in the GPU compiler); XLA:CPU writes it into a new buffer, so
  operands and results of a combined all-reduce are live together (measured with
  ``compiled.memory_analysis()``, ``tests/cost/test_memory.py``).
* **Scheduling.** XLA:CPU's scheduler computes a buffer that depends only on the step's state
  (parameters, optimizer state) and constants, not on its batch (the zeros a scatter-add
  accumulates into, a LayerNorm scale broadcast that a matmul-like kernel reads) at the start of
  the step, with the parameters, and keeps it until its last use in the backward pass (the
  ``*-live-range.txt`` XLA dumps for BERT and GPT-2: every such broadcast starts at the end of
  the argument block). GPUs and TPUs are modelled as computing it where it is used.
* **Asynchronous collectives** (:mod:`hulkjax.cost.overlap`). XLA:GPU and TPU compilers turn
  collectives into start/done pairs that the latency-hiding scheduler moves apart to overlap them
  with independent compute, with a limit of collectives in flight per resource: on GPU every
  collective takes one stream, ``kGpuAsyncStreamCollectives``, with
  ``xla_gpu_experimental_parallel_collective_overlap_limit`` (default 1) in flight
  (``xla/service/gpu/gpu_latency_hiding_scheduler.cc``); the generic tracker (TPUs are modelled
  by it) gives each kind its own resource (``kAllGather``, ``kAllReduce``, ``kReduceScatter``,
  ``kAllToAll``, ``kCollectivePermute``), each with ``SchedulerConfig``'s ``*_overlap_limit = 1``
  (``xla/service/latency_hiding_scheduler.{h,cc}``). XLA:CPU runs no latency-hiding scheduler:
  its collectives are synchronous.
* **Algorithm.** NCCL and the TPU runtime run a collective over several mesh axes hierarchically
  (one axis at a time, fast links first); XLA:CPU's gloo collectives run one flat ring over all
  the devices involved, at the pace of the slowest link in it.

The cost model charges a collective that is *deferred* (off the critical path: its result only
feeds the state update) ``min(1, bytes / threshold)`` of its latency, its share of the combined
collective it will be merged into, where the backend runs a combined collective as one call, and
all of it where it runs one call per operand (XLA:CPU);
:meth:`~hulkjax.cost.CostModel.program_summary` merges them for counts.

>>> BACKENDS["cpu"].reduce_scatter, BACKENDS["gpu"].combines("all-gather")
(False, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hulkjax.plan.collectives import COLLECTIVE_KINDS as _KINDS

_MIB = 1 << 20
PAGE_BYTES = 4096
"""The page ``DeviceSpec.fresh_page_time`` is the cost of (x86-64 and most aarch64 Linux)."""
_NARROW_FLOATS = {"bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Backend:
    """A compiler backend's treatment of collectives, and of the buffers a program allocates.

    Attributes:
      name: ``"cpu"``, ``"gpu"`` or ``"tpu"``.  # str
      combine_threshold: bytes up to which independent collectives of a kind are merged
        (``math.inf``: all of them); kinds not listed are never combined.  # dict[str, float]
      reduce_scatter: whether reduce-scatters are formed (else all-reduce, then a local slice).
      hierarchical: whether a collective over several mesh axes runs axis by axis (else one flat
        ring over all its devices).  # bool
      min_float_bytes: floats narrower than this many bytes per element are widened to it in
        collectives and intermediates (0: kept as they are).  # int
      in_place_all_reduce: whether an all-reduce's result takes its operand's buffer.  # bool
      hoists_argument_values: whether a buffer computed from the step's state and constants
        alone (not its batch) is made at the start of the step (else where it is
        computed).  # bool
      async_collectives: per collective kind, the scheduler resource (stream) its asynchronous
        start/done pair occupies, one collective in flight per resource; a kind not listed runs
        synchronously, in line with compute.  # dict[str, str]
      call_per_operand: whether a combined collective runs one library call per operand (each
        paying the latency) rather than one call over all of them (see the module
        docstring).  # bool
      reassociates_all_reduce: whether two all-reduced partial sums that are then added become
        one all-reduce of their sum (XLA's ``AllReduceReassociate``: ``all-reduce(a) +
        all-reduce(b)`` into ``all-reduce(a + b)``). XLA:GPU does: a tied embedding's two
        gradient contributions, Megatron's input gradients (``benchmarks/GPU_SHARDED.md``: with
        the pass disabled, its all-reduces equal the unreassociated prediction, count and
        bytes). XLA:CPU does not (it combines the two into one tuple all-reduce, measured on
        jax 0.10); TPUs are not known and left without.  # bool
      fresh_buffer_threshold: bytes above which a buffer a program allocates on each call (its
        temporaries, its results that are not donated arguments) is new memory every call, whose
        pages the device pays ``DeviceSpec.fresh_page_time`` for. XLA:CPU allocates with the
        host's ``malloc``; glibc maps an allocation above its mmap threshold afresh and unmaps
        it on free, and the threshold rises with the largest buffer freed to at most 32 MiB
        (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit Linux). Measured on XLA:CPU: a streaming
        kernel into a fresh 64 MB output took one minor page fault per page on every call, and a
        GPT-2 training step's 435 MB of temporaries 111,283 faults a call (434.7 MB). Below the
        threshold buffers reuse pages, mostly: a LLaMA step run without donation, 24 MB of
        temporaries, still took 3,716 faults a call (60% of its pages; not established why,
        glibc trimming the top of its heap is one candidate), which the threshold rule misses.
        ``math.inf``: pooled allocators (XLA:GPU and TPU's BFC), no fresh pages.  # bytes
      host_offload: whether a value the step places in host memory (``device_put`` to
        ``MemorySpace.Host``, as ``jax.checkpoint``'s offloading policies emit) leaves the
        device's memory, copied out and back over the host link
        (``DeviceSpec.host_bandwidth``) as asynchronous copies the scheduler overlaps with
        compute. XLA:GPU and TPU do (``xla/service/host_offloader.cc`` moves those buffers into
        the host memory space, color 5; ``host_memory_transfer_asyncifier.cc`` makes the copies
        asynchronous). XLA:CPU does not: it has one memory (no buffer in memory space 5), and
        an offloaded value stays in it as a saved one would (``tests/cost/test_offload.py``: an
        MLP's offloading and saving steps compile to equal ``memory_analysis()`` on jax 0.10;
        transformers' GPT-2 with its weight matmuls offloaded, 919 MB of temporaries against
        1,041 MB saving them, where XLA's buffer assignment packs the two differently).  # bool
    """

    name: str
    combine_threshold: dict[str, float] = field(default_factory=dict)
    reduce_scatter: bool = True
    hierarchical: bool = True
    min_float_bytes: int = 0
    in_place_all_reduce: bool = True
    hoists_argument_values: bool = False
    async_collectives: dict[str, str] = field(default_factory=dict)
    call_per_operand: bool = False
    reassociates_all_reduce: bool = False
    fresh_buffer_threshold: float = math.inf
    host_offload: bool = True

    def wire_dtype(self, dtype: str) -> str:
        """The dtype a tensor of ``dtype`` moves in through a collective.

        >>> BACKENDS["cpu"].wire_dtype("bfloat16"), BACKENDS["gpu"].wire_dtype("bfloat16")
        ('float32', 'bfloat16')
        """
        if self.min_float_bytes and dtype in _NARROW_FLOATS \
                and _NARROW_FLOATS[dtype] < self.min_float_bytes:
            return {4: "float32", 8: "float64"}[self.min_float_bytes]
        return dtype

    def wire_factor(self, dtype: str) -> float:
        """Bytes on the wire per byte of a ``dtype`` tensor (2.0 for bf16 on CPU)."""
        wire = self.wire_dtype(dtype)
        return 1.0 if wire == dtype else self.min_float_bytes / _NARROW_FLOATS[dtype]

    def combines(self, kind: str) -> bool:
        """Whether independent collectives of ``kind`` are merged."""
        return kind in self.combine_threshold

    def latency_share(self, kind: str, nbytes: float) -> float:
        """The share of its latency a deferred collective pays: its share of a combined one, or
        all of it where the combined one runs a call per operand.

        >>> BACKENDS["cpu"].latency_share("all-reduce", 1e6), BACKENDS["gpu"].latency_share("all-reduce", 3 * _MIB)
        (1.0, 0.1)
        """
        threshold = self.combine_threshold.get(kind)
        if threshold is None or self.call_per_operand:
            return 1.0
        if math.isinf(threshold):
            return 0.0
        return min(1.0, nbytes / threshold)

    def in_place(self, kind: str) -> bool:
        """Whether the reduction the backend runs for ``kind`` writes into its operand's buffer.

        >>> BACKENDS["gpu"].in_place("all-reduce"), BACKENDS["cpu"].in_place("all-reduce")
        (True, False)
        """
        return self.kind_of(kind) == "all-reduce" and self.in_place_all_reduce

    def fresh_bytes(self, nbytes: float) -> float:
        """The bytes of a ``nbytes`` buffer, allocated once per call, that are new pages on
        every call (all of it above :attr:`fresh_buffer_threshold`, else none).

        >>> BACKENDS["cpu"].fresh_bytes(64 * _MIB) / _MIB, BACKENDS["cpu"].fresh_bytes(8 * _MIB)
        (64.0, 0.0)
        >>> BACKENDS["gpu"].fresh_bytes(64 * _MIB)
        0.0
        """
        return float(nbytes) if nbytes > self.fresh_buffer_threshold else 0.0

    def kind_of(self, kind: str) -> str:
        """The collective the backend really runs for ``kind`` (CPU: all-reduce for a
        reduce-scatter)."""
        return "all-reduce" if kind == "reduce-scatter" and not self.reduce_scatter else kind


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", {"all-reduce": math.inf}, reduce_scatter=False, hierarchical=False,
                   min_float_bytes=4, in_place_all_reduce=False, hoists_argument_values=True,
                   call_per_operand=True, fresh_buffer_threshold=32 * _MIB,
                   host_offload=False),
    "gpu": Backend("gpu", {"all-reduce": 30 * _MIB, "all-gather": 30 * _MIB,
                           "reduce-scatter": 30 * _MIB},
                   async_collectives=dict.fromkeys(_KINDS, "collectives"),
                   reassociates_all_reduce=True),
    "tpu": Backend("tpu", {"all-reduce": 30 * _MIB, "all-gather": 30 * _MIB,
                           "reduce-scatter": 30 * _MIB},
                   async_collectives={k: k for k in _KINDS}),
}
"""The backends the cost model knows, by platform name."""


def backend_of(topology) -> Backend:
    """The backend of a topology's devices (the slowest device's platform for mixed clusters).

    >>> import hulkjax as hj
    >>> backend_of(hj.Topology.grid((8,), ("d",))).name, backend_of(hj.Topology.preset("dgx-h100")).name
    ('cpu', 'gpu')
    """
    return BACKENDS[topology.slowest_device().platform]
