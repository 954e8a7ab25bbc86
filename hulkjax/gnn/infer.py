"""The planner network's forward pass in NumPy, for planning.

Training uses the flax module (:class:`hulkjax.training.model.PlannerNet`, jitted, on padded
buckets).
Planning calls the network once per graph, and a first jitted call costs a compilation (about a
second on 2 CPU cores for GPT-2-sized graphs), more than planning itself should take. This is the
same computation on the unpadded arrays with the same parameters, in NumPy: no tracing, no
compilation. ``tests/gnn/test_infer.py`` holds it equal to ``PlannerNet.apply``.

>>> import numpy as np
>>> np.round(_gelu(np.array([0.0, 1.0])), 4).tolist()
[0.0, 0.8412]
"""

from __future__ import annotations

import jax
import numpy as np

from hulkjax.errors import HulkjaxError
from hulkjax.gnn.features import AXIS_FEATURES, GROUP_FEATURES

_C = np.float32(np.sqrt(2.0 / np.pi))
_BLOCK_ELEMENTS = 1 << 20  # float32 elements of a block's [groups, K, A, H] temporaries


def _gelu(x):
    # flax.linen.gelu (approximate=True): the tanh form, in place on one temporary.
    y = x * x
    y *= np.float32(0.044715)
    y += 1
    y *= x
    y *= _C
    np.tanh(y, out=y)
    y += 1
    y *= x
    y *= np.float32(0.5)
    return y


def _dense(p, x):
    return x @ p["kernel"] + p["bias"]


def _mlp(p, x, n: int):
    for i in range(n):
        x = _dense(p[f"Dense_{i}"], x)
        if i < n - 1:
            x = _gelu(x)
    return x


def _layer_norm(p, x, eps: float = 1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _attention(p, h, e, senders, receivers):
    n = h.shape[0]
    hs, hr = h[senders], h[receivers]
    logits = _dense(p["Dense_0"], np.tanh(_dense(p["Dense_1"], np.concatenate([hr, hs, e], -1))))[:, 0]
    # Softmax over each receiver's incoming edges.
    top = np.full(n, -np.inf, logits.dtype)
    np.maximum.at(top, receivers, logits)
    w = np.exp(logits - top[receivers])
    total = np.zeros(n, w.dtype)
    np.add.at(total, receivers, w)
    alpha = w / total[receivers]
    msg = _dense(p["Dense_2"], np.concatenate([hs, e], -1)) * alpha[:, None]
    agg = np.zeros((n, msg.shape[1]), msg.dtype)
    np.add.at(agg, receivers, msg)
    return _layer_norm(p["LayerNorm_0"], h + _mlp(p["_MLP_0"], agg, 2))


def log_probs(params, jg, *, layers: int) -> np.ndarray:
    """Log-probabilities ``[groups, K]`` of every candidate of a
    :class:`hulkjax.gnn.features.JoinedGraph` (``-inf``-like where the mask is False)."""
    try:
        return _log_probs(_to_numpy(params)["params"], jg, layers)
    except (KeyError, ValueError, TypeError) as e:
        raise HulkjaxError(
            f"the planner weights do not fit the network ({type(e).__name__}: {e}): their "
            f"parameter tree or shapes differ from a PlannerNet with {layers} layers and the "
            f"features of this version. Retrain them with `hulkjax train-gnn --out DIR`.") from e


def _log_probs(p, jg, layers: int) -> np.ndarray:
    n_g, n_a = jg.num_groups, jg.axis_x.shape[0]
    x = np.zeros((n_g + n_a, GROUP_FEATURES + AXIS_FEATURES + 1), np.float32)
    x[:n_g, :GROUP_FEATURES] = jg.group_x
    x[n_g:, GROUP_FEATURES:GROUP_FEATURES + AXIS_FEATURES] = jg.axis_x
    x[n_g:, -1] = 1.0  # is-axis flag (as training.batching.to_graphs_tuple sets it)
    senders, receivers = np.asarray(jg.senders), np.asarray(jg.receivers)
    h = _mlp(p["_MLP_0"], x, 2)
    e = _mlp(p["_MLP_1"], np.asarray(jg.edge_x, np.float32), 1)
    for i in range(layers):
        h = _attention(p[f"_AttentionLayer_{i}"], h, e, senders, receivers)
    # Only the real mesh axes: the network zeroes the padded ones' terms.
    real = np.flatnonzero(np.asarray(jg.axis_mask))
    axes = _dense(p["Dense_1"], h[n_g:][:len(real)])[None, None]
    hg = _dense(p["Dense_3"], h[:n_g])[:, None, :]
    # The candidates' scores, a block of groups at a time: every group's are computed alone
    # (the same floats), and the temporaries ([groups, K, A, H] float32: 70 MB for a LLaMA-8B
    # step at once) stay a few MB, reused from block to block rather than paged in afresh.
    k = jg.cand_roles.shape[1]
    step = max(1, _BLOCK_ELEMENTS // max(1, k * len(real) * axes.shape[-1]))
    blocks = []
    for s in range(0, n_g, step):
        b = slice(s, s + step)
        role_h = _dense(p["Dense_0"], jg.cand_roles[b][:, :, real])  # [block, K, A, H]
        role_h += axes
        cand = _gelu(role_h).sum(axis=2) + _dense(p["Dense_2"], jg.cand_extra[b])
        blocks.append(_mlp(p["_MLP_2"], _gelu(cand + hg[b]), 2)[..., 0])
    score = np.concatenate(blocks) if blocks else np.zeros(jg.cand_mask.shape, np.float32)
    score = np.where(jg.cand_mask, score, -1e9)
    top = score.max(-1, keepdims=True)
    return score - top - np.log(np.exp(score - top).sum(-1, keepdims=True))


_NUMPY: dict = {}


def _to_numpy(params):
    key = id(params)
    if key not in _NUMPY:
        _NUMPY.clear()
        _NUMPY[key] = (params, jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), params))
    return _NUMPY[key][1]
