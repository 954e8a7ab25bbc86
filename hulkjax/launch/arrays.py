"""Global arrays from host values, and how far two result trees are apart.

Inputs become global ``jax.Array`` s with :func:`to_global`: every process computes the same host
value (zoo models from the seed) and fills only its own shards (``jax.make_array_from_callback``),
so no input crosses the network.
"""

from __future__ import annotations

import jax
import numpy as np

from hulkjax.errors import UnsupportedStepError
from hulkjax.trace.tracer import PYTHON_SCALARS


def to_global(tree, shardings):
    """A pytree of host values (the same on every process) as global ``jax.Array`` s.

    Each process fills only the shards its own devices hold (``jax.make_array_from_callback``), so
    nothing crosses the network; values the same everywhere is the caller's contract (the launcher
    checks it with one small all-gather of a fingerprint). Leaves that cannot be viewed as a numpy
    array (PRNG key arrays) and Python scalars (weakly typed under ``jax.jit``, as they stay here)
    go through ``jax.device_put``, which checks equality across processes.

    Args:
      tree: pytree of numpy arrays / fully addressable ``jax.Array`` s / Python scalars.
      shardings: a flat sequence of ``jax.sharding.Sharding``, one per leaf (``ShardedStep.
        in_shardings`` for the step's arguments).

    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    >>> to_global({"x": np.arange(4.0)}, [s])["x"].sharding == s
    True
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shardings = list(shardings)
    if len(leaves) != len(shardings):
        raise UnsupportedStepError(f"to_global: {len(leaves)} leaves but {len(shardings)} "
                                   f"shardings; pass one sharding per leaf.")
    out = []
    for x, s in zip(leaves, shardings):
        if isinstance(x, PYTHON_SCALARS):
            # jax.jit takes a Python scalar as a weakly typed array; device_put keeps the weak
            # type (a host array would lose it) and checks that every process passes the same.
            out.append(jax.device_put(x, s))
            continue
        try:
            host = np.asarray(x)
        except (TypeError, ValueError):  # extended dtypes (PRNG keys)
            out.append(jax.device_put(x, s))
            continue
        host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
        out.append(jax.make_array_from_callback(host.shape, s, lambda idx, h=host: h[idx]))
    return jax.tree_util.tree_unflatten(treedef, out)


SAFETY = 16.0
"""How many times the reference spread a sharded run may differ from the unsharded one.

Measured, not guessed: on the zoo's tiny models (gpt2, bert, vit, moe, transformer-block, mlp,
cnn) under dp, fsdp, megatron, dp_tp and auto on 2x2 fake CPU devices, three AdamW steps, the
sharded-vs-unsharded difference of a leaf was at most 8.6x that leaf's float32-vs-float64 spread
(reproduced by ``benchmarks/check_tolerance.py``); 16
leaves about 2x room. A real sharding bug (a missing reduction, a wrong slice) moves a leaf by
the size of its update, orders of magnitude above the spread, and still fails.
"""

ULPS = 4
"""Floor of the tolerance in units in the last place of a leaf's largest value (so a leaf that
both references compute bit-identically may still differ by a rounding in another order)."""


def tree_spread(a, b) -> list[float]:
    """Per leaf, the largest absolute difference of two runs of the same computation.

    ``a`` and ``b`` are two unsharded references (float32 and float64 here); the result is the
    scale of rounding the check allows for, leaf by leaf (``inf`` where a leaf is not finite in
    one of them but is in the other, so that leaf is not checked tighter than it can be).

    >>> tree_spread({"w": np.array([1.0, 2.0])}, {"w": np.array([1.0, 2.25])})
    [0.25]
    """
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        raise UnsupportedStepError(f"tree_spread: the two references have different structures "
                                   f"({ta} vs {tb}).")
    out = []
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            raise UnsupportedStepError(f"tree_spread: shapes {x.shape} and {y.shape} differ.")
        with np.errstate(invalid="ignore"):
            err = float(np.max(np.abs(x - y), initial=0.0))
        if not np.isfinite(err):
            err = 0.0 if np.array_equal(x, y, equal_nan=True) else float("inf")
        out.append(err)
    return out


def running_max_over_steps(per_step, spread) -> list[float]:
    """Per leaf of ``per_step`` (a list with one pytree per training step, e.g. each step's
    metrics), the largest of ``spread`` over the same leaf in this and the earlier steps.

    A scalar metric's float32-vs-float64 spread is one sample of a rounding error: it can be
    near zero at one step by chance (a loss both runs happen to round alike) while the sharded
    run's reduction order moves it by a few ulps of its summands (observed: step 7's loss of a
    6-layer GPT over 8 steps, spread 1e-7 against 5e-6 at the steps before it; ``dp`` differed
    by 6e-6 and failed a correct run). Rounding differences grow over steps, so a leaf is
    allowed at least what it was allowed before.

    >>> running_max_over_steps([{"loss": 1.0}, {"loss": 2.0}, {"loss": 3.0}], [1e-6, 0.0, 2e-6])
    [1e-06, 1e-06, 2e-06]
    """
    leaves = jax.tree_util.tree_flatten_with_path(per_step)[0]
    if len(leaves) != len(spread):
        raise UnsupportedStepError(f"running_max_over_steps: {len(spread)} spreads for "
                                   f"{len(leaves)} leaves.")
    seen: dict[str, float] = {}
    out = []
    for (path, _), s in zip(leaves, spread):
        key = jax.tree_util.keystr(path[1:])  # the leaf, whatever the step
        seen[key] = max(seen.get(key, 0.0), float(s))
        out.append(seen[key])
    return out


def tree_error(actual, expected, *, rtol: float | None = 1e-4, atol: float | None = 1e-5,
               spread=None, safety: float = SAFETY) -> dict:
    """How far two pytrees of arrays are apart, leaf by leaf.

    Two kinds of tolerance:
      - ``spread`` given (one float per leaf, from :func:`tree_spread` of two differently
        compiled unsharded runs): leaf ``i`` matches when its largest difference is at most
        ``safety * spread[i] + ULPS * eps(float32) * max|expected_i|``;
      - otherwise fixed ``rtol`` / ``atol`` (``numpy.allclose`` semantics).

    Returns:
      ``{"match": bool, "max_abs_err": float, "worst_leaf": str | None, "leaves": int,
      "mismatched_leaves": [path, ...], "rtol", "atol", "safety", "max_spread": float | None,
      "worst_ratio": float | None}``; ``worst_ratio`` is the largest error / tolerance over the
      leaves (above 1: a mismatch) when ``spread`` is given. ``match`` is False also when the
      structures or shapes differ (``"reason"`` says how).

    >>> tree_error({"a": [1.0, 2.0]}, {"a": [1.0, 2.0 + 1e-7]})["match"]
    True
    >>> tree_error({"a": [1.0, 2.0]}, {"a": [1.0, 2.5]})["mismatched_leaves"]
    ["['a'][1]"]
    >>> tree_error({"a": 2.0}, {"a": 2.001}, spread=[1e-4])["match"]  # 16 x 1e-4 > 1e-3
    True
    """
    out = {"match": True, "max_abs_err": 0.0, "worst_leaf": None, "leaves": 0,
           "mismatched_leaves": [], "rtol": rtol, "atol": atol,
           "safety": None if spread is None else safety,
           "max_spread": None, "worst_ratio": None}
    la, ta = jax.tree_util.tree_flatten_with_path(actual)
    lb, tb = jax.tree_util.tree_flatten(expected)
    if ta != tb:
        return out | {"match": False, "reason": f"tree structures differ: {ta} vs {tb}"}
    if spread is not None:
        spread = [float(s) for s in spread]
        if len(spread) != len(lb):
            raise UnsupportedStepError(f"tree_error: {len(spread)} spreads for {len(lb)} leaves; "
                                       f"pass one per leaf (tree_spread of two references).")
        out["max_spread"] = max(spread, default=0.0)
        out["worst_ratio"] = 0.0
    elif rtol is None or atol is None:
        raise UnsupportedStepError("tree_error: pass spread= (per-leaf reference spread) or both "
                                   "rtol= and atol=.")
    eps = float(np.finfo(np.float32).eps)
    for i, ((path, x), y) in enumerate(zip(la, lb)):
        name = jax.tree_util.keystr(path)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out["leaves"] += 1
        if x.shape != y.shape:
            out["match"] = False
            out["mismatched_leaves"].append(name)
            out.setdefault("reason", f"leaf {name} has shape {x.shape}, expected {y.shape}")
            continue
        with np.errstate(invalid="ignore"):
            err = float(np.max(np.abs(x - y), initial=0.0))
        if not np.isfinite(err):  # NaN where the other is finite, or inf - inf
            err = 0.0 if np.array_equal(x, y, equal_nan=True) else float("inf")
        if err > out["max_abs_err"] or out["worst_leaf"] is None:
            out["max_abs_err"], out["worst_leaf"] = max(err, out["max_abs_err"]), name
        if spread is not None:
            finite = np.abs(y[np.isfinite(y)])
            tol = safety * spread[i] + ULPS * eps * float(np.max(finite, initial=0.0))
            ratio = err / tol if tol > 0 else (0.0 if err == 0 else float("inf"))
            out["worst_ratio"] = max(out["worst_ratio"], ratio)
            ok = err <= tol
        else:
            ok = np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        if not ok:
            out["match"] = False
            out["mismatched_leaves"].append(name)
    return out
