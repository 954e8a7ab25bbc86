"""One primitive taxonomy: the families of JAX primitives that hulkjax treats alike.

Every table that keys on primitives (FLOPs, dimension rules, follow rules, fusion, roles, views)
takes its families from here, so a primitive is described once. Handles come from
``jax.extend.core.primitives``; a primitive JAX does not export there (``split``) is found by
tracing a public function that emits it (:func:`discovered`), never from ``jax._src``.

>>> from jax.extend.core import primitives as P
>>> P.tanh_p in ELEMENTWISE, P.reshape_p in VIEWS, P.scan_p in LOOPS
(True, True, True)
"""

from __future__ import annotations

import functools

from jax.extend.core import primitives as P


def handles(*names: str) -> frozenset:
    """The public handles of the named primitives (names JAX does not export are skipped)."""
    return frozenset(getattr(P, f"{n}_p") for n in names if hasattr(P, f"{n}_p"))


ELEMENTWISE = handles(
    "abs", "acos", "acosh", "add", "add_jaxvals", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "lgamma",
    "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "pow", "rem",
    "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh",
    "and", "or", "not", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "clz", "eq_to", "le_to", "lt_to", "imag", "real", "conj", "complex",
    "polygamma", "igamma", "igammac", "igamma_grad_a", "bessel_i0e", "bessel_i1e", "zeta",
    "regularized_incomplete_beta", "random_gamma_grad")
"""Arithmetic, comparisons, transcendentals and selects: one FLOP per output element, operands of
the result's rank (lax broadcasts only size-1 dimensions)."""

CASTS = handles("convert_element_type", "copy", "add_jaxvals", "reduce_precision",
                 "stop_gradient")
"""Value-preserving unary operators: the result is the operand, maybe in another dtype."""

REDUCTIONS = handles("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                      "reduce_or", "reduce_xor")
"""Reductions over ``axes``: the reduced dimensions disappear."""

ARG_REDUCTIONS = handles("argmax", "argmin")
"""Index of the extreme value along ``axes``."""

CUMULATIVE = handles("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
"""Scans along ``axis``: the result has the operand's shape."""

PER_INPUT_ELEMENT = REDUCTIONS | ARG_REDUCTIONS | CUMULATIVE
"""Primitives costing one FLOP per input element."""

VIEWS = handles("convert_element_type", "copy", "reshape", "squeeze", "transpose",
                 "broadcast_in_dim")
"""Operators through which a parameter is still the parameter (casts, reshapes, broadcasts)."""

PASS_THROUGH = handles("convert_element_type", "copy", "reshape", "squeeze", "transpose",
                       "device_put")
"""Views that keep every element (no broadcast): what the tracer follows to find a parameter's
uses (``device_put``: the same values, in another memory)."""

SAME_SHAPE_UPDATES = ELEMENTWISE | handles("convert_element_type", "copy", "add_jaxvals",
                                           "device_put")
"""Operators of an optimizer update: elementwise, result shaped like the state it updates (and
``device_put``: state kept in host memory between steps is brought to the device for its update
and put back)."""

REARRANGING = handles("rev", "transpose", "reshape", "copy", "squeeze")
"""Whole-tensor rearrangements (same elements, other order): one gather serves all copies."""

BROADCAST_PATH = handles("broadcast_in_dim", "convert_element_type", "reshape")
"""What a broadcast statistic goes through on its way into a same-shaped operand."""

FUSIBLE = ELEMENTWISE | handles("convert_element_type", "copy", "add_jaxvals", "reduce_precision",
                                "broadcast_in_dim", "reshape", "squeeze", "transpose")
"""Loop-fusible operators: they touch memory only for tensors entering or leaving their fusion."""

POOLING = handles("reduce_window_sum", "reduce_window_max", "reduce_window_min",
                   "reduce_window")
"""Pooling (forward)."""

WINDOW_GRADIENTS = handles("select_and_scatter_add", "select_and_gather_add")
"""The gradients of pooling."""

SIZE_PRESERVING = handles("slice", "dynamic_slice", "dynamic_update_slice", "pad", "rev", "sort",
                           "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
"""Slicing, padding, reversal, sorting and scans: dimensions that keep their size keep their
layout."""

SHAPE_OPS = handles("broadcast_in_dim", "reshape", "transpose", "squeeze")
"""Operators that move dimensions around."""

RANDOM_KEYS = handles("random_split", "random_fold_in")
"""Operators on arrays of PRNG keys that map over the key array's dimensions."""

SCATTERS = handles("scatter", "scatter_add", "scatter_mul", "scatter_min", "scatter_max")
"""Scatters (with a combiner for all but ``scatter``)."""

COMBINING_SCATTERS = handles("scatter_add", "scatter_mul", "scatter_min", "scatter_max")
"""Scatters whose partial results combine (sum, product, min, max): updates split over devices
leave partial results that one all-reduce (with that combiner) completes."""

TOP_K = handles("top_k", "approx_top_k")
"""The ``k`` largest along one axis (values and indices)."""

PASSTHROUGH = handles("device_put", "sharding_constraint", "optimization_barrier",
                      "name")  # + found below
"""Operators whose results are their operands, one for one: a layout passes through each
(``name`` is ``jax.ad_checkpoint.checkpoint_name``: a label for remat policies on a value)."""

LOOPS = handles("scan", "while", "cond")
"""Control flow kept as one graph node whose bodies are sub-graphs, costed by trip count."""


def _kernel_primitives() -> frozenset:
    try:
        from jax.experimental.pallas import pallas_call_p
    except ImportError:  # pragma: no cover - Pallas ships with JAX
        return frozenset()
    return frozenset({pallas_call_p})


KERNELS = _kernel_primitives()
"""Pallas kernels (``pallas_call``): one node each, not inlined (their bodies run on chip), read
by :mod:`hulkjax.trace.kernels`."""

INLINED_BODIES = {P.jit_p: "jaxpr", P.closed_call_p: "call_jaxpr",
                  P.custom_jvp_call_p: "call_jaxpr", P.custom_vjp_call_p: "call_jaxpr",
                  P.remat_p: "jaxpr"}
"""Primitives the tracer inlines, with the parameter holding the body to inline."""

NO_DATA_NAMES = ("iota", "random_seed", "random_bits", "random_wrap", "random_unwrap",
                 "threefry2x32", "rng_bit_generator", "rng_uniform", "create_token", "after_all")


@functools.cache
def discovered(name: str):
    """The handle of a primitive JAX does not export in ``jax.extend.core.primitives``, found by
    tracing a public function that binds it; ``None`` if this JAX has no such primitive.

    >>> discovered("split").name
    'split'
    """
    import jax
    import jax.numpy as jnp

    two = jax.ShapeDtypeStruct((2,), jnp.float32)  # abstract: no backend is started
    raw_key = jax.ShapeDtypeStruct((2,), jnp.uint32)

    def wrap_unwrap():
        return jax.make_jaxpr(lambda k: jax.random.key_data(jax.random.wrap_key_data(k)))(raw_key)

    emitters = {
        "split": lambda: jax.make_jaxpr(lambda x: jax.lax.split(x, (1, 1)))(two),
        "stack": lambda: jax.make_jaxpr(lambda x: jnp.stack([x, x]))(two),
        "unstack": lambda: jax.make_jaxpr(lambda x: jnp.unstack(x))(two),
        "tile": lambda: jax.make_jaxpr(lambda x: jnp.tile(x, 2))(two),
        "optimization_barrier": lambda: jax.make_jaxpr(jax.lax.optimization_barrier)(two),
        "random_wrap": wrap_unwrap,
        "random_unwrap": wrap_unwrap,
    }
    make = emitters.get(name)
    if make is None:
        return None
    for eqn in make().jaxpr.eqns:
        if eqn.primitive.name == name:
            return eqn.primitive
    return None


NO_DATA = handles(*NO_DATA_NAMES) | frozenset(
    p for p in (discovered("random_wrap"), discovered("random_unwrap")) if p is not None)
"""Operators with nothing to shard of their own: constants made in place, key plumbing,
annotations the emitter replaces. Known to the rules without a rule."""

PASSTHROUGH = PASSTHROUGH | frozenset(
    p for p in (discovered("optimization_barrier"),) if p is not None)

SPLIT = frozenset(p for p in (discovered("split"),) if p is not None)
"""``split``: one operand into pieces along ``axis`` (not exported by ``jax.extend``)."""

STACK = frozenset(p for p in (discovered("stack"),) if p is not None)
"""``stack`` (``jnp.stack``): same-shaped operands along a new dimension ``axis``."""

TILE = frozenset(p for p in (discovered("tile"),) if p is not None)
"""``tile`` (``jnp.tile``): the operand repeated ``reps[d]`` times along each dimension ``d``
(XLA lowers it to a broadcast between two reshapes: fusible, no arithmetic)."""

SHAPE_OPS = SHAPE_OPS | TILE
FUSIBLE = FUSIBLE | TILE

UNSTACK = frozenset(p for p in (discovered("unstack"),) if p is not None)
"""``unstack`` (``jnp.unstack``, the gradient of ``stack``): one result per index of ``axis``."""
