"""Inputs and outputs that real training steps have and the zoo does not: they must just work.

float64 numpy arrays (JAX computes in float32 without x64), PRNG keys (typed ``jax.random.key`` and
raw ``PRNGKey``) carried in the state for dropout, weakly typed scalars, Python constants and
pass-through values among the results, optax/flax ``TrainState``. Each sharded step must equal
``jax.jit`` of the same step, under every strategy that applies, without hulkjax warnings.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hulkjax as hj
from hulkjax.errors import StrategyNotApplicableError
from tests.helpers import assert_steps_match, assert_trees_close, first_steps

TOPO = hj.Topology.grid((2, 4), ("data", "model"), bandwidth=(25e9, 450e9), latency=(5e-6, 1e-6))


def _numeric(tree):
    """Typed PRNG keys as their uint32 data, so that they can be compared."""
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def _matches_jit_under_every_strategy(step, *args, steps=2):
    ref, ref_args = jax.jit(step), jax.device_get(args)
    expected = []
    for _ in range(steps):
        out = ref(*ref_args)
        expected.append(jax.device_get(_numeric(out)))
        ref_args = (out[0], *ref_args[1:])
    for strategy in hj.strategies.names():
        sharded = hj.hulk_shard(step, topology=TOPO, strategy=strategy)
        call_args = args
        try:
            for want in expected:
                out = sharded(*call_args)
                assert_trees_close(_numeric(out), want)
                call_args = (out[0], *call_args[1:])
        except StrategyNotApplicableError:
            continue


def _linear_step(state, batch):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(state["w"])
    return {"w": state["w"] - 0.1 * g}, {"loss": loss}


def test_float64_numpy_arrays_are_taken_as_float32_like_jax_does():
    rng = np.random.default_rng(0)
    state = {"w": rng.normal(size=(4, 4))}  # float64
    batch = {"x": rng.normal(size=(8, 4)), "y": rng.normal(size=(8, 4))}
    _matches_jit_under_every_strategy(_linear_step, state, batch)
    plan = hj.plan(_linear_step, state, batch, topology=TOPO)
    assert {t.dtype for t in plan.inputs} == {"float32"}


def _dropout_step(state, batch):
    key, sub = jax.random.split(state["key"])

    def loss_fn(w):
        h = batch["x"] @ w
        keep = jax.random.bernoulli(sub, 0.75, h.shape)
        return jnp.mean(jnp.where(keep, h / 0.75, 0.0) ** 2)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    return {"w": state["w"] - 0.1 * g, "key": key}, {"loss": loss}


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_prng_keys_in_the_state(make_key):
    """Any step drawing random numbers has key-typed values (``key<fry>``) inside, which numpy
    cannot name; a typed key can also be an argument and a result."""
    state = {"w": jnp.ones((4, 4)), "key": make_key(0)}
    batch = {"x": jnp.arange(32.0).reshape(8, 4) / 32}
    _matches_jit_under_every_strategy(_dropout_step, state, batch)
    hj.plan(_dropout_step, state, batch, topology=TOPO, strict=True)  # key ops have rules


def test_weakly_typed_scalars_python_constants_and_pass_through_results():
    def step(state, batch):
        new = {"w": state["w"] * batch["decay"], "frozen": state["frozen"], "count": state["count"] + 1}
        return new, {"loss": jnp.sum(new["w"]), "version": 3, "scale": 0.5, "same": new["w"]}

    state = {"w": jnp.ones((8, 4)), "frozen": jnp.arange(8.0), "count": jnp.asarray(0)}
    batch = {"decay": jnp.asarray(0.9)}  # weakly typed
    _matches_jit_under_every_strategy(step, state, batch)


def test_a_flax_train_state():
    model = nn.Dense(4)
    x = jnp.arange(32.0).reshape(8, 4) / 32
    params = model.init(jax.random.PRNGKey(0), x)
    ts = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    assert type(ts.step) is int  # TrainState.create leaves a Python int, which jax.jit takes

    def step(ts, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(ts.apply_fn(p, batch["x"]) ** 2))(ts.params)
        return ts.apply_gradients(grads=g), loss

    _matches_jit_under_every_strategy(step, ts, {"x": x})


# ---- Python scalars in the state, as jax.jit takes them ------------------------------------

EIGHT = hj.Topology.grid((8,), ("d",), bandwidth=100e9, latency=5e-6)


def _types(tree):
    """Every leaf's (dtype, weak type): what jax.jit's results say beyond their values."""
    return jax.tree.map(lambda x: (str(x.dtype), bool(x.weak_type)), tree)


@pytest.fixture(scope="module")
def flax_train_state():
    """A flax TrainState straight from ``TrainState.create`` (``step`` is the Python int 0), the
    batch, and a step returning the counter among its metrics."""
    model = nn.Dense(8)
    x = jnp.arange(64.0).reshape(16, 4) / 64
    params = model.init(jax.random.PRNGKey(0), x)
    ts = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    assert type(ts.step) is int and ts.step == 0

    def step(ts, batch):
        def loss_fn(p):
            return jnp.mean((ts.apply_fn(p, batch["x"]) - batch["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(ts.params)
        return ts.apply_gradients(grads=g), {"loss": loss, "step": ts.step}

    batch = {"x": x, "y": jnp.cos(jnp.arange(128.0)).reshape(16, 8)}
    return ts, batch, step


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_a_train_state_with_a_python_step_under_hulk_shard(flax_train_state, strategy,
                                                           compile_count):
    """Three steps equal jax.jit's, the counter comes back as jit returns it (a weakly typed
    int32), and feeding the step its own result neither plans nor compiles again."""
    ts, batch, step = flax_train_state
    refs = first_steps(jax.jit(step), ts, batch)
    sharded = hj.hulk_shard(step, topology=EIGHT, strategy=strategy)
    final = assert_steps_match(sharded, ts, batch, refs, compile_count)
    assert _types(final) == _types(refs[-1][0])
    assert final.step.dtype == jnp.int32 and final.step.weak_type and int(final.step) == 3
    plan = sharded.plan
    assert plan.strategy == strategy
    (counter,) = [t for t in plan.inputs if t.path == "ts/step"]
    assert counter.shape == () and counter.dtype == "int32"
    if strategy == "fsdp":  # the parameters really are sharded
        kernel = next(t for t in plan.inputs if t.path.endswith("params/params/kernel"))
        assert any(e is not None for e in kernel.spec), kernel.spec


@pytest.mark.parametrize("strategy", ["dp", "fsdp"])
def test_a_train_state_with_a_python_step_through_plan_and_emit(flax_train_state, strategy,
                                                               compile_count):
    ts, batch, step = flax_train_state
    refs = first_steps(jax.jit(step), ts, batch)
    plan = hj.plan(step, ts, batch, topology=EIGHT, strategy=strategy)
    emitted = hj.emit(step, plan)
    final = assert_steps_match(emitted, ts, batch, refs, compile_count)
    assert _types(final) == _types(refs[-1][0])
    # A plan read back from JSON is emitted for the same arguments: the step is traced again.
    again = hj.emit(step, hj.Plan.from_dict(plan.to_dict()))
    assert_trees_close(again(ts, batch), refs[0])


def test_python_scalars_keep_jits_dtype_promotion_and_weak_types(compile_count):
    """A Python float scales a bfloat16 weight in bfloat16 (it is weakly typed); the scalars come
    back as jax.jit returns them: weakly typed float32 / int32, and a (strong) bool."""

    def step(state, batch):
        w = state["w"] * state["decay"]
        new = {"w": w, "decay": state["decay"], "count": state["count"] + 1, "on": state["on"]}
        loss = jnp.sum(w.astype(jnp.float32) * batch["x"]) * state["decay"]
        return new, {"loss": loss, "count": state["count"], "half": state["decay"] * 0.5}

    state = {"w": jnp.ones((8, 4), jnp.bfloat16), "decay": 0.5, "count": 0, "on": True}
    batch = {"x": jnp.arange(32.0).reshape(8, 4)}
    refs = first_steps(jax.jit(step), state, batch)
    assert _types(refs[0][0]) == {"w": ("bfloat16", False), "decay": ("float32", True),
                                  "count": ("int32", True), "on": ("bool", False)}
    for strategy in ("dp", "fsdp"):
        sharded = hj.hulk_shard(step, topology=EIGHT, strategy=strategy)
        out = sharded(state, batch)
        assert _types(out) == _types(refs[0]), strategy
        assert_steps_match(sharded, out[0], batch, refs[1:], compile_count)
