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


def tree_error(actual, expected, *, rtol: float = 1e-4, atol: float = 1e-5) -> dict:
    """How far two pytrees of arrays are apart, leaf by leaf (``numpy.allclose`` semantics).

    Returns:
      ``{"match": bool, "max_abs_err": float, "worst_leaf": str | None, "leaves": int,
      "mismatched_leaves": [path, ...], "rtol": rtol, "atol": atol}``; ``match`` is False also
      when the structures or shapes differ (``"reason"`` says how).

    >>> tree_error({"a": [1.0, 2.0]}, {"a": [1.0, 2.0 + 1e-7]})["match"]
    True
    >>> tree_error({"a": [1.0, 2.0]}, {"a": [1.0, 2.5]})["mismatched_leaves"]
    ["['a'][1]"]
    """
    out = {"match": True, "max_abs_err": 0.0, "worst_leaf": None, "leaves": 0,
           "mismatched_leaves": [], "rtol": rtol, "atol": atol}
    la, ta = jax.tree_util.tree_flatten_with_path(actual)
    lb, tb = jax.tree_util.tree_flatten(expected)
    if ta != tb:
        return out | {"match": False, "reason": f"tree structures differ: {ta} vs {tb}"}
    for (path, x), y in zip(la, lb):
        name = jax.tree_util.keystr(path)
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out["leaves"] += 1
        if x.shape != y.shape:
            out["match"] = False
            out["mismatched_leaves"].append(name)
            out.setdefault("reason", f"leaf {name} has shape {x.shape}, expected {y.shape}")
            continue
        err = float(np.max(np.abs(x - y), initial=0.0))
        if not np.isfinite(err):  # NaN where the other is finite, or inf - inf
            err = 0.0 if np.array_equal(x, y, equal_nan=True) else float("inf")
        if err > out["max_abs_err"] or out["worst_leaf"] is None:
            out["max_abs_err"], out["worst_leaf"] = max(err, out["max_abs_err"]), name
        if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
            out["match"] = False
            out["mismatched_leaves"].append(name)
    return out
