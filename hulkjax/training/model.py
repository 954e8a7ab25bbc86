"""The planner network: attention message passing over the joined graph, then candidate scores.

Like TAG and HeteroG, one network sees operators and devices together. Each layer updates every
node from its neighbours with attention whose logits and messages are conditioned on the edge
(tensor bytes and direction, or an operator<->axis link):

    m_ij = W_m [h_j, e_ij],  a_ij = softmax_j(w_a . tanh(W_a [h_i, h_j, e_ij])),
    h_i <- LayerNorm(h_i + MLP(sum_j a_ij m_ij))

A candidate of group ``g`` is scored from ``h_g`` and, for each mesh axis, the axis's embedding
combined with the role the axis plays in that candidate; the scores are a softmax over the
group's real candidates (masked).

>>> import jax, numpy as np
>>> net = PlannerNet(hidden=16, layers=1)
>>> isinstance(net, PlannerNet)
True
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph


class _MLP(nn.Module):
    features: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for i, f in enumerate(self.features):
            x = nn.Dense(f)(x)
            if i < len(self.features) - 1:
                x = nn.gelu(x)
        return x


class _AttentionLayer(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, h, edges, senders, receivers, n_nodes):
        hs, hr = h[senders], h[receivers]
        logits = nn.Dense(1)(jnp.tanh(nn.Dense(self.hidden)(jnp.concatenate([hr, hs, edges], -1))))
        alpha = jraph.segment_softmax(logits[:, 0], receivers, num_segments=n_nodes)
        msg = nn.Dense(self.hidden)(jnp.concatenate([hs, edges], -1)) * alpha[:, None]
        agg = jax.ops.segment_sum(msg, receivers, num_segments=n_nodes)
        return nn.LayerNorm()(h + _MLP((self.hidden, self.hidden))(agg))


class PlannerNet(nn.Module):
    """Scores every candidate of every group.

    Call with ``(graph, roles, extra, mask, axis_index, axis_mask)`` as produced by
    :func:`hulkjax.gnn.features.to_graphs_tuple`; returns log-probabilities ``[nodes, K]``
    (``-inf``-like where ``mask`` is False).
    """

    hidden: int = 64
    layers: int = 4

    @nn.compact
    def __call__(self, graph: jraph.GraphsTuple, roles, extra, mask, axis_index, axis_mask):
        n = graph.nodes.shape[0]
        h = _MLP((self.hidden, self.hidden))(graph.nodes)
        e = _MLP((self.hidden // 2,))(graph.edges)
        for _ in range(self.layers):
            h = _AttentionLayer(self.hidden)(h, e, graph.senders, graph.receivers, n)
        axes = h[axis_index] * axis_mask[:, None]  # [A, H]
        # per candidate and axis: role features with the axis embedding
        role_h = nn.Dense(self.hidden)(roles)  # [N, K, A, H]
        pair = nn.gelu(role_h + nn.Dense(self.hidden)(axes)[None, None])
        pair = pair * axis_mask[None, None, :, None]
        cand = pair.sum(axis=2) + nn.Dense(self.hidden)(extra)  # [N, K, H]
        score = _MLP((self.hidden, 1))(nn.gelu(cand + nn.Dense(self.hidden)(h)[:, None, :]))[..., 0]
        score = jnp.where(mask, score, -1e9)
        return jax.nn.log_softmax(score, axis=-1)
