"""``moe`` (flax.linen): transformer layers whose MLP is a GShard/Switch mixture of experts.

Each layer: ``x + Attention(LN(x))`` (optional), then ``x + MoE(LN(x))``; a final LayerNorm and a
Dense head regress per-token targets (MSE) plus ``aux_loss_weight`` times the load-balancing loss.

The MoE layer, all static-shaped (groups = sequences, so ``G = batch``, ``S = seq_len``)::

    router logits  gsd,de->gse        softmax (float32)  -> probs (G, S, E)
    top-k choice   argmax per round, position in the expert's queue by cumsum over S,
                   tokens past ``capacity`` dropped
    dispatch       (G, S, E, C) 0/1  -- one_hot(expert) x one_hot(position)
    combine        (G, S, E, C)      -- dispatch x gate (top-2 gates renormalised to sum to 1)
    expert input   gsec,gsd->egcd    (E, G, C, D)
    experts        egcd,edf->egcf -> gelu -> egcf,efd->egcd   weights (E, D, F), (E, F, D)
    output         gsec,egcd->gsd
    aux loss       E * sum_e  mean_s(top-1 mask)[e] * mean_s(probs)[e]   (Switch), mean over groups

``capacity = min(S, ceil(top_k * capacity_factor * S / E))`` tokens per expert per group.

Batch: ``{"x": (B, T, D) dtype, "y": (B, T, D) dtype}``. Metrics: ``loss`` (total), ``aux_loss``.

**Alpa's MoE language model** (its benchmark suite's, ``alpa/model/moe.py``) takes four options,
each off by default:

* ``moe_every=2``: only every second layer's MLP (layers 0, 2, ...) is a mixture of experts; the
  others are dense ``Dense(d_ff) -> gelu -> Dense(D)`` MLPs;
* ``group_size``: tokens per expert group (Alpa: 2,048, two sequences of 1,024): the layer's input
  ``(B, T, D)`` is routed as ``(B * T / group_size, group_size, D)``, so ``G = B T / group_size``,
  ``S = group_size`` and the capacity is per group of that many tokens;
* ``vocab_size``: a token language model: learned token and position embeddings, an (untied) LM
  head and a softmax cross-entropy on next tokens (plus the load-balancing loss); the batch is
  ``{"tokens": (B, T) int32, "targets": (B, T) int32}``;
* ``activation="relu"`` in the experts (Alpa's), and ``remat`` (each layer rematerialized,
  ``nn.remat``; its parameters then sit under ``layer_{i}``).

Alpa's layers are post-norm (BERT's) where these are pre-norm; FLOPs and parameters are the same.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from hulkjax.zoo._base import (
    InvalidModelConfigError,
    TrainConfig,
    divides,
    make_optimizer,
    make_train_step,
    mse_loss,
    one_of,
    positive,
    register_model,
    xent_loss,
)
from hulkjax.zoo._layers import MlpBlock, SelfAttention, default_kernel_init


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig(TrainConfig):
    """Config of ``moe``."""

    size: str = "small"  # preset the other fields started from: tiny | small | large
    d_model: int = 512
    d_ff: int = 2048  # hidden width of each expert
    n_experts: int = 8
    top_k: int = 2  # 1 (Switch) or 2 (GShard)
    capacity_factor: float = 1.25  # expert capacity = top_k * capacity_factor * S / E tokens
    n_layers: int = 2
    n_heads: int = 8  # must divide d_model
    attention: bool = True  # include a causal self-attention sublayer in each layer
    seq_len: int = 256  # tokens per sequence (and per group unless group_size)
    batch: int = 16
    aux_loss_weight: float = 0.01
    moe_every: int = 1  # layer i's MLP is a mixture of experts iff i % moe_every == 0
    group_size: int = 0  # tokens per expert group (0: one group per sequence)
    vocab_size: int = 0  # > 0: a token language model (embeddings, LM head, cross-entropy)
    activation: str = "gelu"  # the experts' nonlinearity: gelu | relu (Alpa's)
    remat: bool = False  # nn.remat on each layer

    def _check(self) -> None:
        positive(self, "d_model", "d_ff", "n_experts", "n_layers", "n_heads", "seq_len", "batch",
                 "moe_every")
        divides(self, "n_heads", "d_model")
        one_of(self, "top_k", (1, 2))
        one_of(self, "activation", ("gelu", "relu"))
        if self.group_size < 0 or self.vocab_size < 0:
            raise InvalidModelConfigError(
                f"group_size={self.group_size} and vocab_size={self.vocab_size} must be >= 0 "
                "(0: off).")
        if self.group_size and (self.batch * self.seq_len) % self.group_size:
            raise InvalidModelConfigError(
                f"group_size={self.group_size} must divide the batch's tokens, batch x seq_len = "
                f"{self.batch} x {self.seq_len} = {self.batch * self.seq_len}: the experts route "
                "groups of exactly that many tokens. Pick a divisor, or 0 for one group per "
                "sequence.")
        if self.top_k > self.n_experts:
            raise InvalidModelConfigError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}.")
        if not self.capacity_factor > 0:
            raise InvalidModelConfigError(
                f"capacity_factor={self.capacity_factor!r} must be positive."
            )
        if self.aux_loss_weight < 0:
            raise InvalidModelConfigError(f"aux_loss_weight={self.aux_loss_weight!r} must be >= 0.")

    @property
    def group(self) -> int:
        """Tokens per expert group: ``group_size``, or a sequence's."""
        return self.group_size or self.seq_len

    @property
    def capacity(self) -> int:
        """Tokens each expert takes per group."""
        c = math.ceil(self.top_k * self.capacity_factor * self.group / self.n_experts)
        return max(1, min(self.group, c))


MOE_PRESETS = {
    "tiny": dict(d_model=32, d_ff=64, n_experts=4, n_layers=1, n_heads=4, seq_len=16, batch=8),
    "small": dict(
        d_model=512, d_ff=2048, n_experts=8, n_layers=2, n_heads=8, seq_len=256, batch=16
    ),
    "large": dict(
        d_model=1024, d_ff=4096, n_experts=64, n_layers=12, n_heads=16, seq_len=1024, batch=32
    ),
}


def route(
    probs: jax.Array, n_experts: int, top_k: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard/Switch routing of ``probs`` (G, S, E) float32.

    Returns ``(dispatch, combine, aux_loss)``: dispatch (G, S, E, C) 0/1, combine (G, S, E, C)
    float32 gate weights, aux_loss a float32 scalar.
    """
    remaining = probs
    count = jnp.zeros(probs.shape[:1] + (1, n_experts), jnp.float32)  # tokens queued per expert
    choices = []
    for k in range(top_k):
        expert = jnp.argmax(remaining, axis=-1)  # (G, S)
        mask = jax.nn.one_hot(expert, n_experts, dtype=jnp.float32)  # (G, S, E)
        if k == 0:
            # Switch load-balancing loss from the first choice, before capacity drops.
            density = jnp.mean(mask, axis=1)  # (G, E)
            density_proxy = jnp.mean(probs, axis=1)  # (G, E)
            aux_loss = jnp.mean(jnp.sum(density * density_proxy, axis=-1)) * n_experts
        gate = jnp.sum(probs * mask, axis=-1)  # (G, S)
        position = (jnp.cumsum(mask, axis=1) - 1.0 + count) * mask  # (G, S, E)
        count = count + jnp.sum(mask, axis=1, keepdims=True)
        mask = mask * (position < capacity)
        slot = jnp.sum(position * mask, axis=-1).astype(jnp.int32)  # (G, S)
        choices.append((mask, gate, slot))
        remaining = remaining * (1.0 - jax.nn.one_hot(expert, n_experts, dtype=jnp.float32))
    if top_k > 1:  # GShard: renormalise the chosen gates
        total = sum(gate for _, gate, _ in choices) + 1e-9
        choices = [(mask, gate / total, slot) for mask, gate, slot in choices]
    dispatch = jnp.zeros(probs.shape + (capacity,), jnp.float32)
    combine = jnp.zeros(probs.shape + (capacity,), jnp.float32)
    for mask, gate, slot in choices:
        d = mask[..., None] * jax.nn.one_hot(slot, capacity, dtype=jnp.float32)[:, :, None, :]
        dispatch = dispatch + d
        combine = combine + gate[:, :, None, None] * d
    return dispatch, combine, aux_loss


class MoELayer(nn.Module):
    """Mixture-of-experts MLP on (G, S, D); returns ``(y, aux_loss)``."""

    n_experts: int
    d_ff: int
    top_k: int
    capacity: int
    dtype: jnp.dtype = jnp.float32
    activation: str = "gelu"

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        e, d, f, dt = self.n_experts, x.shape[-1], self.d_ff, self.dtype
        # The router runs in float32 (Switch's selective precision).
        logits = nn.Dense(
            e,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=dt,
            kernel_init=default_kernel_init,
            name="router",
        )(x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        dispatch, combine, aux_loss = route(probs, e, self.top_k, self.capacity)
        w_in = self.param("w_in", default_kernel_init, (e, d, f), dt)
        b_in = self.param("b_in", nn.initializers.zeros, (e, f), dt)
        w_out = self.param("w_out", default_kernel_init, (e, f, d), dt)
        b_out = self.param("b_out", nn.initializers.zeros, (e, d), dt)
        expert_in = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dt), x)
        h = jnp.einsum("egcd,edf->egcf", expert_in, w_in) + b_in[:, None, None, :]
        h = nn.relu(h) if self.activation == "relu" else nn.gelu(h)
        out = jnp.einsum("egcf,efd->egcd", h, w_out) + b_out[:, None, None, :]
        return jnp.einsum("gsec,egcd->gsd", combine.astype(dt), out), aux_loss


def _layer(mdl: nn.Module, cfg: MoEConfig, i: int, x: jax.Array):
    """Layer ``i`` of ``cfg`` on ``x`` (B, T, D), its submodules made in ``mdl``'s scope:
    ``(x, aux_loss)``, the aux loss ``None`` for a dense layer."""
    dt = cfg.jnp_dtype
    norm = lambda name: nn.LayerNorm(dtype=dt, param_dtype=dt, parent=mdl, name=name)  # noqa: E731
    if cfg.attention:
        x = x + SelfAttention(cfg.n_heads, causal=True, dtype=dt, parent=mdl, name=f"attn_{i}")(
            norm(f"ln_attn_{i}")(x)
        )
    if i % cfg.moe_every:
        h = MlpBlock(cfg.d_ff, dtype=dt, parent=mdl, name=f"mlp_{i}")(norm(f"ln_mlp_{i}")(x))
        return x + h, None
    h = norm(f"ln_moe_{i}")(x)
    if cfg.group_size:
        h = h.reshape(-1, cfg.group_size, h.shape[-1])  # (G, S, D): G = B T / S
    y, aux = MoELayer(cfg.n_experts, cfg.d_ff, cfg.top_k, cfg.capacity, dtype=dt,
                      activation=cfg.activation, parent=mdl, name=f"moe_{i}")(h)
    return x + y.reshape(x.shape), aux


class _Layer(nn.Module):
    """One layer as its own module, for ``nn.remat``."""

    config: MoEConfig
    index: int

    @nn.compact
    def __call__(self, x: jax.Array):
        y, aux = _layer(self, self.config, self.index, x)
        return y, jnp.zeros((), jnp.float32) if aux is None else aux


class MoEModel(nn.Module):
    config: MoEConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg, dt = self.config, self.config.jnp_dtype
        norm = lambda name: nn.LayerNorm(dtype=dt, param_dtype=dt, name=name)  # noqa: E731
        if cfg.vocab_size:  # x: (B, T) token ids
            x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=dt,
                         embedding_init=default_kernel_init, name="embed")(x)
            pos = self.param("positions", default_kernel_init, (cfg.seq_len, cfg.d_model), dt)
            x = x + pos[None, : x.shape[1]]
        aux_losses = []
        for i in range(cfg.n_layers):
            if cfg.remat:
                x, aux = nn.remat(_Layer)(cfg, i, name=f"layer_{i}")(x)
                aux = None if i % cfg.moe_every else aux
            else:
                x, aux = _layer(self, cfg, i, x)
            if aux is not None:
                aux_losses.append(aux)
        x = norm("ln_f")(x)
        width = cfg.vocab_size or cfg.d_model
        out = nn.Dense(width, dtype=dt, param_dtype=dt, name="head")(x)
        return out, sum(aux_losses) / len(aux_losses)


@register_model(
    "moe",
    config_cls=MoEConfig,
    presets=MOE_PRESETS,
    default_size="small",
    doc="transformer with GShard/Switch mixture-of-experts MLPs (flax.linen)",
)
def build_moe(config: MoEConfig):
    module, tx = MoEModel(config), make_optimizer(config)

    # Examples to initialize with: the fewest whose tokens make whole expert groups.
    n0 = config.group // math.gcd(config.group, config.seq_len)

    def init_fn(key):
        kp, kx, kw = jax.random.split(key, 3)
        if config.vocab_size:
            tokens = jax.random.randint(kx, (config.batch, config.seq_len + 1), 0,
                                        config.vocab_size, jnp.int32)
            batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
            params = module.init(kp, batch["tokens"][:n0])["params"]
            return {"params": params, "opt_state": tx.init(params)}, batch
        shape = (config.batch, config.seq_len, config.d_model)
        x = jax.random.normal(kx, shape, jnp.float32)
        teacher = jax.random.normal(kw, (config.d_model, config.d_model), jnp.float32)
        y = jnp.tanh(x @ teacher / jnp.sqrt(config.d_model))
        batch = {"x": x.astype(config.jnp_dtype), "y": y.astype(config.jnp_dtype)}
        params = module.init(kp, batch["x"][:n0])["params"]
        return {"params": params, "opt_state": tx.init(params)}, batch

    def loss_fn(params, state, batch):
        if config.vocab_size:
            logits, aux_loss = module.apply({"params": params}, batch["tokens"])
            xent, metrics = xent_loss(logits, batch["targets"])
            return xent + config.aux_loss_weight * aux_loss, ({**metrics, "aux_loss": aux_loss},
                                                              {})
        out, aux_loss = module.apply({"params": params}, batch["x"])
        mse, _ = mse_loss(out, batch["y"])
        return mse + config.aux_loss_weight * aux_loss, ({"aux_loss": aux_loss}, {})

    return init_fn, make_train_step(loss_fn, tx, "moe")
