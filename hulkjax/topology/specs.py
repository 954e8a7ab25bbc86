"""Device and link specifications: the leaves of a :class:`~hulkjax.topology.Topology`.

Where this sits::

    specs.py   DeviceSpec, LinkSpec, Device, PairLink, DEVICE_SPECS   <- you are here
       |
    schema.py  the JSON form: structure only, semantic errors wrapped with the JSON path
       |
    model.py   Topology (devices + hierarchy + links + logical mesh): every semantic check
       |
    presets.py dgx-h100, tpu-v5e, geo, hetero (registered into Topology's preset table)

Every number is in SI base units: FLOP/s, bytes, bytes/s, seconds. Values are checked when an object is
built, here and in :class:`~hulkjax.topology.Topology` only; a bad value raises
:class:`~hulkjax.errors.InvalidTopologyError` naming the field (``where``), showing the value, and
saying how to fix it.
"""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass
from typing import Any

from hulkjax.errors import InvalidTopologyError

__all__ = ["DEVICE_SPECS", "Device", "DeviceSpec", "LinkSpec", "PairLink", "check_axes"]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_positive(value: Any, where: str, unit: str, hint: str = "") -> float:
    """Returns ``value`` as a float if it is a finite number > 0, else raises InvalidTopologyError.

    Args:
      value: the value to check.
      where: the field's name as the user wrote it (``DeviceSpec.memory``, ``levels.node.bandwidth``).
      unit: the unit the field is in, for the message.
      hint: an extra sentence saying how to fix it.
    """
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise InvalidTopologyError(
            f"{where} must be a finite number > 0 ({unit}), got {where.rsplit('.', 1)[-1]}={value!r}."
            f"{' ' + hint if hint else ''}",
            where=where,
        )
    return float(value)


def check_nonnegative(value: Any, where: str, unit: str, hint: str = "") -> float:
    """Returns ``value`` as a float if it is a finite number >= 0, else raises InvalidTopologyError."""
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise InvalidTopologyError(
            f"{where} must be a finite number >= 0 ({unit}), got {where.rsplit('.', 1)[-1]}={value!r}."
            f"{' ' + hint if hint else ''}",
            where=where,
        )
    return float(value)


def check_name(value: Any, where: str) -> str:
    """Returns ``value`` if it is a non-empty string, else raises InvalidTopologyError."""
    if not isinstance(value, str) or not value:
        raise InvalidTopologyError(
            f"{where} must be a non-empty string, got {where.rsplit('.', 1)[-1]}={value!r}.",
            where=where,
        )
    return value


def check_axes(axis_names: Any, shape: Any, where_names: str, where_shape: str) -> None:
    """Checks mesh axis names (unique Python identifiers) and shape (positive ints), same length."""
    if not isinstance(axis_names, tuple) or not axis_names:
        raise InvalidTopologyError(
            f"{where_names} must be a non-empty sequence of axis names, got {axis_names!r}.",
            where=where_names,
        )
    for name in axis_names:
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise InvalidTopologyError(
                f"{where_names} has {name!r}, which is not a valid Python identifier; mesh axis "
                "names are used as identifiers (PartitionSpec entries, shard_map axis names). "
                "Use names like 'data', 'model', 'node', 'gpu'.",
                where=where_names,
            )
    if len(set(axis_names)) != len(axis_names):
        raise InvalidTopologyError(f"{where_names} has repeated names: {list(axis_names)!r}.",
                                   where=where_names)
    if not isinstance(shape, tuple) or len(shape) != len(axis_names):
        raise InvalidTopologyError(
            f"{where_shape}={list(shape) if isinstance(shape, tuple) else shape!r} must have one size "
            f"per axis name, {len(axis_names)} for {list(axis_names)!r}.",
            where=where_shape,
        )
    for size in shape:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidTopologyError(
                f"{where_shape}={list(shape)!r} has {size!r}; axis sizes must be ints >= 1.",
                where=where_shape,
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """What one accelerator can do: the numbers the roofline cost model needs.

    Two devices with equal specs are the same kind of device; ``Topology.groups("kind")`` groups by
    spec, and SPMD runs at the pace of the slowest spec in the mesh.

    >>> DeviceSpec(kind="H100", peak_flops=9.9e14, memory=80e9, hbm_bandwidth=3.35e12).memory
    80000000000.0

    Attributes:
      kind: short name of the device model, e.g. ``"H100"``; the key in ``DEVICE_SPECS`` and in the
        ``devices.kinds`` table of the JSON form. Non-empty.
      peak_flops: dense bf16/fp16 peak throughput.  # FLOP/s, > 0
      memory: accelerator memory (HBM) capacity.  # bytes, > 0
      hbm_bandwidth: accelerator memory bandwidth.  # bytes/s, > 0
      peak_flops_f32: dense throughput of float32 matmuls as XLA runs them by default (TF32 tensor
        cores on Ampere and Hopper, CUDA cores on Volta and Turing, one bfloat16 pass on TPUs);
        ``None``: the same as ``peak_flops``.  # FLOP/s, > 0
      flops_efficiency: the fraction of the peaks that large matmuls reach as XLA compiles them
        (measured: ``benchmarks/GPU.md``). 1.0: the datasheet's peak.  # in (0, 1]
      memory_efficiency: the fraction of ``hbm_bandwidth`` a streaming kernel reaches.  # in (0, 1]
      kernel_overhead: seconds each kernel launch adds beyond its roofline time (the idle gap
        between kernels and a tiny kernel's minimum duration), per kernel the cost model counts
        (a matmul, a fusion that writes memory, any other operator). 0: none.  # seconds, >= 0
      receive_overhead: the share of a value's time on the link, when another process sends it
        to this device, that the device's compute loses meanwhile (a host whose network stack
        runs on the cores the device computes on: a CPU process pinned to its cores, as on the
        WAN testbed, ``benchmarks/wan/transfer_time.py --mode busy1``). Charged to a staged
        plan's receiving stage. 0: the transfer takes nothing from compute (accelerators, whose
        transfers have engines of their own).  # fraction, in [0, 1]
      fresh_page_time: seconds the device loses per 4 KiB page of a buffer its runtime maps
        afresh on every call of a program (the kernel zeroes and maps the page on its first
        write): XLA:CPU allocates a program's temporaries with the host's ``malloc``, and glibc
        maps an allocation above its mmap threshold (:attr:`hulkjax.cost.backends.Backend.
        fresh_buffer_threshold`) anew each time. Measured by ``hulkjax calibrate``: 1.8 us a
        page on this project's 2-core machine, where the same streaming kernel ran at 4.2 GB/s
        into a fresh buffer and 45 GB/s in place (``benchmarks/COMPUTE.md``). 0: none
        (accelerators, whose allocators pool device memory).  # seconds per 4 KiB page, >= 0
      transposed_dot_efficiency: the fraction of the matmul rate (the peak times
        ``flops_efficiency``) that a matmul reaches whose operands are both stored transposed
        (the left one contracting its leading dimension, the right one its trailing: a weight
        gradient whose activation operand ends up on the left, :mod:`hulkjax.cost.dots`).
        XLA:CPU runs those with Eigen's contraction instead of its fused matmul kernel: 0.39-0.46
        of the fused rate on one core, measured by ``hulkjax calibrate``
        (``benchmarks/COMPUTE.md``). 1.0: no slower (accelerators, whose matmul libraries take
        either operand transposed).  # in (0, 1]
      collective_overhead: seconds each collective call costs beyond its link terms (bytes over
        bandwidth, a latency per ring step), whatever the number of devices in it: the
        communicator's own fixed cost per call. XLA:CPU's gloo calls cost about 4 ms each on
        this project's 2-core machine, for two devices in one process as for two processes in
        network namespaces, and for four devices no more than for two; XLA:CPU makes one call per
        operand of a combined collective (:mod:`hulkjax.cost.backends`). Measured by ``hulkjax
        calibrate``. 0: none (NCCL's launch cost is in its links' latency).  # seconds, >= 0
      host_bandwidth: bytes per second, per direction, between the device and its host's memory
        (PCIe): the pace of the copies a step makes into host memory and back (``device_put``
        to ``MemorySpace.Host``, as ``jax.checkpoint``'s offloading policies emit for the
        activations they offload, :mod:`hulkjax.cost.backends`). ``None``: not known (a step
        that offloads is then refused on this device, with a message saying what to give).
        # bytes/s, > 0, or None

    The calibration numbers default to an ideal device (the datasheet's roofline, free
    launches); the built-in H100 and H200 carry the values measured on one of each, the other
    NVIDIA kinds the H100's (``DEVICE_SPECS``).
    """

    kind: str
    peak_flops: float  # FLOP/s
    memory: float  # bytes
    hbm_bandwidth: float  # bytes/s
    peak_flops_f32: float | None = None  # FLOP/s
    flops_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    kernel_overhead: float = 0.0  # seconds
    receive_overhead: float = 0.0  # fraction of a receive's link time
    fresh_page_time: float = 0.0  # seconds per 4 KiB page mapped afresh per call
    transposed_dot_efficiency: float = 1.0  # fraction of the matmul rate
    collective_overhead: float = 0.0  # seconds per collective call
    host_bandwidth: float | None = None  # bytes/s per direction, device <-> host memory

    @property
    def platform(self) -> str:
        """``"cpu"``, ``"tpu"`` or ``"gpu"`` (from the kind's name): which compiler backend runs it.

        >>> DEVICE_SPECS["H100"].platform, DEVICE_SPECS["TPUv5e"].platform, DEVICE_SPECS["cpu"].platform
        ('gpu', 'tpu', 'cpu')
        """
        k = self.kind.lower()
        return "cpu" if k.startswith("cpu") else "tpu" if k.startswith("tpu") else "gpu"

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype`` (float32 and wider: ``peak_flops_f32``).

        >>> DEVICE_SPECS["H100"].flops_for("float32") < DEVICE_SPECS["H100"].flops_for("bfloat16")
        True
        """
        if dtype in ("float32", "float64") and self.peak_flops_f32 is not None:
            return self.peak_flops_f32
        return self.peak_flops

    def __post_init__(self) -> None:
        check_name(self.kind, "DeviceSpec.kind")
        fix = (
            f"Give the vendor number for {self.kind!r}; see hulkjax/topology/specs.py DEVICE_SPECS."
        )
        for name, unit in (
            ("peak_flops", "FLOP/s"),
            ("memory", "bytes"),
            ("hbm_bandwidth", "bytes/s"),
        ):
            value = check_positive(getattr(self, name), f"DeviceSpec.{name}", unit, fix)
            object.__setattr__(self, name, value)
        if self.peak_flops_f32 is not None:
            value = check_positive(self.peak_flops_f32, "DeviceSpec.peak_flops_f32", "FLOP/s", fix)
            object.__setattr__(self, "peak_flops_f32", value)
        for name in ("flops_efficiency", "memory_efficiency", "transposed_dot_efficiency"):
            value = check_positive(getattr(self, name), f"DeviceSpec.{name}", "fraction of peak",
                                   "An efficiency is a fraction in (0, 1], e.g. 0.7.")
            if value > 1.0:
                raise InvalidTopologyError(
                    f"DeviceSpec.{name}={value!r} is above 1: no device beats its peak. Give the "
                    f"fraction of the peak it reaches, e.g. 0.7.", where=f"DeviceSpec.{name}")
            object.__setattr__(self, name, value)
        value = check_nonnegative(self.kernel_overhead, "DeviceSpec.kernel_overhead", "seconds",
                                  "Give seconds per kernel launch, e.g. 5e-6 (0: none).")
        object.__setattr__(self, "kernel_overhead", value)
        value = check_nonnegative(self.receive_overhead, "DeviceSpec.receive_overhead",
                                  "fraction of a receive's link time",
                                  "Give the share of a receive's time its compute loses, e.g. "
                                  "0.3 (0: none).")
        if value > 1.0:
            raise InvalidTopologyError(
                f"DeviceSpec.receive_overhead={value!r} is above 1: a receive cannot take more "
                f"compute time than it lasts. Give a fraction in [0, 1], e.g. 0.3.",
                where="DeviceSpec.receive_overhead")
        object.__setattr__(self, "receive_overhead", value)
        value = check_nonnegative(self.fresh_page_time, "DeviceSpec.fresh_page_time",
                                  "seconds per 4 KiB page",
                                  "Give the seconds a page fault costs, e.g. 1.8e-6 as `hulkjax "
                                  "calibrate` measures on a CPU (0: none).")
        object.__setattr__(self, "fresh_page_time", value)
        value = check_nonnegative(self.collective_overhead, "DeviceSpec.collective_overhead",
                                  "seconds per collective call",
                                  "Give the seconds a collective call costs beyond its link, "
                                  "e.g. 4e-3 as `hulkjax calibrate` measures for gloo on a "
                                  "small CPU machine (0: none).")
        object.__setattr__(self, "collective_overhead", value)
        if self.host_bandwidth is not None:
            value = check_positive(self.host_bandwidth, "DeviceSpec.host_bandwidth", "bytes/s",
                                   "Give the device's host link per direction, e.g. 32e9 for "
                                   "PCIe Gen4 x16 (None: not known).")
            object.__setattr__(self, "host_bandwidth", value)

    @property
    def calibration(self) -> dict[str, float]:
        """The calibration numbers that differ from an ideal device (``{}`` for a datasheet spec).

        >>> DeviceSpec(kind="X", peak_flops=1e12, memory=1e9, hbm_bandwidth=1e11).calibration
        {}
        """
        out = {}
        for name, ideal in _IDEAL.items():
            value = getattr(self, name)
            if value != ideal:
                out[name] = value
        return out


_IDEAL = {"flops_efficiency": 1.0, "memory_efficiency": 1.0, "kernel_overhead": 0.0,
          "receive_overhead": 0.0, "fresh_page_time": 0.0, "transposed_dot_efficiency": 1.0,
          "collective_overhead": 0.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """An alpha-beta model of a link: sending ``n`` bytes takes ``latency + n / bandwidth`` seconds.

    >>> link = LinkSpec(bandwidth=450e9, latency=1e-6)   # NVLink4, per GPU
    >>> round(link.latency + 450e6 / link.bandwidth, 6)    # 450 MB
    0.001001

    Attributes:
      bandwidth: bytes per second, per direction, per device (what one device can push to its peers
        over this link at once).  # bytes/s, > 0
      latency: time to send a minimal message (the alpha term).  # seconds, >= 0
    """

    bandwidth: float  # bytes/s, per direction per device
    latency: float  # seconds

    def __post_init__(self) -> None:
        bw = check_positive(
            self.bandwidth,
            "LinkSpec.bandwidth",
            "bytes/s",
            "Bandwidth is bytes per second per direction per device, e.g. 450e9 for NVLink4.",
        )
        lat = check_nonnegative(
            self.latency, "LinkSpec.latency", "seconds", "Latency is in seconds, e.g. 1e-6."
        )
        object.__setattr__(self, "bandwidth", bw)
        object.__setattr__(self, "latency", lat)

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` over this link once (alpha + bytes / beta).

        >>> LinkSpec(bandwidth=1e9, latency=0.5).time(2e9)
        2.5
        """
        return self.latency + nbytes / self.bandwidth


def worst_link(links: Any) -> LinkSpec:
    """The bottleneck of several links: the lowest bandwidth and the highest latency among them.

    A collective whose steps run over all of ``links`` at once finishes with the slowest of them, so
    this is the alpha-beta bound the cost model should use. Component-wise: where one link has the
    lowest bandwidth and another the highest latency, the result combines both (a conservative bound).
    """
    links = list(links)
    return LinkSpec(
        bandwidth=min(link.bandwidth for link in links),
        latency=max(link.latency for link in links),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PairLink:
    """A per-pair link override: the link between two named regions or two named nodes.

    ``between`` names two regions or two nodes (not one of each). Naming the same region twice sets
    the link between nodes inside that region; naming the same node twice sets the link between
    devices inside that node (e.g. a V100 node's NVLink2 in a cluster whose default is NVLink3).
    The pair is unordered and stored sorted.

    >>> PairLink(between=("virginia", "oregon"), link=LinkSpec(bandwidth=98.75e6, latency=0.067)).between
    ('oregon', 'virginia')

    Attributes:
      between: the two region names or the two node names.  # tuple[str, str], sorted
      link: the link between them.
    """

    between: tuple[str, str]
    link: LinkSpec

    def __post_init__(self) -> None:
        pair = tuple(self.between) if isinstance(self.between, list | tuple) else None
        if pair is None or len(pair) != 2:
            raise InvalidTopologyError(
                f"PairLink.between must be two region or node names, got between={self.between!r}.",
                where="PairLink.between",
            )
        for name in pair:
            check_name(name, "PairLink.between")
        if not isinstance(self.link, LinkSpec):
            raise InvalidTopologyError(
                f"PairLink.link must be a LinkSpec, got link={self.link!r}. "
                "Use LinkSpec(bandwidth=..., latency=...).",
                where="PairLink.link",
            )
        object.__setattr__(self, "between", tuple(sorted(pair)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One accelerator in a topology, where it sits in the hierarchy region > node > device.

    >>> spec = DEVICE_SPECS["H100"]
    >>> Device(id=3, spec=spec, region="us-east", node="node0").spec.kind
    'H100'

    Attributes:
      id: position in the topology's device order (hierarchical: region, node, local index), which is
        also its position in the logical mesh flattened row-major and the index into ``jax.devices()``
        that ``Topology.mesh()`` places it on.  # int, 0 <= id < num_devices
      spec: what the device can do.
      region: name of the region (data center / site) the device is in. Non-empty.
      node: name of the host the device is in; unique across the whole topology. Non-empty.
    """

    id: int
    spec: DeviceSpec
    region: str
    node: str

    def __post_init__(self) -> None:
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 0:
            raise InvalidTopologyError(
                f"Device.id must be an int >= 0 (its position in the topology), got id={self.id!r}."
            )
        if not isinstance(self.spec, DeviceSpec):
            raise InvalidTopologyError(
                f"Device.spec must be a DeviceSpec, got spec={self.spec!r}. "
                "Use DEVICE_SPECS['H100'] or DeviceSpec(kind=..., peak_flops=..., ...)."
            )
        check_name(self.region, "Device.region")
        check_name(self.node, "Device.node")

    @property
    def kind(self) -> str:
        """The device model's name, ``spec.kind``."""
        return self.spec.kind


def _spec(kind: str, peak_flops: float, memory: float, hbm_bandwidth: float,
          f32: float | None = None, host_bandwidth: float | None = None,
          **calibration: float) -> DeviceSpec:
    return DeviceSpec(kind=kind, peak_flops=peak_flops, memory=memory, hbm_bandwidth=hbm_bandwidth,
                      peak_flops_f32=f32, host_bandwidth=host_bandwidth, **calibration)


# Measured on one H100 SXM (80 GB HBM3) with XLA:GPU (jax 0.11.2), `benchmarks/GPU.md`:
# a chain of 8192^3 bfloat16 matmuls reaches 0.69 of the dense peak (687 TFLOP/s; TF32 0.74);
# streaming y = a x + b over 2 GB reaches 0.77 of the HBM bandwidth (2.58 TB/s); the idle gap
# plus minimum duration per kernel, fitted on the training steps of 6 third-party model families
# at 2 sizes (benchmarks/gpu.py), is 5 us per kernel the cost model counts. With these, predicted
# step times are within 1.12x of the measured ones (geometric mean; 3.2x with the datasheet
# roofline), and 1.06x on 9 held-out steps of other shapes. A100, V100 and T4 take the same
# numbers (assumed, not measured: the same compiler; their datasheet ratios are kept).
NVIDIA_MEASURED = dict(flops_efficiency=0.69, memory_efficiency=0.77, kernel_overhead=5e-6)
# Measured on one H200 (141 GB HBM3e) the same way (`benchmarks/GPU.md`, "A held-out GPU"): the
# bf16 chain reaches 0.70 of the dense peak (697 TFLOP/s), streaming 0.68 of the HBM bandwidth
# (3.28 TB/s: a smaller share than the H100's, so the H100's 0.77 overstated it); the kernel
# overhead is the H100's fit (none of the H200's steps was fitted). Its 9 training steps
# (6 families, two sizes) are predicted 1.17x off (geometric mean), 1.21x with the H100's numbers.
H200_MEASURED = dict(flops_efficiency=0.70, memory_efficiency=0.68,
                     kernel_overhead=NVIDIA_MEASURED["kernel_overhead"])


# Host links (``host_bandwidth``, per direction): the PCIe generation of each part's datasheet at
# x16, which NVIDIA quotes in both directions together (H100 and H200 SXM: Gen5, 128 GB/s; A100
# SXM: Gen4, 64 GB/s; V100 SXM2 and T4: Gen3, 32 GB/s). TPU v6e: 1.5e10 bytes/s per chip, the
# PCIe figure of the JAX scaling book's TPU chapter (its v6e exercise); the other TPUs' host
# links are not published, so they are left unknown.
PCIE_GEN5, PCIE_GEN4, PCIE_GEN3 = 64e9, 32e9, 16e9

# Vendor specifications (dense bf16/fp16 peak, memory, HBM bandwidth, and the float32 matmul peak
# XLA's default precision reaches: TF32 on Ampere/Hopper, FP32 CUDA cores before); see
# /work/shared/reference/topologies.md and the vendors' datasheets. V100 is the 32 GB SXM2 part. "cpu" is a nominal device for
# planning on fake CPU devices: its numbers are round placeholders, not a measurement.
DEVICE_SPECS: dict[str, DeviceSpec] = {
    spec.kind: spec
    for spec in (
        _spec("H100", 9.9e14, 80e9, 3.35e12, f32=4.95e14, host_bandwidth=PCIE_GEN5,
              **NVIDIA_MEASURED),  # TF32, dense
        _spec("H200", 9.9e14, 141e9, 4.8e12, f32=4.95e14, host_bandwidth=PCIE_GEN5,
              **H200_MEASURED),
        _spec("A100", 3.12e14, 80e9, 2.0e12, f32=1.56e14, host_bandwidth=PCIE_GEN4,
              **NVIDIA_MEASURED),
        _spec("V100", 1.25e14, 32e9, 0.9e12, f32=1.57e13, host_bandwidth=PCIE_GEN3,
              **NVIDIA_MEASURED),  # no TF32
        _spec("T4", 6.5e13, 16e9, 0.32e12, f32=8.1e12, host_bandwidth=PCIE_GEN3,
              **NVIDIA_MEASURED),
        _spec("TPUv5e", 1.97e14, 16e9, 0.82e12),
        _spec("TPUv5p", 4.59e14, 95e9, 2.76e12),
        # Google Cloud TPU v6e (Trillium) documentation: 918 TFLOP/s bf16, 32 GB HBM at 1638 GB/s.
        _spec("TPUv6e", 9.18e14, 32e9, 1.638e12, host_bandwidth=1.5e10),
        _spec("cpu", 1e12, 32e9, 1e11),
    )
}
"""Built-in device kinds by name. Topology JSON may use these kinds without listing their numbers."""

# Link between devices inside one node, per device kind (per GPU, per direction): NVLink generations
# and PCIe from the vendor tables in topologies.md. Latency ~1 us is an estimate (NVSwitch hop).
INTRA_NODE_LINKS: dict[str, LinkSpec] = {
    "H100": LinkSpec(bandwidth=450e9, latency=1e-6),
    "H200": LinkSpec(bandwidth=450e9, latency=1e-6),
    "A100": LinkSpec(bandwidth=300e9, latency=1e-6),
    "V100": LinkSpec(bandwidth=150e9, latency=1e-6),
    "T4": LinkSpec(bandwidth=16e9, latency=2e-6),
    "TPUv5e": LinkSpec(bandwidth=100e9, latency=1e-6),
    "TPUv5p": LinkSpec(bandwidth=180e9, latency=1e-6),
    "TPUv6e": LinkSpec(bandwidth=200e9, latency=1e-6),  # 2 ICI links per torus axis, 100 GB/s each
    "cpu": LinkSpec(bandwidth=100e9, latency=1e-6),
}
