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


class _ChainLayer(nn.Module):
    """Layer units along the step: each from itself and its two neighbours."""

    hidden: int

    @nn.compact
    def __call__(self, u):
        zero = jnp.zeros_like(u[:1])
        prev = jnp.concatenate([zero, u[:-1]], 0)
        nxt = jnp.concatenate([u[1:], zero], 0)
        return nn.LayerNorm()(u + _MLP((self.hidden, self.hidden))(
            jnp.concatenate([u, prev, nxt], -1)))


class _GroupLayer(nn.Module):
    """Device groups attending to each other through the links between them."""

    hidden: int

    @nn.compact
    def __call__(self, g, links):
        n = g.shape[0]
        gi = jnp.broadcast_to(g[:, None, :], (n, n, g.shape[1]))
        gj = jnp.broadcast_to(g[None, :, :], (n, n, g.shape[1]))
        logits = nn.Dense(1)(jnp.tanh(nn.Dense(self.hidden)(
            jnp.concatenate([gi, gj, links], -1))))[..., 0]
        alpha = jax.nn.softmax(logits, axis=-1)
        msg = nn.Dense(self.hidden)(jnp.concatenate([gj, links], -1)) * alpha[..., None]
        return nn.LayerNorm()(g + _MLP((self.hidden, self.hidden))(msg.sum(1)))


class GroupHead(nn.Module):
    """The device-group head (Hulk: a distribution over device groups per layer unit).

    Call with ``(unit_x, group_x, link_x)`` of a :class:`hulkjax.gnn.groups.StageGraph`; returns
    ``log P(unit k on group j)``, ``[units, groups]``. Trained by ``hulkjax train-gnn --head
    groups`` (:mod:`hulkjax.training.groups`); planning's NumPy twin is
    :func:`hulkjax.gnn.groups.group_log_probs`.

    >>> import jax, jax.numpy as jnp
    >>> head = GroupHead(hidden=8, layers=1)
    >>> x = (jnp.zeros((3, 11)), jnp.zeros((2, 8)), jnp.zeros((2, 2, 3)))
    >>> head.apply(head.init(jax.random.key(0), *x), *x).shape
    (3, 2)
    """

    hidden: int = 64
    layers: int = 3

    @nn.compact
    def __call__(self, unit_x, group_x, link_x):
        u = _MLP((self.hidden, self.hidden))(unit_x)
        g = _MLP((self.hidden, self.hidden))(group_x)
        links = _MLP((self.hidden // 2,))(link_x)
        for _ in range(self.layers):
            u = _ChainLayer(self.hidden)(u)
            g = _GroupLayer(self.hidden)(g, links)
        pair = nn.gelu(nn.Dense(self.hidden)(u)[:, None, :] + nn.Dense(self.hidden)(g)[None])
        score = _MLP((self.hidden, 1))(pair)[..., 0]
        return jax.nn.log_softmax(score, axis=-1)
