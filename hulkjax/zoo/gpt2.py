"""``gpt2`` (flax.linen): GPT-2 language model, next-token cross-entropy.

Token embedding ``wte`` (vocab, D) + learned position embedding ``wpe`` (n_positions, D), pre-LN
causal blocks with separate q/k/v projections, final LayerNorm, LM head tied to ``wte``
(``wte.attend``). With ``scan_layers`` the blocks are one ``nn.scan`` (their parameters get a leading
layer axis of length ``n_layers``); with ``remat`` each block is ``nn.remat``'d. Neither changes the
parameter count: GPT-2 small has 124,439,808 parameters.

Batch: ``{"tokens": (batch, seq_len) int32, "targets": (batch, seq_len) int32}`` (targets are the
tokens shifted by one).

Sizes (layers / d_model / heads): tiny 2/64/4 (vocab 256, T=16, B=8), small 12/768/12,
medium 24/1024/16, large 36/1280/20, 1b 24/2048/16 (~1.3B parameters, the GPT-3 XL shape);
all but tiny use vocab 50257 and 1024 positions.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from hulkjax.zoo._base import (
    InvalidModelConfigError,
    TrainConfig,
    causal_lm,
    divides,
    positive,
    register_model,
)
from hulkjax.zoo._layers import TransformerBlock, blocks, default_kernel_init


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GPT2Config(TrainConfig):
    """Config of ``gpt2``."""

    size: str = "small"  # preset the other fields started from: tiny | small | medium | large | 1b
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12  # must divide d_model
    d_ff: int | None = None  # MLP hidden width; None: 4 * d_model
    vocab_size: int = 50257
    n_positions: int = 1024  # rows of the position embedding (context length)
    seq_len: int = 1024  # tokens per example in the batch; <= n_positions
    batch: int = 8
    scan_layers: bool = False  # nn.scan over the blocks (stacked parameters)
    remat: bool = False  # nn.remat (gradient checkpointing) on each block

    def _check(self) -> None:
        positive(
            self, "n_layers", "d_model", "n_heads", "vocab_size", "n_positions", "seq_len", "batch"
        )
        divides(self, "n_heads", "d_model")
        if self.d_ff is not None:
            positive(self, "d_ff")
        if self.seq_len > self.n_positions:
            raise InvalidModelConfigError(
                f"seq_len={self.seq_len} exceeds n_positions={self.n_positions}; pass "
                f"n_positions={self.seq_len} (or more) too."
            )

    @property
    def ff_width(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff


_GPT2 = dict(vocab_size=50257, n_positions=1024, seq_len=1024, batch=8)
GPT2_PRESETS = {
    "tiny": dict(
        n_layers=2, d_model=64, n_heads=4, vocab_size=256, n_positions=64, seq_len=16, batch=8
    ),
    "small": dict(n_layers=12, d_model=768, n_heads=12, **_GPT2),
    "medium": dict(n_layers=24, d_model=1024, n_heads=16, **_GPT2),
    "large": dict(n_layers=36, d_model=1280, n_heads=20, **_GPT2),
    "1b": dict(n_layers=24, d_model=2048, n_heads=16, **_GPT2),
}


class GPT2(nn.Module):
    config: GPT2Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.config, self.config.jnp_dtype
        wte = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=dt,
            param_dtype=dt,
            embedding_init=default_kernel_init,
            name="wte",
        )
        wpe = self.param(
            "wpe", nn.initializers.normal(stddev=0.01), (cfg.n_positions, cfg.d_model), dt
        )
        x = wte(tokens) + wpe[None, : tokens.shape[1]]
        block_kwargs = dict(
            n_heads=cfg.n_heads,
            d_ff=cfg.ff_width,
            causal=True,
            dtype=dt,
            # GPT-2 scales the residual projections' init by 1/sqrt(2 * n_layers).
            out_init=nn.initializers.normal(stddev=0.02 / (2 * cfg.n_layers) ** 0.5),
        )
        x = blocks(x, TransformerBlock, block_kwargs, n_layers=cfg.n_layers,
                   scan=cfg.scan_layers, remat=cfg.remat, name="h")
        x = nn.LayerNorm(epsilon=1e-5, dtype=dt, param_dtype=dt, name="ln_f")(x)
        return wte.attend(x)  # tied LM head: x @ wte.T


@register_model(
    "gpt2",
    config_cls=GPT2Config,
    presets=GPT2_PRESETS,
    default_size="small",
    doc="GPT-2 language model, tied LM head (flax.linen)",
)
def build_gpt2(config: GPT2Config):
    return causal_lm(GPT2(config), config, "gpt2")
