"""Linen building blocks shared by the zoo's transformers (transformer-block, gpt2, llama, bert, vit,
moe).

Attention is explicit einsum softmax attention (no fused or backend-specific kernels), so it traces
to plain ``dot_general`` / ``reduce`` / elementwise equations. Parameters and compute use the
module's ``dtype``; the softmax runs in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

Initializer = Callable[..., jax.Array]

default_kernel_init: Initializer = nn.initializers.normal(stddev=0.02)


def causal_mask(length: int) -> jax.Array:
    """(length, length) bool, True where query i may attend to key j (j <= i). Built from iotas so
    the jaxpr holds no large constant."""
    rows = lax.broadcasted_iota(jnp.int32, (length, length), 0)
    cols = lax.broadcasted_iota(jnp.int32, (length, length), 1)
    return rows >= cols


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections ``(D) -> (H, D/H)`` and an output
    projection ``(H, D/H) -> (D)``, all ``nn.DenseGeneral``."""

    n_heads: int
    causal: bool = False
    dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    out_init: Initializer = default_kernel_init

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _, length, width = x.shape
        head_dim = width // self.n_heads
        proj = lambda name: nn.DenseGeneral(  # noqa: E731
            features=(self.n_heads, head_dim),
            dtype=self.dtype,
            param_dtype=self.dtype,
            kernel_init=self.kernel_init,
            name=name,
        )
        q = proj("query")(x) * jnp.asarray(head_dim**-0.5, self.dtype)
        k = proj("key")(x)
        v = proj("value")(x)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        if self.causal:
            scores = jnp.where(causal_mask(length), scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.DenseGeneral(
            features=width,
            axis=(-2, -1),
            dtype=self.dtype,
            param_dtype=self.dtype,
            kernel_init=self.out_init,
            name="out",
        )(out)


class MlpBlock(nn.Module):
    """Dense(d_ff) -> gelu -> Dense(width)."""

    d_ff: int
    exact_gelu: bool = False  # False: tanh approximation (GPT-2); True: erf (BERT, ViT)
    dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    out_init: Initializer = default_kernel_init

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda features, init, name: nn.Dense(  # noqa: E731
            features, dtype=self.dtype, param_dtype=self.dtype, kernel_init=init, name=name
        )
        h = dense(self.d_ff, self.kernel_init, "fc")(x)
        h = nn.gelu(h, approximate=not self.exact_gelu)
        return dense(x.shape[-1], self.out_init, "proj")(h)


class TransformerBlock(nn.Module):
    """One transformer layer: attention and MLP sublayers with residuals.

    ``pre_norm=True`` (GPT-2, ViT): ``x + f(LN(x))``; ``pre_norm=False`` (BERT): ``LN(x + f(x))``.
    """

    n_heads: int
    d_ff: int
    causal: bool = False
    pre_norm: bool = True
    exact_gelu: bool = False
    ln_eps: float = 1e-5
    dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    out_init: Initializer = default_kernel_init  # residual-branch output projections

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        norm = lambda name: nn.LayerNorm(  # noqa: E731
            epsilon=self.ln_eps, dtype=self.dtype, param_dtype=self.dtype, name=name
        )
        attn = SelfAttention(
            self.n_heads,
            causal=self.causal,
            dtype=self.dtype,
            kernel_init=self.kernel_init,
            out_init=self.out_init,
            name="attn",
        )
        mlp = MlpBlock(
            self.d_ff,
            exact_gelu=self.exact_gelu,
            dtype=self.dtype,
            kernel_init=self.kernel_init,
            out_init=self.out_init,
            name="mlp",
        )
        if self.pre_norm:
            x = x + attn(norm("ln_1")(x))
            return x + mlp(norm("ln_2")(x))
        x = norm("ln_1")(x + attn(x))
        return norm("ln_2")(x + mlp(x))


class ScanCell(nn.Module):
    """``(carry, _) -> (block(carry), None)``: the body ``nn.scan`` repeats (see :func:`blocks`)."""

    block: Any  # the block's module class
    block_kwargs: dict

    @nn.compact
    def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
        return self.block(**self.block_kwargs, name="block")(x), None


def blocks(x: jax.Array, block: Any, block_kwargs: dict, *, n_layers: int, scan: bool,
           remat: bool, name: str, policy: Any = None) -> jax.Array:
    """``n_layers`` blocks ``block(**block_kwargs)`` applied in turn to ``x``; call it inside a
    compact method.

    Unrolled (``scan=False``) the blocks are submodules ``{name}_0 .. {name}_{n-1}``. With ``scan``
    they are one ``nn.scan`` named ``name`` whose parameters have a leading layer axis of length
    ``n_layers`` (the block's parameters under ``{name}/block``). With ``remat`` each block is
    ``nn.remat``'d (inside the scan body when scanned), under ``policy`` (a
    ``jax.checkpoint_policies`` policy; ``None``: nothing saved).
    """
    if scan:
        cell = nn.remat(ScanCell, prevent_cse=False, policy=policy) if remat else ScanCell
        stack = nn.scan(cell, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=n_layers)
        x, _ = stack(block, block_kwargs, name=name)(x, None)
        return x
    block_cls = nn.remat(block, policy=policy) if remat else block
    for i in range(n_layers):
        x = block_cls(**block_kwargs, name=f"{name}_{i}")(x)
    return x
