"""The rewrite behind benchmarks/REWRITE.md: ``split`` and ``concatenate`` re-emitted as slices and
padded sums compute the same values, bit for bit, and leave none of them behind."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import benchmark_module


@pytest.fixture(scope="module")
def rewrite():
    with benchmark_module("rewrite") as module:
        yield module


def _step(state, batch):
    """A fused QKV split (GPT-2) and a rotate_half concatenate (LLaMA), inside a jit, with a
    boolean concatenate; the gradient adds the transposes (concatenate of split, and back)."""

    @jax.jit
    def loss(w):
        q, k, v = jnp.split(batch["x"] @ w, 3, axis=1)
        x1, x2 = jnp.split(q, 2, axis=-1)
        rot = jnp.concatenate([-x2, x1], axis=-1)
        mask = jnp.concatenate([batch["m"], ~batch["m"]], axis=-1)
        return jnp.sum(jnp.where(mask, rot * k, v) ** 2)

    value, g = jax.value_and_grad(loss)(state["w"])
    return {"w": state["w"] - 0.1 * g}, {"loss": value}


STATE = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((8, 24)), jnp.float32)}
BATCH = {"x": jnp.asarray(np.random.default_rng(1).standard_normal((4, 8)), jnp.float32),
         "m": jnp.asarray([[True, False, True, True]] * 4)}


def test_rewrite_is_bit_identical_and_removes_split_and_concatenate(rewrite):
    step2, counts = rewrite.rewritten_step(_step, STATE, BATCH)
    want = jax.jit(_step)(STATE, BATCH)
    got = jax.jit(step2)(STATE, BATCH)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    before = rewrite.primitive_counts(_step, STATE, BATCH)
    after = rewrite.primitive_counts(step2, STATE, BATCH)
    assert before["split"] >= 2 and before["concatenate"] >= 2
    assert after["split"] == after["concatenate"] == 0
    assert counts["split"] == before["split"] and counts["concatenate"] == before["concatenate"]


def test_identity_rewrite_keeps_every_primitive(rewrite):
    step2, counts = rewrite.rewritten_step(_step, STATE, BATCH, rewrite=())
    after = rewrite.primitive_counts(step2, STATE, BATCH)
    before = rewrite.primitive_counts(_step, STATE, BATCH)
    # Inlined jit calls aside, the same equations.
    assert {p: n for p, n in after.items() if p != "jit"} == \
        {p: n for p, n in before.items() if p != "jit"}
    assert not counts
