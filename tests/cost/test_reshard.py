"""Layout changes as XLA's SPMD partitioner compiles them (hulkjax/cost/comm.py ``reshard_comms``).

Each case compiles ``x -> constraint(x * 2, dst) + 1`` from an input laid out as ``src`` on the fake
CPU devices and holds the reshard's collectives (kind, axes, bytes) against the model's. The
partitioner is shared by every backend, so these hold for GPUs and TPUs too.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hulkjax.cost.comm import reshard_comms
from hulkjax.plan.specs import from_pspec
from tests.helpers import compiled_layout_change, hlo_collectives

M2x4 = ((2, 4), ("data", "model"))
M2x2x2 = ((2, 2, 2), ("data", "fsdp", "model"))

CASES = [
    # dst refines src: one collective-permute of the dst block. Mixtral's expert kernels under
    # megatron on 2 x 4 (the issue-11 fidelity miss: predicted as all-gathers over "data").
    (M2x4, (4, 16, 64), P("data"), P("model")),
    (M2x4, (8, 16), P(None, "data"), P(None, "model")),
    (M2x4, (8, 16), P("data", None), P("model", "data")),
    (M2x2x2, (8, 16), P("data"), P("fsdp")),
    (M2x2x2, (8, 16), P("data"), P(("fsdp", "model"))),
    (M2x2x2, (8, 16), P("data", "fsdp"), P("model", "fsdp")),
    (M2x2x2, (64, 192), P("model", "data"), P("data", "model")),
    # All of a dimension's blocks moving to another one that other axes will take: an all-to-all,
    # then a permute. GPT-2's c_attn kernel under auto on 2 x 2 x 2 (the other fidelity miss).
    (M2x2x2, (64, 192), P("model"), P(None, "data")),
    (M2x2x2, (64, 192), P("model", "fsdp"), P(None, ("fsdp", "data"))),
    # Coarser blocks from other axes: permute, then all-gather over the major source axes.
    (M2x4, (8, 16), P("model"), P("data")),
    (M2x2x2, (8, 16), P(("data", "fsdp")), P("model")),
    # One axis moving to an unsharded dimension while new axes fill the one it leaves: slice,
    # exchange the dst block, permute it. Mixtral's attention under megatron on 2 x 4 (the last
    # collective-permute miss of the real-model suite: 8 predicted, 12 compiled). Only from the
    # last dimension to the one before it does the partitioner exchange the source block instead.
    (M2x4, (8, 16, 4, 16), P(None, None, "model", None), P(None, "model", "data", None)),
    (M2x4, (8, 4, 16, 16), P(None, "model", None, None), P(None, "data", None, "model")),
    (M2x4, (8, 16, 32), P("model", None, None), P("data", None, "model")),
    (M2x4, (8, 16, 32), P(None, "model", None), P("model", "data", None)),
    (M2x4, (8, 16, 32), P(None, None, "model"), P("model", None, "data")),
    (M2x4, (8, 16, 32), P(None, None, "model"), P(None, "model", "data")),
    (M2x4, (64, 192), P("model"), P("data", "model")),
    # A gather with an all-to-all: the gather first (the exchange moves the gathered block).
    (M2x4, (8, 16, 4, 16), P(None, "model", "data", None), P(None, None, "model", None)),
    (M2x4, (8, 16, 4, 16), P("data", "model", None, None), P(None, None, "model", None)),
    (M2x4, (16, 64), P("model", "data"), P(None, "model")),
    # Axes moving between different pairs of dimensions: one all-to-all per pair.
    (M2x4, (8, 16, 4, 16), P(None, "model", "data", None), P(None, None, "model", "data")),
    # Gathers, all-to-alls and local slices.
    (M2x4, (64, 192), P("data"), P(None, "model")),
    (M2x4, (64, 192), P("model"), P(None, "data")),
    (M2x4, (64, 192), P("data"), P(None, "data")),
    (M2x4, (64, 192), P(("data", "model")), P("data")),
    (M2x4, (64, 192), P("data"), P(("data", "model"))),
# Found by compiling every pair of layouts of a (16, 32, 64) array on 2 x 4 and 2 x 2 x 2 (112
    # of the 342 pairs on 2 x 4 missed before reshard_comms replayed ReshardNoCache).
    # An axis only in dst is sliced before the all-to-all (TryComplexReshardHandling splits the
    # dimension), so the exchange moves the dst-sized block, then a permute where the moved axis
    # is not where the slice leaves it.
    (M2x4, (16, 32, 64), P(None, None, "data"), P(None, ("data", "model"))),
    (M2x4, (16, 32, 64), P(None, None, "data"), P(None, ("model", "data"))),
    (M2x4, (16, 32, 64), P(None, "data"), P(("data", "model"))),
    (M2x2x2, (16, 32, 64), P(None, None, "data"), P(None, ("data", "model"))),
    (M2x2x2, (16, 32, 64), P(None, "fsdp"), P(("fsdp", "data"))),
    # Involuntary full rematerialization: nothing else reaches dst, so XLA replicates (one
    # all-gather per sharded dimension, the last dimension first, each of its result) and slices.
    (M2x4, (16, 32, 64), P(("data", "model")), P(None, None, "model")),
    (M2x4, (16, 32, 64), P("data", "model"), P(None, None, ("data", "model"))),
    (M2x4, (16, 32, 64), P(None, "data", "model"), P(("data", "model"))),
    (M2x4, (16, 32, 64), P("model", None, "data"), P(None, ("model", "data"))),
    (M2x4, (16, 32, 64), P(None, None, ("data", "model")), P("model")),
    (M2x2x2, (16, 32, 64), P(("data", "fsdp", "model")), P(None, None, "model")),
    (M2x2x2, (16, 32, 64), P("data", "fsdp"), P(None, None, ("data", "fsdp"))),
    (M2x2x2, (16, 32, 64), P("data", ("fsdp", "model")), P(None, None, "model")),
    # Replication from two sharded dimensions: one all-gather per dimension.
    (M2x4, (16, 32, 64), P("data", "model"), P()),
    (M2x4, (16, 32, 64), P(None, "data", "model"), P("data")),
    (M2x2x2, (16, 32, 64), P("data", "fsdp", "model"), P()),
    (M2x2x2, (16, 32, 64), P("data", None, "model"), P("fsdp")),
    # Swaps: the all-to-all over one axis, then a permute.
    (M2x4, (16, 32, 64), P("data", "model"), P("model", "data")),
    (M2x4, (16, 32, 64), P(None, "data", "model"), P(None, "model", "data")),
    (M2x2x2, (16, 32, 64), P("data", "fsdp"), P("fsdp", "data")),
    (M2x2x2, (16, 32, 64), P(("data", "fsdp"), "model"), P("model", ("data", "fsdp"))),
    # To a partially replicated layout (ReshardToPartialReplicateWithAllGather): a permute to a
    # device order that dst's blocks subdivide, then one all-gather per dimension giving up tiles
    # (twice over "model" where its devices span both dimensions).
    (M2x4, (16, 32, 64), P("data", "model"), P(None, "data")),
    (M2x4, (16, 32, 64), P("model", "data"), P("data")),
    (M2x2x2, (16, 32, 64), P("data", "fsdp", "model"), P(None, "data")),
    # Disjoint pairs of dimensions exchanged in one all-to-all (TryMultipleSourceTargetDims).
    (M2x4, (16, 32, 64), P(None, None, "model"), P("model", "data")),
    (M2x2x2, (16, 32, 64), P("data", None, "fsdp"), P(None, "fsdp", "data")),
    (M2x2x2, (16, 32, 64), P("data", "fsdp", None), P(None, "data", "model")),
    # To a partially replicated layout: all-gathers per dimension leaving.
    (M2x2x2, (16, 32, 64), P(("data", "fsdp"), "model"), P("data")),
    (M2x2x2, (16, 32, 64), P("fsdp", ("data", "model")), P(None, "model")),
    # From a partially replicated layout: a local slice, then a permute.
    (M2x2x2, (16, 32, 64), P("fsdp"), P("data", "fsdp")),
    (M2x2x2, (16, 32, 64), P(None, "model"), P(("data", "fsdp"), None, "model")),
    # One dimension split by three axes going to three (PatternMatchMergeOrSplitSharding's
    # [X*Y] -> [X]: the dimension's tiles split as [dst's count, the rest], the major part kept
    # as device groups): within each group the rest is rematerialized (an all-gather of half the
    # value over the two minor source axes, then a slice), then a permute where the devices do
    # not already hold dst's blocks. Predicted as a full all-gather before.
    (M2x2x2, (16, 32, 64), P(("data", "fsdp", "model")), P("data", "fsdp", "model")),
    (M2x2x2, (16, 32, 64), P(("data", "fsdp", "model")), P("model", "data", "fsdp")),
    (M2x2x2, (16, 32, 64), P(("fsdp", "data", "model")), P("model", "data", "fsdp")),
    (M2x2x2, (16, 32, 64), P(("model", "data", "fsdp")), P("model", "data", "fsdp")),
    (M2x2x2, (16, 32, 64), P(None, ("fsdp", "model", "data")), P("fsdp", "model", "data")),
    (M2x2x2, (16, 32, 64), P(None, None, ("model", "data", "fsdp")), P("data", "fsdp", "model")),
    (M2x2x2, (16, 32, 64), P(None, None, ("data", "fsdp", "model")), P("model", "data", "fsdp")),
    # Replicas in device order: HloSharding::PartialTile sorts each group of replicas, so the
    # partially replicated layout an all-gather reaches (PatternMatchPartiallyReplicateDim) and
    # the all-to-all's result hold their replicas sorted, not in the order the source's axes
    # left them; the final permute pairs that order with dst's (predicted over other axes before).
    (M2x2x2, (16, 32, 64), P("model", "data"), P(None, None, "model")),
    (M2x2x2, (16, 32, 64), P(None, ("model", "fsdp"), "data"), P("fsdp")),
    # ... or where the sorted order already is dst's: no permute at all (one was predicted).
    (M2x2x2, (16, 32, 64), P(None, "fsdp", "model"), P("model")),
    # An empty array (a zero-length piece of a split and its gradient: CLIP's vision
    # embeddings once their tiled class token is followed): nothing moves; the replay divided
    # by its empty tiles (ZeroDivisionError out of hj.plan).
    (M2x4, (8, 0, 64), P(None, ("data", "model")), P(None, "model", "data")),
]


@pytest.mark.parametrize("mesh,shape,src,dst", CASES)
def test_reshard_is_what_xla_compiles(mesh, shape, src, dst):
    mesh_shape, names = mesh
    predicted = reshard_comms(shape, "float32", from_pspec(src, len(shape)),
                              from_pspec(dst, len(shape)), dict(zip(names, mesh_shape)))
    assert sorted((c.kind, c.axes, c.bytes) for c in predicted) == \
        compiled_layout_change(mesh_shape, names, shape, src, dst)


# Layout changes the cost model makes in two steps (CostModel.reshard_via) because XLA's own is
# dearer: its "involuntary full rematerialization" (an axis leaving a dimension while another
# moves from it: everything gathered, then sliced), two all-gathers for axes on two dimensions
# joining a third, an all-to-all of the whole block where a slice first moves a quarter of it.
PATHS = [
    (M2x4, P(("data", "model")), P(None, None, "model")),
    (M2x4, P("data", "model"), P(None, None, ("data", "model"))),
    (M2x4, P(None, None, "data"), P(None, ("data", "model"))),
    (M2x4, P(None, "model", "data"), P(("data", "model"))),
    (M2x2x2, P(("data", "fsdp", "model")), P(None, None, "model")),
    (M2x2x2, P("data", ("fsdp", "model")), P(None, "fsdp", "data")),
]


@pytest.mark.parametrize("mesh,src,dst", PATHS)
def test_a_dear_layout_change_is_made_in_steps_xla_compiles_as_priced(mesh, src, dst):
    """``reshard_via`` names an intermediate layout where XLA's own change costs more; the
    steps through it, each one constraint, compile to exactly the collectives ``reshard``
    prices, and they cost less than XLA's direct change."""
    import hulkjax as hj
    from hulkjax.cost import CostModel

    mesh_shape, names = mesh
    shape = (16, 32, 64)
    topology = hj.Topology.grid(mesh_shape, names)
    g = hj.trace(lambda x: x * 2, jnp.ones(shape))
    cm = CostModel(g, topology)
    vid = g.inputs[0]
    s, d = from_pspec(src, 3), from_pspec(dst, 3)
    via = cm.reshard_via(vid, s, d)
    assert len(via) == 1, via
    steps = cm.reshard(vid, s, d)
    direct = cm.reshard(vid, s, d, direct=True)
    assert sum(map(cm.comm_time, steps)) < sum(map(cm.comm_time, direct))
    from hulkjax.plan.specs import to_pspec

    assert sorted((c.kind, c.axes, c.bytes) for c in steps) == compiled_layout_change(
        mesh_shape, names, shape, src, dst, via=tuple(to_pspec(v) for v in via))
    assert sorted((c.kind, c.axes, c.bytes) for c in direct) == compiled_layout_change(
        mesh_shape, names, shape, src, dst)


@pytest.mark.parametrize("mesh,src,dst", PATHS[:2])
def test_readers_of_a_value_share_its_path(mesh, src, dst):
    """XLA's partitioner makes a layout change once per source instruction and target (its
    reshard cache; CSE leaves collectives alone), so two readers constraining a value through a
    path each would share the first step and repeat the second, each from its own intermediate
    (the scanned LLaMA's weights under fsdp, read by the recomputed forward and the backward
    matmul: 10 all-gathers over "data" more than predicted). The emitter constrains the value to
    the path once for all its readers: the program makes the path's collectives once."""
    import hulkjax as hj
    from hulkjax.cost import CostModel
    from hulkjax.emit.spmd import node_hooks
    from hulkjax.plan.specs import to_pspec

    mesh_shape, names = mesh
    shape = (16, 32, 64)
    g = hj.trace(lambda x: x * 2, jnp.ones(shape))
    cm = CostModel(g, hj.Topology.grid(mesh_shape, names))
    s, d = from_pspec(src, 3), from_pspec(dst, 3)
    via = tuple(to_pspec(v) for v in cm.reshard_via(g.inputs[0], s, d))
    assert via
    jmesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
    on_operand, _, _ = node_hooks(jmesh, {(0, 0): dst, (1, 0): dst}, {},
                                  {(0, 0): via, (1, 0): via})

    def two_readers(x):
        y = x * 2
        return jnp.sin(on_operand(0, 0, y)) + jnp.cos(on_operand(1, 0, y))

    f = jax.jit(two_readers, in_shardings=NamedSharding(jmesh, src),
                out_shardings=NamedSharding(jmesh, dst))
    hlo = f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text()
    assert hlo_collectives(hlo, mesh_shape, names) == sorted((c.kind, c.axes, c.bytes) for c in cm.reshard(g.inputs[0], s, d))


_UNCOMPILABLE = ((2, 2, 4), ("x", "y", "z"), (4, 8, 16, 8), P("y", "z"), P(None, "x", "z", "y"))

_COMPILE_IN_16 = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 16)
from jax.sharding import PartitionSpec as P
from tests.helpers import compiled_layout_change
mesh, names, shape, src, dst, via = json.loads(sys.argv[1])
spec = lambda s: P(*[tuple(a) if a else None for a in s])
print(json.dumps(compiled_layout_change(mesh, names, shape, spec(src), spec(dst),
                                        via=tuple(spec(v) for v in via))))
"""


def test_a_layout_change_xla_fails_on_is_made_in_steps_or_priced_out():
    """Two pairs of dimensions swapped in one all-to-all, the second tile count no longer a
    multiple of the first: XLA's partitioner divides by zero (jaxlib dies compiling it, found by
    a training sample on a 2x2x4 mesh). The replay says so; the cost model makes the change
    through a layout it compiles, as priced, and prices the one-constraint change out."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    import hulkjax as hj
    from hulkjax.cost import CostModel
    from hulkjax.errors import UncompilableLayoutChangeError

    mesh_shape, names, shape, src, dst = _UNCOMPILABLE
    s, d = from_pspec(src, 4), from_pspec(dst, 4)
    sizes = dict(zip(names, mesh_shape))
    with pytest.raises(UncompilableLayoutChangeError, match="divides by zero"):
        reshard_comms(shape, "float32", s, d, sizes)
    g = hj.trace(lambda x: x * 2, jnp.ones(shape))
    cm = CostModel(g, hj.Topology.grid(mesh_shape, names))
    vid = g.inputs[0]
    via = cm.reshard_via(vid, s, d)
    steps = cm.reshard(vid, s, d)
    assert len(via) == 1 and math.isfinite(sum(map(cm.comm_time, steps)))
    assert cm.reshard(vid, s, d, direct=True) and \
        sum(map(cm.comm_time, cm.reshard(vid, s, d, direct=True))) == math.inf

    def compile_in_16(path):
        arg = json.dumps([mesh_shape, names, shape, s, d, path])
        return subprocess.run([sys.executable, "-c", _COMPILE_IN_16, arg], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parents[2], timeout=600)

    direct = compile_in_16([])
    assert direct.returncode != 0  # jaxlib dies (SIGFPE in 0.10)
    stepped = compile_in_16(list(via))
    assert stepped.returncode == 0, stepped.stderr[-2000:]
    assert json.loads(stepped.stdout.strip().splitlines()[-1]) == [
        list(t) for t in sorted((c.kind, list(c.axes), c.bytes) for c in steps)]


def _every_spec(rank, names):
    """Every layout of a rank-``rank`` array on mesh axes ``names``: each axis on one dimension
    or none, the axes of a dimension in either order."""
    import itertools

    out = set()
    for where in itertools.product(range(-1, rank), repeat=len(names)):
        for order in itertools.permutations(names):
            out.add(tuple(tuple(a for a in order if where[names.index(a)] == d)
                          for d in range(rank)))
    return sorted(out)


@pytest.mark.parametrize("mesh,shape", [
    # (dimensions the device count divides, some many times over: the scaled replay's case;
    # others it does not, among them uneven ones: replayed as they are)
    (((2, 4), ("a", "b")), (32, 24, 8)),
    (((2, 2, 2), ("a", "b", "c")), (64, 8, 12)),
    (((8,), ("a",)), (16, 6, 8)),
    (((3, 2), ("a", "b")), (36, 6, 4)),
    (((4, 2, 2), ("a", "b", "c")), (128, 16, 2)),
])
def test_the_scaled_replay_is_the_replay(mesh, shape):
    """``reshard_comms`` replays a change on an array whose dimensions the device count divides
    are cut to that count (``comm._scaled_replay``): the same collectives, their bytes scaled,
    as the replay of the array itself, for every pair of layouts."""
    import math

    from hulkjax.cost import comm
    from hulkjax.errors import UncompilableLayoutChangeError

    sizes = tuple(zip(mesh[1], mesh[0]))
    specs = _every_spec(len(shape), list(mesh[1]))
    assert any(d % math.prod(mesh[0]) == 0 and d > math.prod(mesh[0]) for d in shape)
    for src in specs:
        for dst in specs:
            if src == dst:
                continue
            try:
                want = comm._replayed.__wrapped__(shape, 4, src, dst, sizes)
            except UncompilableLayoutChangeError:
                with pytest.raises(UncompilableLayoutChangeError):
                    comm._scaled_replay(shape, 4, src, dst, sizes)
                continue
            assert comm._scaled_replay(shape, 4, src, dst, sizes) == want, (src, dst)
