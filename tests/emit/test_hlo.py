"""Tests for hulkjax.emit.hlo: reading collectives out of compiled HLO text.

Two halves: hand-written HLO snippets pin each format the parser reads (every replica-group
spelling, async forms, tuples, dtypes, loops, XLA:CPU's reduce-scatter spelling), and real programs
compiled on 8 fake CPU devices pin what JAX 0.10 / XLA:CPU actually emit, with closed-form bytes.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hulkjax.emit.hlo import (
    Collective,
    InvalidHloError,
    _replica_groups,
    collectives_from_hlo,
    summarize,
)
from hulkjax.errors import HulkjaxError

MESH_SHAPE = (2, 4)
AXES = ("data", "model")


def read(hlo: str, mesh_shape=MESH_SHAPE, axis_names=AXES) -> list[Collective]:
    return collectives_from_hlo(hlo, mesh_shape, axis_names)


def one(hlo: str, mesh_shape=MESH_SHAPE, axis_names=AXES) -> Collective:
    [c] = read(hlo, mesh_shape, axis_names)
    return c


def all_reduce(groups: str, shape: str = "f32[16,32]{1,0}") -> str:
    return f"""
HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}}

ENTRY %main (p: f32[16,32]) -> f32[16,32] {{
  %p = {shape} parameter(0)
  ROOT %ar = {shape} all-reduce(%p), channel_id=1, {groups}, use_global_device_ids=true, to_apply=%add, metadata={{op_name="jit(f)/psum"}}
}}
"""


# ------------------------------------------------------------------------------------------------
# Replica group formats
# ------------------------------------------------------------------------------------------------

# (printed replica_groups value, the groups it stands for on 8 devices)
GROUP_FORMATS = [
    # explicit lists
    ("{{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("{{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("{}", [list(range(8))]),
    # iota lists
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("[4,2]<=[2,2,2]T(0,2,1)", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    # the mesh form, as XLA 0.10 prints it for Shardy programs
    ("mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (
        "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
        [[0, 1, 2, 3], [4, 5, 6, 7]],
    ),
    (
        "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
        [[0, 1, 2, 3], [4, 5, 6, 7]],
    ),
    (
        "mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}",
        [[0, 1, 4, 5], [2, 3, 6, 7]],
    ),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    # mesh form variants XLA can print: several axes, sub-axes, explicit ids, none, maximal
    ("mesh['a'=2,'b'=4] {'b','a'}", [[0, 4, 1, 5, 2, 6, 3, 7]]),
    ("mesh['x'=8] {'x':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['x'=8] {'x':(1)2,'x':(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("mesh['a'=2,'b'=4], device_ids=(0,4,1,5,2,6,3,7) {'a'}", [[0, 2], [4, 6], [1, 3], [5, 7]]),
    ("mesh[a=2,b=4] {a}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['a'=2,'b'=4] {}", [[i] for i in range(8)]),
    ("maximal_mesh[device_id=3] {}", [[3]]),
]


@pytest.mark.parametrize("text,groups", GROUP_FORMATS, ids=[g for g, _ in GROUP_FORMATS])
def test_replica_group_formats(text, groups):
    assert _replica_groups(text, 8) == groups


@pytest.mark.parametrize("text,groups", GROUP_FORMATS, ids=[g for g, _ in GROUP_FORMATS])
def test_replica_group_formats_inside_an_instruction(text, groups):
    # The same groups come out of a whole module, and the axes follow from mesh coordinates.
    c = one(all_reduce(f"replica_groups={text}"))
    assert c.group_size == max(len(g) for g in groups)
    coords = [np.stack(np.unravel_index(g, MESH_SHAPE), axis=1) for g in groups]
    varying = {AXES[a] for cs in coords for a in range(2) if len(set(cs[:, a])) > 1}
    assert c.axes == tuple(a for a in AXES if a in varying)


@pytest.mark.parametrize(
    "groups,axes,size",
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("model",), 4),
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("data",), 2),
        ("replica_groups={}", ("data", "model"), 8),
        ("replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}", (), 1),
        ("replica_groups=[2,4]<=[8]", ("model",), 4),
        ("replica_groups=[4,2]<=[2,4]T(1,0)", ("data",), 2),
        ("replica_groups=[1,8]<=[8]", ("data", "model"), 8),
        # sub-axis of "model": pairs of neighbours
        ("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}", ("model",), 2),
        # groups spanning one data row and two model columns
        ("replica_groups={{0,1,4,5},{2,3,6,7}}", ("data", "model"), 4),
    ],
)
def test_axes_from_groups(groups, axes, size):
    c = one(all_reduce(groups))
    assert (c.kind, c.axes, c.group_size, c.bytes) == ("all-reduce", axes, size, 16 * 32 * 4)


def test_missing_replica_groups_means_all_devices():
    hlo = all_reduce("replica_groups={}").replace("replica_groups={}, ", "")
    c = one(hlo)
    assert c.axes == AXES and c.group_size == 8


def test_three_axis_mesh():
    hlo = all_reduce(
        "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_1'}"
    )
    c = one(hlo, (2, 2, 2), ("a", "b", "c"))
    assert c.axes == ("a", "c") and c.group_size == 4


# ------------------------------------------------------------------------------------------------
# collective-permute
# ------------------------------------------------------------------------------------------------


def permute(pairs: str) -> str:
    return f"""
ENTRY %main (p: bf16[16,8]) -> bf16[16,8] {{
  %p = bf16[16,8]{{1,0}} parameter(0)
  ROOT %cp = bf16[16,8]{{1,0}} collective-permute(%p), channel_id=1, source_target_pairs={pairs}
}}
"""


@pytest.mark.parametrize(
    "pairs,axes,size",
    [
        ("{{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}", ("model",), 4),
        ("{{0,1},{1,2},{2,3},{4,5},{5,6},{6,7}}", ("model",), 4),  # a shift, no wrap-around
        ("{{0,4},{4,0},{1,5},{5,1},{2,6},{6,2},{3,7},{7,3}}", ("data",), 2),
        ("{{0,5},{5,0}}", ("data", "model"), 2),
        ("{{0,0},{1,1}}", (), 1),
        ("{}", (), 1),
    ],
)
def test_collective_permute_pairs(pairs, axes, size):
    c = one(permute(pairs))
    assert (c.kind, c.axes, c.group_size, c.bytes) == ("collective-permute", axes, size, 256)
    assert c.shapes == ((16, 8),) and c.dtypes == ("bf16",)


# ------------------------------------------------------------------------------------------------
# Bytes: tuples, dtypes, gathered results and scattered operands
# ------------------------------------------------------------------------------------------------


def test_tuple_all_reduce_sums_elements():
    hlo = """
ENTRY %main (a: f32[32,16], b: bf16[8,32]) -> (f32[32,16], bf16[8,32]) {
  %a = f32[32,16]{1,0} parameter(0)
  %b = bf16[8,32]{1,0} parameter(1)
  ROOT %ar = (f32[32,16]{1,0}, bf16[8,32]{1,0}) all-reduce(%a, %b), channel_id=1, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add
}
"""
    c = one(hlo)
    assert c.shapes == ((32, 16), (8, 32))
    assert c.dtypes == ("f32", "bf16")
    assert c.bytes == 32 * 16 * 4 + 8 * 32 * 2
    assert c.axes == AXES and c.group_size == 8


DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1,
}  # fmt: skip


@pytest.mark.parametrize("dtype,size", sorted(DTYPE_BYTES.items()))
def test_dtype_sizes(dtype, size):
    c = one(all_reduce("replica_groups={{0,1,2,3},{4,5,6,7}}", shape=f"{dtype}[4,8]{{1,0}}"))
    assert c.bytes == 4 * 8 * size and c.dtypes == (dtype,)


def test_sub_byte_dtypes_round_up():
    assert one(all_reduce("replica_groups={}", shape="s4[3,3]{1,0}")).bytes == 5  # 36 bits


def test_unknown_dtype_is_an_error():
    with pytest.raises(InvalidHloError, match="unknown HLO element type 'q7'"):
        read(all_reduce("replica_groups={}", shape="q7[4]{0}"))


def test_all_gather_counts_its_result_and_reduce_scatter_its_operand():
    hlo = """
ENTRY %main (p: f32[8,32], q: f32[16,32]) -> (f32[16,32], f32[4,32]) {
  %p = f32[8,32]{1,0} parameter(0)
  %q = f32[16,32]{1,0} parameter(1)
  %ag = f32[16,32]{1,0} all-gather(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %rs = f32[4,32]{1,0} reduce-scatter(%q), channel_id=2, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
  ROOT %t = (f32[16,32]{1,0}, f32[4,32]{1,0}) tuple(%ag, %rs)
}
"""
    ag, rs = read(hlo)
    assert (ag.kind, ag.axes, ag.bytes, ag.shapes, ag.group_size) == (
        "all-gather",
        ("data",),
        16 * 32 * 4,
        ((8, 32),),
        2,
    )
    assert (rs.kind, rs.axes, rs.bytes, rs.shapes, rs.group_size) == (
        "reduce-scatter",
        ("model",),
        16 * 32 * 4,
        ((16, 32),),
        4,
    )


def test_operand_shapes_inferred_when_operands_are_not_defined():
    # A snippet whose operands come from nowhere: shapes follow from the result and dimensions.
    hlo = """
  %ag = f32[16,32] all-gather(%x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={1}
  %rs = f32[4,8] reduce-scatter(%y), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %a2a = f32[4,8] all-to-all(%z), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
"""
    ag, rs, a2a = read(hlo)
    assert ag.shapes == ((16, 16),) and ag.bytes == 16 * 32 * 4
    assert rs.shapes == ((16, 8),) and rs.bytes == 16 * 8 * 4
    assert a2a.shapes == ((4, 8),) and a2a.bytes == 4 * 8 * 4


def test_inline_operand_shapes():
    hlo = """
ENTRY e {
  ROOT ag = f32[16,32] all-gather(f32[8,32]{1,0} %x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
}
"""
    c = one(hlo)
    assert c.shapes == ((8, 32),) and c.bytes == 2048 and c.name == "ag"


def test_tuple_all_to_all():
    hlo = """
ENTRY %main (p: f32[32,8]) -> f32[8,32] {
  %a = f32[8,8]{1,0} parameter(0)
  %b = f32[8,8]{1,0} parameter(1)
  %c = f32[8,8]{1,0} parameter(2)
  %d = f32[8,8]{1,0} parameter(3)
  %all-to-all = (f32[8,8]{1,0}, f32[8,8]{1,0}, f32[8,8]{1,0}, /*index=3*/f32[8,8]{1,0}) all-to-all(%a, %b, %c, /*index=3*/%d), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}
}
"""
    c = one(hlo)
    assert (c.kind, c.axes, c.bytes, c.group_size) == ("all-to-all", ("model",), 1024, 4)
    assert c.shapes == ((8, 8),) * 4


# ------------------------------------------------------------------------------------------------
# Async forms: counted once
# ------------------------------------------------------------------------------------------------

ASYNC_HLO = """
HloModule async, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%async_computation (p0: bf16[4,2]) -> bf16[4,2] {
  %p0 = bf16[4,2]{1,0} parameter(0)
  ROOT %a2a = bf16[4,2]{1,0} all-to-all(%p0), channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}

ENTRY %main (p: f32[8,32], q: f32[16,32], r: bf16[4,2]) -> f32[8,32] {
  %p = f32[8,32]{1,0} parameter(0)
  %q = f32[16,32]{1,0} parameter(1)
  %r = bf16[4,2]{1,0} parameter(2)
  %ar-start = f32[8,32]{1,0} all-reduce-start(%p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add
  %ar-done = f32[8,32]{1,0} all-reduce-done(%ar-start)
  %ag-start = (f32[8,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  %ag-done = f32[16,32]{1,0} all-gather-done(%ag-start)
  %cp-start = (f32[8,32]{1,0}, f32[8,32]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %cp-done = f32[8,32]{1,0} collective-permute-done(%cp-start)
  %rs-start = ((f32[16,32]{1,0}), f32[4,32]{1,0}) reduce-scatter-start(%q), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
  %rs-update = ((f32[16,32]{1,0}), f32[4,32]{1,0}) reduce-scatter-update(%rs-start)
  %rs-done = f32[4,32]{1,0} reduce-scatter-done(%rs-update)
  %a2a-start = ((bf16[4,2]{1,0}), bf16[4,2]{1,0}, s32[]) async-start(%r), calls=%async_computation
  %a2a-done = bf16[4,2]{1,0} async-done(%a2a-start), calls=%async_computation
  ROOT %out = f32[8,32]{1,0} add(%ar-done, %cp-done)
}
"""


def test_async_forms_counted_once():
    got = {c.kind: c for c in read(ASYNC_HLO)}
    assert len(read(ASYNC_HLO)) == 5
    assert got["all-reduce"].bytes == 8 * 32 * 4 and got["all-reduce"].axes == ("data",)
    assert got["all-reduce"].name == "ar-start"
    assert got["all-gather"].bytes == 16 * 32 * 4 and got["all-gather"].shapes == ((8, 32),)
    assert got["all-gather"].axes == ("data",)
    assert got["collective-permute"].bytes == 8 * 32 * 4
    assert got["collective-permute"].axes == ("model",)
    assert got["reduce-scatter"].bytes == 16 * 32 * 4 and got["reduce-scatter"].axes == ("model",)
    assert got["all-to-all"].bytes == 4 * 2 * 2 and got["all-to-all"].name == "a2a"


SCHEDULED_HLO = """
HloModule scheduled, is_scheduled=true, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%fused (a: f32[8,32]) -> f32[8,32] {
  %a = f32[8,32]{1,0} parameter(0)
  ROOT %n = f32[8,32]{1,0} negate(%a)
}

%wrapped (w: f32[8,32]) -> f32[8,32] {
  %w = f32[8,32]{1,0} parameter(0)
  ROOT %inner = f32[8,32]{1,0} all-reduce(%w), replica_groups=[2,4]<=[8], to_apply=%add
}

ENTRY %main (p: f32[8,32]) -> f32[8,32] {
  %p = f32[8,32]{1,0} parameter(0)
  %ag-start = (f32[8,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%p), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %f1 = f32[8,32]{1,0} fusion(%p), kind=kLoop, calls=%fused
  %ar-start = f32[8,32]{1,0} all-reduce-start(%f1), replica_groups=[2,4]<=[8], to_apply=%add
  %b = f32[8,32]{1,0} bitcast(%f1)
  %t = (f32[8,32]{1,0}) tuple(%b)
  %ar-done = f32[8,32]{1,0} all-reduce-done(%ar-start)
  %gemm = f32[8,32]{1,0} custom-call(%f1, %b), custom_call_target="__cublas$gemm"
  %ag-done = f32[16,32]{1,0} all-gather-done(%ag-start)
  %sync = f32[8,32]{1,0} all-reduce(%gemm), replica_groups=[2,4]<=[8], to_apply=%add
  %w-start = ((f32[8,32]{1,0}), f32[8,32]{1,0}) async-start(%sync), calls=%wrapped
  %f2 = f32[8,32]{1,0} fusion(%sync), kind=kLoop, calls=%fused
  %w-done = f32[8,32]{1,0} async-done(%w-start), calls=%wrapped
  ROOT %out = f32[8,32]{1,0} add(%w-done, %f2)
}
"""


def test_the_schedule_says_which_collectives_overlap_work():
    got = {c.name: (c.asynchronous, c.overlapped) for c in read(SCHEDULED_HLO)}
    # The gather is in flight over a fusion and a library call (the all-reduce pair between
    # them, its bitcast and tuple, are no work); the all-reduce pair over nothing; the
    # synchronous all-reduce is not async; the wrapped one runs during its caller's fusion.
    assert got == {"ag-start": (True, 2), "ar-start": (True, 0), "sync": (False, 0),
                   "inner": (True, 1)}


def test_async_start_without_done():
    hlo = """
  %ag-start = (f32[8,32]{1,0}, f32[16,32]{1,0}) all-gather-start(%p), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
  %ar-start = (f32[8]{0}, f32[4]{0}) all-reduce-start(%a, %b), replica_groups={}
"""
    ag, ar = read(hlo)
    assert ag.bytes == 2048 and ag.shapes == ((8, 32),)
    assert ar.bytes == 48 and ar.shapes == ((8,), (4,))


# ------------------------------------------------------------------------------------------------
# XLA:CPU's reduce-scatter: all-reduce + dynamic-slice
# ------------------------------------------------------------------------------------------------

# What XLA:CPU emits for a reduce-scatter (from a real compile): the slice sits in a fusion.
CPU_REDUCE_SCATTER = """
%add.clone (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x.1, %y.1)
}

%fused_computation.1 (param_0.1: f32[8,32], param_1.7: u32[8], param_2.5: u32[]) -> f32[2,32] {
  %param_0.1 = f32[8,32]{1,0} parameter(0)
  %constant.15 = u32[1]{0} constant({0})
  %param_1.7 = u32[8]{0} parameter(1)
  %param_2.5 = u32[] parameter(2)
  %dynamic-slice.5 = u32[1]{0} dynamic-slice(%param_1.7, %param_2.5), dynamic_slice_sizes={1}
  %constant.14 = u32[1]{0} constant({3})
  %clamp.2 = u32[1]{0} clamp(%constant.15, %dynamic-slice.5, %constant.14)
  %convert.2 = s32[1]{0} convert(%clamp.2)
  %constant.13 = s32[1]{0} constant({2})
  %multiply.3 = s32[1]{0} multiply(%convert.2, %constant.13)
  %bitcast.1 = s32[] bitcast(%multiply.3)
  %constant.12 = s32[] constant(0)
  ROOT %dynamic-slice.4 = f32[2,32]{1,0} dynamic-slice(%param_0.1, %bitcast.1, %constant.12), dynamic_slice_sizes={2,32}
}

ENTRY %main.0_spmd (param: f32[8,32]) -> f32[2,32] {
  %param = f32[8,32]{1,0} parameter(0)
  %partition-id.1 = u32[] partition-id()
  %constant.3 = u32[8]{0} constant({0, 1, 2, 3, 0, 1, 2, 3})
  %all-reduce = f32[8,32]{1,0} all-reduce(%param), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, use_global_device_ids=true, to_apply=%add.clone
  ROOT %bitcast_dynamic-slice_fusion = f32[2,32]{1,0} fusion(%all-reduce, %constant.3, %partition-id.1), kind=kLoop, calls=%fused_computation.1
}
"""


def test_scatter_emulated_through_fusion():
    c = one(CPU_REDUCE_SCATTER)
    assert (c.kind, c.axes, c.group_size, c.bytes) == ("all-reduce", ("model",), 4, 1024)
    assert c.scatter_emulated


def test_scatter_emulated_needs_a_quarter_slice():
    hlo = CPU_REDUCE_SCATTER.replace(
        "f32[2,32]{1,0} dynamic-slice(%param_0.1", "f32[4,32]{1,0} dynamic-slice(%param_0.1"
    )
    assert not one(hlo).scatter_emulated


def test_scatter_emulated_needs_every_use_to_slice():
    hlo = CPU_REDUCE_SCATTER.replace(
        "  ROOT %bitcast_dynamic-slice_fusion",
        "  %other = f32[8,32]{1,0} negate(%all-reduce)\n  ROOT %bitcast_dynamic-slice_fusion",
    )
    assert not one(hlo).scatter_emulated


def test_scatter_emulated_direct_and_through_gte_bitcast_copy():
    hlo = """
ENTRY e {
  a = f32[8,32] parameter(0)
  b = f32[4] parameter(1)
  i = s32[] parameter(2)
  ar = (f32[8,32], f32[4]) all-reduce(a, b), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=add
  g0 = f32[8,32] get-tuple-element(ar), index=0
  g1 = f32[4] get-tuple-element(ar), index=1
  bc = f32[256] bitcast(g0)
  cp = f32[256] copy(bc)
  s0 = f32[64] dynamic-slice(cp, i), dynamic_slice_sizes={64}
  s1 = f32[1] dynamic-slice(g1, i), dynamic_slice_sizes={1}
  ROOT t = (f32[64], f32[1]) tuple(s0, s1)
}
"""
    assert one(hlo).scatter_emulated
    escaping = hlo.replace(
        "ROOT t = (f32[64], f32[1]) tuple(s0, s1)",
        "ROOT t = (f32[64], f32[1], f32[8,32]) tuple(s0, s1, g0)",
    )
    assert not one(escaping).scatter_emulated


def test_unused_or_root_all_reduce_is_not_scatter_emulated():
    assert not one(all_reduce("replica_groups={{0,1,2,3},{4,5,6,7}}")).scatter_emulated


# ------------------------------------------------------------------------------------------------
# Loops and called computations
# ------------------------------------------------------------------------------------------------

LOOP_HLO = """
%inner_body (ip: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ip = (s32[], f32[8]{0}) parameter(0)
  %iv = f32[8]{0} get-tuple-element(%ip), index=1
  %ic = s32[] get-tuple-element(%ip), index=0
  %ar_inner = f32[8]{0} all-reduce(%iv), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %it = (s32[], f32[8]{0}) tuple(%ic, %ar_inner)
}

%inner_cond (icp: (s32[], f32[8])) -> pred[] {
  %icp = (s32[], f32[8]{0}) parameter(0)
  ROOT %ilt = pred[] constant(true)
}

%called (cv: f32[8]) -> f32[8] {
  %cv = f32[8]{0} parameter(0)
  ROOT %ag_called = f32[8]{0} all-gather(%cv), channel_id=2, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %c = s32[] get-tuple-element(%p), index=0
  %ar = f32[8]{0} all-reduce(%v), channel_id=1, replica_groups={}, to_apply=%add, metadata={op_name="while/body/psum{x}"}
  %w = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[8]{0}) tuple(%c, %ar)
}

%cond (cp: (s32[], f32[8])) -> pred[] {
  %cp = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%unknown_body (up: (s32[], f32[8])) -> (s32[], f32[8]) {
  %up = (s32[], f32[8]{0}) parameter(0)
  ROOT %cp_unknown = (s32[], f32[8]{0}) collective-permute(%up), channel_id=9, source_target_pairs={{0,4},{4,0}}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %called_result = f32[8]{0} call(%x), to_apply=%called
  %init = (s32[], f32[8]{0}) tuple(%zero, %x)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"},"known_init_step":{"init":"0","step":"1"}}
  %loop2 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%unknown_body
  ROOT %done = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_loops_and_called_computations():
    got = {c.name: c for c in read(LOOP_HLO)}
    assert set(got) == {"ar_inner", "ag_called", "ar", "cp_unknown"}
    assert (got["ag_called"].in_loop, got["ag_called"].trip_count) == (False, 1)
    assert (got["ar"].in_loop, got["ar"].trip_count) == (True, 5)
    assert (got["ar_inner"].in_loop, got["ar_inner"].trip_count) == (True, 15)
    assert (got["cp_unknown"].in_loop, got["cp_unknown"].trip_count) == (True, None)
    assert got["cp_unknown"].bytes == 4 + 32 and got["cp_unknown"].axes == ("data",)


# ------------------------------------------------------------------------------------------------
# Robustness and errors
# ------------------------------------------------------------------------------------------------


def test_layouts_dynamic_dims_metadata_and_multiline():
    hlo = """
ENTRY %main (p: f32[<=8,128]) -> f32[<=8,128] {
  %p = f32[<=8,128]{1,0:T(8,128)S(1)} parameter(0)
  ROOT %ar.7 = f32[<=8,128]{1,0:T(8,128)S(1)} all-reduce(
      f32[<=8,128]{1,0:T(8,128)S(1)} %p),
    channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}},
    metadata={op_name="jit(f)/while/body/dot_general(x, {y)" source_file="a(b.py"},
    to_apply=%add
}
"""
    c = one(hlo)
    assert (c.name, c.shapes, c.bytes, c.axes) == ("ar.7", ((8, 128),), 8 * 128 * 4, ("model",))


def test_attributes_inside_strings_do_not_count():
    # Metadata may quote anything; an old-style backend_config is an escaped JSON string.
    hlo = r"""
%body (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p), metadata={op_name="replica_groups={{0,1}} calls=%x"}, replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %w = f32[8]{0} while(%x), condition=%cond, body=%body, backend_config="{\"known_trip_count\":{\"n\":\"7\"}}"
}
"""
    c = one(hlo)
    assert (c.axes, c.group_size, c.in_loop, c.trip_count) == (("data",), 2, True, 7)


def test_device_outside_the_mesh():
    with pytest.raises(
        InvalidHloError, match=r"devices \[8, 9\], outside a mesh of shape \(2, 4\)"
    ):
        read(all_reduce("replica_groups={{0,8},{1,9}}"))


def test_mesh_shape_must_match_axis_names():
    with pytest.raises(HulkjaxError, match="mesh_shape and axis_names"):
        collectives_from_hlo("", (2, 4), ("data",))


def test_bad_mesh_form():
    with pytest.raises(InvalidHloError, match="unknown axis"):
        read(all_reduce("replica_groups=mesh['a'=2,'b'=4] {'c'}"))


def test_no_collectives():
    assert read("ENTRY %e (p: f32[2]) -> f32[2] {\n  ROOT %p = f32[2]{0} parameter(0)\n}") == []


def test_collective_checks_its_fields():
    with pytest.raises(ValueError, match="kind"):
        Collective(kind="all-sum", bytes=1, axes=(), shapes=((1,),), dtypes=("f32",), group_size=1)
    with pytest.raises(ValueError, match="scatter_emulated"):
        Collective(
            kind="all-gather",
            bytes=1,
            axes=(),
            shapes=((1,),),
            dtypes=("f32",),
            group_size=1,
            scatter_emulated=True,
        )


def test_summarize():
    ar = Collective(
        kind="all-reduce",
        bytes=1024,
        axes=("model",),
        shapes=((8, 32),),
        dtypes=("f32",),
        group_size=4,
        scatter_emulated=True,
    )
    ag = Collective(
        kind="all-gather",
        bytes=2048,
        axes=("data",),
        shapes=((8, 32),),
        dtypes=("f32",),
        group_size=2,
    )
    assert summarize([ar, ag, ag]) == {
        ("all-reduce", ("model",)): {"count": 1, "bytes": 1024},
        ("all-gather", ("data",)): {"count": 2, "bytes": 4096},
    }
    assert summarize([ar], fold_emulated=True) == {
        ("reduce-scatter", ("model",)): {"count": 1, "bytes": 1024}
    }


# ------------------------------------------------------------------------------------------------
# Real programs compiled on 8 fake CPU devices
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets jax_num_cpu_devices=8)")
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * 2)


def compiled_collectives(mesh, fn, *args, **jit_kwargs) -> list[Collective]:
    text = jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()
    return collectives_from_hlo(text, mesh.devices.shape, mesh.axis_names)


def spec(mesh, *s):
    return NamedSharding(mesh, P(*s))


def test_real_data_parallel_gradient(mesh):
    def loss(w, x):
        return jnp.sum((x @ w) ** 2)

    w, x = jnp.ones((16, 32)), jnp.ones((64, 16))
    got = compiled_collectives(
        mesh, jax.grad(loss), w, x, in_shardings=(spec(mesh), spec(mesh, ("data", "model")))
    )
    assert summarize(got) == {("all-reduce", AXES): {"count": 1, "bytes": 16 * 32 * 4}}
    [c] = got
    assert c.group_size == 8 and c.dtypes == ("f32",) and not c.scatter_emulated


def test_real_data_parallel_gradient_of_two_weights_is_one_tuple_all_reduce(mesh):
    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p[0]) @ p[1])

    p = (jnp.ones((16, 32)), jnp.ones((32, 8)))
    x = jnp.ones((64, 16))
    got = compiled_collectives(
        mesh,
        jax.grad(loss),
        p,
        x,
        in_shardings=((spec(mesh), spec(mesh)), spec(mesh, ("data", "model"))),
    )
    [c] = got  # XLA's all-reduce combiner merged the two gradients
    assert c.kind == "all-reduce" and c.axes == AXES
    assert sorted(c.shapes) == sorted([(32, 16), (8, 32)])  # as the dots produced them
    assert c.bytes == (16 * 32 + 32 * 8) * 4


def test_real_contracting_dim_sharded_on_model(mesh):
    a, b = jnp.ones((8, 64)), jnp.ones((64, 32))
    got = compiled_collectives(
        mesh,
        lambda a, b: jnp.einsum("bk,kn->bn", a, b),
        a,
        b,
        in_shardings=(spec(mesh, None, "model"), spec(mesh, "model", None)),
        out_shardings=spec(mesh),
    )
    assert summarize(got) == {("all-reduce", ("model",)): {"count": 1, "bytes": 8 * 32 * 4}}
    assert got[0].group_size == 4 and got[0].shapes == ((8, 32),)


def test_real_all_gather_of_a_data_sharded_weight(mesh):
    def f(w):
        return jax.lax.with_sharding_constraint(w, spec(mesh)) * 2

    got = compiled_collectives(mesh, f, jnp.ones((16, 32)), in_shardings=spec(mesh, "data", None))
    [c] = got
    assert (c.kind, c.axes, c.bytes, c.shapes, c.group_size) == (
        "all-gather",
        ("data",),
        16 * 32 * 4,
        ((8, 32),),
        2,
    )


def test_real_reduce_scatter_request_is_an_emulated_all_reduce_on_cpu(mesh):
    # Out sharded on the contracting axis: GPUs/TPUs emit reduce-scatter; XLA:CPU emits an
    # all-reduce of the full [8,32] partial sum and a dynamic-slice (in a fusion) of its quarter.
    a, b = jnp.ones((8, 64)), jnp.ones((64, 32))
    got = compiled_collectives(
        mesh,
        lambda a, b: a @ b,
        a,
        b,
        in_shardings=(spec(mesh, None, "model"), spec(mesh, "model", None)),
        out_shardings=spec(mesh, "model", None),
    )
    [c] = got
    assert (c.kind, c.axes, c.bytes, c.group_size) == ("all-reduce", ("model",), 8 * 32 * 4, 4)
    assert c.scatter_emulated
    assert summarize(got, fold_emulated=True) == {
        ("reduce-scatter", ("model",)): {"count": 1, "bytes": 8 * 32 * 4}
    }


def test_real_explicit_psum_scatter_is_a_reduce_scatter_even_on_cpu(mesh):
    # An explicit psum_scatter reaches XLA:CPU as reduce-scatter and stays one.
    f = jax.shard_map(
        lambda x: jax.lax.psum_scatter(x, "model", tiled=True),
        mesh=mesh,
        in_specs=P("data", None),
        out_specs=P("data", "model"),
    )
    [c] = compiled_collectives(mesh, f, jnp.ones((8, 16)))
    assert (c.kind, c.axes, c.bytes, c.shapes, c.group_size) == (
        "reduce-scatter",
        ("model",),
        4 * 16 * 4,
        ((4, 16),),
        4,
    )


def test_real_psum_over_data_in_shard_map(mesh):
    f = jax.shard_map(
        lambda x: jax.lax.psum(x, "data"),
        mesh=mesh,
        in_specs=P("data", "model"),
        out_specs=P(None, "model"),
    )
    [c] = compiled_collectives(mesh, f, jnp.ones((8, 8)))
    assert (c.kind, c.axes, c.bytes, c.group_size) == ("all-reduce", ("data",), 4 * 2 * 4, 2)


def test_real_all_to_all_in_shard_map(mesh):
    f = jax.shard_map(
        lambda x: jax.lax.all_to_all(x, "model", 0, 1, tiled=True),
        mesh=mesh,
        in_specs=P(None, "model"),
        out_specs=P("model", None),
    )
    [c] = compiled_collectives(mesh, f, jnp.ones((32, 32)))
    # The local [32,8] block goes out as four [8,8] pieces, one per model peer.
    assert (c.kind, c.axes, c.bytes, c.group_size) == ("all-to-all", ("model",), 32 * 8 * 4, 4)
    assert c.shapes == ((8, 8),) * 4


def test_real_resharding_lowers_to_all_to_all(mesh):
    def f(w):
        return jax.lax.with_sharding_constraint(w, spec(mesh, None, "model"))

    got = compiled_collectives(mesh, f, jnp.ones((16, 32)), in_shardings=spec(mesh, "model", None))
    assert summarize(got) == {("all-to-all", ("model",)): {"count": 1, "bytes": 4 * 32 * 4}}


@pytest.mark.parametrize("axis,size", [("model", 4), ("data", 2)])
def test_real_ppermute_ring(mesh, axis, size):
    f = jax.shard_map(
        lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)]),
        mesh=mesh,
        in_specs=P("data", "model"),
        out_specs=P("data", "model"),
    )
    [c] = compiled_collectives(mesh, f, jnp.ones((32, 32)))
    assert (c.kind, c.axes, c.bytes, c.group_size) == (
        "collective-permute",
        (axis,),
        16 * 8 * 4,
        size,
    )


def test_real_all_gather_inside_scan(mesh):
    def body(carry, w):
        return carry + jnp.sum(jax.lax.with_sharding_constraint(w, spec(mesh))), None

    ws = jnp.ones((5, 16, 32))
    got = compiled_collectives(
        mesh,
        lambda ws: jax.lax.scan(body, 0.0, ws)[0],
        ws,
        in_shardings=spec(mesh, None, "data", None),
    )
    [c] = got
    assert (c.kind, c.axes, c.bytes) == ("all-gather", ("data",), 16 * 32 * 4)
    assert c.in_loop and c.trip_count == 5


MESHES = [((2, 4), ("data", "model")), ((2, 2, 2), ("a", "b", "c")), ((4, 2), ("x", "y"))]
CONTRACTIONS = [
    (shape, names, sub)
    for shape, names in MESHES
    for k in range(1, len(names) + 1)
    for sub in itertools.permutations(names, k)
]


@pytest.mark.parametrize("shape,names,sub", CONTRACTIONS, ids=lambda v: str(v))
def test_real_contraction_over_any_axes(shape, names, sub):
    # Whatever XLA's internal mesh and device_ids transposes look like, the groups it prints for
    # a contraction sharded over `sub` must vary exactly along `sub`.
    devices = np.array(jax.devices()[:8]).reshape(shape)
    mesh = Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))
    a, b = jnp.ones((8, 64)), jnp.ones((64, 32))
    got = compiled_collectives(
        mesh,
        lambda a, b: a @ b,
        a,
        b,
        in_shardings=(spec(mesh, None, sub), spec(mesh, sub, None)),
        out_shardings=spec(mesh),
    )
    [c] = got
    assert c.kind == "all-reduce"
    assert c.axes == tuple(n for n in names if n in sub)
    assert c.group_size == math.prod(shape[names.index(n)] for n in sub)
    assert c.bytes == 8 * 32 * 4


def test_real_permuted_device_order_reads_mesh_positions():
    # Partition ids are positions in the mesh, not physical device ids: a shuffled mesh reads the
    # same.
    devices = np.array(jax.devices()[:8])[[3, 1, 0, 2, 7, 5, 4, 6]].reshape(2, 4)
    mesh = Mesh(devices, AXES, axis_types=(AxisType.Auto,) * 2)
    a, b = jnp.ones((8, 64)), jnp.ones((64, 32))
    [c] = compiled_collectives(
        mesh,
        lambda a, b: a @ b,
        a,
        b,
        in_shardings=(spec(mesh, None, "data"), spec(mesh, "data", None)),
        out_shardings=spec(mesh),
    )
    assert (c.axes, c.group_size) == (("data",), 2)
