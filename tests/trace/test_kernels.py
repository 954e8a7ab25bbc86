"""Pallas kernels as operators: what the tracer reads of a ``pallas_call`` (hulkjax.trace.kernels).

The attention kernel is JAX's own (``jax.experimental.pallas.ops.gpu.attention.mha``), run
interpreted on CPU: third-party kernel code, traced as a user's step would trace it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import attention as pallas_attention

import hulkjax as hj
from hulkjax.rules import handling
from hulkjax.trace.kernels import localize

B, T, H, D = 2, 256, 4, 32
BLOCK = 64


def _mha(causal):
    sizes = pallas_attention.BlockSizes(block_q=BLOCK, block_k=BLOCK, block_q_dkv=BLOCK,
                                        block_kv_dkv=BLOCK, block_q_dq=BLOCK, block_kv_dq=BLOCK)

    def loss(q, k, v):
        o = pallas_attention.mha(q, k, v, None, causal=causal, block_sizes=sizes, interpret=True)
        return jnp.sum(o**2)

    return loss


def _kernels(fn, *shapes):
    g = hj.trace(fn, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    return {n.kernel.name: n for n in g.nodes if n.kernel is not None}


@pytest.fixture(scope="module")
def attention_kernels():
    qkv = [(B, T, H, D)] * 3
    return {causal: _kernels(jax.grad(_mha(causal), argnums=(0, 1, 2)), *qkv)
            for causal in (False, True)}


def test_a_kernel_is_one_known_node():
    assert handling(pl.pallas_call_p) == "follow"


def test_attention_kernel_flops_are_its_matmuls_and_a_causal_mask_halves_them(attention_kernels):
    full = 4.0 * B * H * T * T * D  # QK^T and PV, 2 FLOPs per multiply-add
    fwd = attention_kernels[False]["mha_forward"]
    assert fwd.flops == pytest.approx(full, rel=0.06)  # + the softmax's elementwise work
    # The causal kernel's loop over key blocks stops at the query block's diagonal, a bound
    # computed from program_id: evaluated per grid point, the kernel does (n + 1) / 2n of it.
    n = T // BLOCK
    causal = attention_kernels[True]["mha_forward"]
    assert causal.flops / fwd.flops == pytest.approx((n + 1) / (2 * n), rel=0.02)
    # The backward kernel (dK, dV and dQ loops) recomputes the scores: 7 matmuls against 2.
    bwd = attention_kernels[False]["mha_backward"]
    assert bwd.flops / fwd.flops == pytest.approx(3.5, rel=0.06)
    # Bytes: each query block reads the keys and values it visits, not T x T scores.
    assert causal.bytes < fwd.bytes < 4 * (n + 2) * B * T * H * D * 4


def test_attention_kernel_splits_by_batch_and_heads_not_by_the_causal_query_blocks(
        attention_kernels):
    fwd = attention_kernels[True]["mha_forward"].kernel
    assert fwd.grid == (T // BLOCK, B, H)
    assert fwd.parallel == {1, 2}  # program_id(0) is the query block the causal mask reads
    assert fwd.operand_axes[0] == (1, 0, 2, None)  # q: batch, query block, head
    assert fwd.operand_axes[1] == (1, None, 2, None)  # k: the whole sequence per program
    # Without a causal mask the body never asks where it is: query blocks split too.
    assert attention_kernels[False]["mha_forward"].kernel.parallel == {0, 1, 2}
    bwd = attention_kernels[True]["mha_backward"].kernel
    assert bwd.parallel == {0, 1}


def _kernel(grid, in_spec, out_spec, out_shape, body):
    return pl.pallas_call(body, grid=grid, in_specs=[in_spec], out_specs=out_spec,
                          out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32), interpret=True)


def test_a_grid_axis_that_accumulates_into_one_block_is_not_split():
    def row_sum(x_ref, o_ref):  # sums over the grid's second axis into one output block
        @pl.when(pl.program_id(1) == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += x_ref[...].sum(axis=1, keepdims=True)

    f = _kernel((4, 2), pl.BlockSpec((2, 8), lambda i, j: (i, j)),
                pl.BlockSpec((2, 1), lambda i, j: (i, 0)), (8, 1), row_sum)
    (node,) = _kernels(f, (8, 16)).values()
    assert node.kernel.parallel == {0}
    x = np.arange(128, dtype=np.float32).reshape(8, 16)
    np.testing.assert_allclose(f(x), x.sum(axis=1, keepdims=True))

    def last_block_sum(x_ref, o_ref):  # never asks where it is; the last j's write wins
        o_ref[...] = x_ref[...].sum(axis=1, keepdims=True)

    f = _kernel((4, 2), pl.BlockSpec((2, 8), lambda i, j: (i, j)),
                pl.BlockSpec((2, 1), lambda i, j: (i, 0)), (8, 1), last_block_sum)
    (node,) = _kernels(f, (8, 16)).values()
    assert node.kernel.parallel == {0}


def test_a_computed_block_index_is_not_split():
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    f = _kernel((4,), pl.BlockSpec((2, 8), lambda i: (3 - i, 0)),
                pl.BlockSpec((2, 8), lambda i: (i, 0)), (8, 8), copy)
    (node,) = _kernels(f, (8, 8)).values()
    assert node.kernel.operand_axes == ((None, None),)
    assert node.kernel.parallel == frozenset()


def test_localize_cuts_the_grid_and_the_arrays_alike():
    def double(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    f = _kernel((4, 2), pl.BlockSpec((2, 8), lambda i, j: (i, j)),
                pl.BlockSpec((2, 8), lambda i, j: (i, j)), (8, 16), double)
    eqn = jax.make_jaxpr(f)(jnp.ones((8, 16))).eqns[0]
    local = localize(eqn.params, {0: 2, 1: 2})
    assert local["grid_mapping"].grid == (2, 1)
    assert local["out_avals"][0].shape == (4, 8)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = eqn.primitive.bind(jnp.asarray(x), **local)
    np.testing.assert_allclose(out[0], 2 * x)


@pytest.mark.parametrize("causal", [False, True])
def test_tpu_flash_attention_costs_what_its_authors_estimate_less_what_a_causal_mask_skips(
        causal):
    """JAX's TPU flash-attention kernel (traced, not run: it compiles for TPUs only) states its own
    cost estimate for XLA's scheduler: the matmul FLOPs of a full T x T attention, and each of
    q, k, v and the output moved once."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

    b, h, t, d = 2, 4, 1024, 128
    x = jax.ShapeDtypeStruct((b, h, t, d), jnp.float32)
    (node,) = _kernels(lambda q, k, v: tpu_attention.flash_attention(q, k, v, causal=causal),
                       x.shape, x.shape, x.shape).values()
    kernel, estimate = node.kernel, node.params["cost_estimate"]
    n = kernel.grid[2]  # query blocks (the kernel's grid: batch, heads, query blocks, key blocks)
    assert kernel.grid == (b, h, n, kernel.grid[3])
    # Its pl.when skips the key blocks above the diagonal, a branch taken per grid point.
    share = (n + 1) / (2 * n) if causal else 1.0
    assert kernel.flops == pytest.approx(share * estimate.flops, rel=0.05)
    assert kernel.parallel == ({0, 1} if causal else {0, 1, 2})
    # Keys and values stream once per query block; queries and outputs move once per query
    # block too (the pipeline skips an unchanged block), not once per grid step.
    qkv = b * h * t * d * 4
    streamed = 2 * n * qkv * share + 2 * qkv
    assert kernel.bytes == pytest.approx(streamed, rel=0.15)


def test_a_kernel_hulkjax_cannot_read_is_replicated_with_the_warning(monkeypatch):
    from hulkjax.errors import UnsupportedPrimitiveWarning
    from hulkjax.trace import tracer

    def unreadable(params, shapes):
        raise AttributeError("grid_mapping laid out differently")

    def double(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    kernel = _kernel((8,), pl.BlockSpec((2, 16), lambda i: (i, 0)),
                     pl.BlockSpec((2, 16), lambda i: (i, 0)), (16, 16), double)

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((kernel(x) @ w) ** 2))(w)

    w, x = jnp.ones((16, 4)), jnp.ones((16, 16))
    topo = hj.Topology.grid((8,), ("d",))
    plan = hj.plan(step, w, x, topology=topo, strategy="dp")
    assert not plan.notes  # readable: the kernel splits with the batch, nothing to say
    monkeypatch.setattr(tracer, "describe_kernel", unreadable)
    with pytest.warns(UnsupportedPrimitiveWarning, match="pallas_call"):
        plan = hj.plan(step, w, x, topology=topo, strategy="dp")
    assert any("pallas_call" in n for n in plan.notes)
