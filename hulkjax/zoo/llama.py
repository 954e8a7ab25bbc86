"""``llama`` (flax.linen): a LLaMA-class decoder language model, next-token cross-entropy.

The LLaMA 2 / 3 architecture as MaxText and the Meta reference code write it: token embedding,
pre-norm blocks of RMSNorm, causal self-attention with rotary position embeddings (RoPE) and
grouped-query attention (``n_kv_heads`` key/value heads, each shared by ``n_heads / n_kv_heads``
query heads through ``jnp.repeat``), RMSNorm, a SwiGLU MLP (``down(silu(gate(x)) * up(x))``), a
final RMSNorm and an untied LM head. No biases. ``attention="flash"`` computes attention with
JAX's Pallas flash-attention kernel instead of ``jnp`` softmax (as MaxText's recipes run theirs):
one kernel that never writes the scores, which hulkjax plans and costs as a kernel
(:mod:`hulkjax.trace.kernels`). With ``remat`` each block is ``nn.remat``'d
(MaxText's ``remat_policy=full``); ``offload`` names values of the block that the backward pass
keeps in host memory instead of recomputing them (MaxText's ``remat_policy=custom`` with those
names set to ``offload``: ``decoder_layer_input``, ``query_proj``, ``key_proj``, ``value_proj``,
``out_proj``; each labelled by ``jax.ad_checkpoint.checkpoint_name`` and offloaded by
``jax.checkpoint_policies.save_and_offload_only_these_names``). With ``scan_layers`` the blocks
are one ``nn.scan`` over parameters stacked on a leading layer axis of length ``n_layers``
(``params["layer"]["block"]``; MaxText's default ``scan_layers=True``), the ``nn.remat`` inside
the scan body; unrolled, they are ``params["layer_0"]`` .. ``params["layer_{n-1}"]``. Neither changes the parameter count or the
numerics. With ``microbatches`` = k > 1 the step accumulates gradients over k microbatches of
``batch / k`` examples (a ``lax.scan``; Megatron/NeMo's micro-batches of a global batch), then
updates once: the whole batch's update (:func:`hulkjax.zoo._base.make_train_step`).

Batch: ``{"tokens": (batch, seq_len) int32, "targets": (batch, seq_len) int32}``.

Sizes (layers / d_model / heads / kv heads / d_ff / vocab / seq): tiny 2/64/4/2/128/256/16,
small 4/512/8/2/1408/32000/1024, llama2-7b 32/4096/32/32/11008/32000/4096,
llama2-70b 80/8192/64/8/28672/32000/4096 (Llama 2 paper, table 1 and appendix),
llama3-8b 32/4096/32/8/14336/128256/8192 (Llama 3 model card; Llama 3.1 8B has the same shapes),
llama3-70b 80/8192/64/8/28672/128256/8192. The large presets are meant for abstract planning
(``zoo.get("llama", size="llama2-70b", dtype="bfloat16", remat=True).abstract()``).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from hulkjax.zoo._base import (
    InvalidModelConfigError,
    TrainConfig,
    causal_lm,
    positive,
    register_model,
)
from hulkjax.zoo._layers import blocks, causal_mask, default_kernel_init


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig(TrainConfig):
    """Config of ``llama``."""

    size: str = "small"  # preset: tiny | small | llama2-7b | llama2-70b | llama3-8b | llama3-70b
    n_layers: int = 4
    d_model: int = 512
    n_heads: int = 8  # query heads; must divide d_model
    n_kv_heads: int = 2  # key/value heads (grouped-query attention); must divide n_heads
    d_ff: int = 1408  # SwiGLU hidden width
    vocab_size: int = 32000
    seq_len: int = 1024
    batch: int = 8
    rope_theta: float = 10000.0  # RoPE base (Llama 3: 500000)
    norm_eps: float = 1e-5
    scan_layers: bool = False  # nn.scan over the blocks (stacked parameters), as MaxText does
    remat: bool = False  # nn.remat (full rematerialization) on each block
    # with remat: block values the backward pass reads from host memory (MaxText's names)
    offload: tuple[str, ...] = ()
    attention: str = "softmax"  # "softmax" (jnp, scores in memory) | "flash" (a Pallas kernel)
    microbatches: int = 1  # gradient accumulation: a scan over this many slices of the batch

    def _check(self) -> None:
        positive(self, "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                 "seq_len", "batch", "microbatches")
        if self.batch % self.microbatches:
            raise InvalidModelConfigError(
                f"LlamaConfig: microbatches={self.microbatches} must divide batch={self.batch}.")
        if self.d_model % self.n_heads:
            raise InvalidModelConfigError(
                f"LlamaConfig: n_heads={self.n_heads} must divide d_model={self.d_model}.")
        if self.n_heads % self.n_kv_heads:
            raise InvalidModelConfigError(
                f"LlamaConfig: n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}.")
        if (self.d_model // self.n_heads) % 2:
            raise InvalidModelConfigError(
                f"LlamaConfig: the head size d_model / n_heads = {self.d_model // self.n_heads} "
                "must be even for rotary embeddings.")
        unknown = [n for n in self.offload if n not in OFFLOADABLE]
        if unknown:
            raise InvalidModelConfigError(
                f"LlamaConfig: offload={self.offload!r} names {unknown}, which the block does not "
                f"label; use names of {OFFLOADABLE}.")
        if self.offload and not self.remat:
            raise InvalidModelConfigError(
                f"LlamaConfig: offload={self.offload!r} needs remat=True (what the backward pass "
                "does not read from host memory, it recomputes).")
        if self.attention not in ATTENTION:
            raise InvalidModelConfigError(
                f"LlamaConfig: attention={self.attention!r} is not one of {ATTENTION}.")
        if self.attention == "flash" and self.seq_len % min(FLASH_BLOCK, self.seq_len):
            raise InvalidModelConfigError(
                f"LlamaConfig: attention='flash' runs in blocks of {FLASH_BLOCK} positions; "
                f"seq_len={self.seq_len} is not a multiple of it. Use a seq_len that is, or "
                "attention='softmax'.")


ATTENTION = ("softmax", "flash")
OFFLOADABLE = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "out_proj")
"""The values of a block that ``offload`` can name (MaxText's names for them)."""
FLASH_BLOCK = 128  # the kernel's query and key block (JAX's default), or the whole sequence


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention by JAX's Pallas flash-attention kernel
    (``jax.experimental.pallas.ops.gpu.attention.mha``, with its own backward kernels):
    ``(batch, seq, heads, head_dim)`` in and out, the scores never in memory. It compiles for
    NVIDIA GPUs; elsewhere it runs interpreted (same numerics, for tests and planning)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    block = min(FLASH_BLOCK, q.shape[1])
    sizes = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=block,
                                        block_kv_dkv=block, block_q_dq=block, block_kv_dq=block)
    return pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True,
                                block_sizes=sizes, interpret=jax.default_backend() != "gpu")


LLAMA_PRESETS = {
    "tiny": dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256,
                 seq_len=16, batch=8),
    "small": dict(n_layers=4, d_model=512, n_heads=8, n_kv_heads=2, d_ff=1408, vocab_size=32000,
                  seq_len=1024, batch=8),
    "llama2-7b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
                      vocab_size=32000, seq_len=4096, batch=8),
    "llama2-70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                       vocab_size=32000, seq_len=4096, batch=8),
    "llama3-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
                      vocab_size=128256, seq_len=8192, batch=8, rope_theta=500000.0),
    "llama3-70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672,
                       vocab_size=128256, seq_len=8192, batch=8, rope_theta=500000.0),
}


class RMSNorm(nn.Module):
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * scale


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """RoPE on ``x: (batch, seq, heads, head_dim)`` in the rotate-half form (no large constants:
    the angles come from iotas)."""
    _, length, _, dim = x.shape
    half = dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * freq[None, :]  # (seq, half)
    cos = jnp.cos(angle)[None, :, None, :].astype(x.dtype)
    sin = jnp.sin(angle)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LlamaBlock(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, dt = self.config, self.config.jnp_dtype
        hd = cfg.d_model // cfg.n_heads
        dense = lambda features, name, axis=-1: nn.DenseGeneral(  # noqa: E731
            features, axis=axis, use_bias=False, dtype=dt, param_dtype=dt,
            kernel_init=default_kernel_init, name=name)

        def label(value, name):  # a name for the remat policy (only where one offloads)
            return checkpoint_name(value, name) if cfg.offload else value

        x = label(x, "decoder_layer_input")
        h = RMSNorm(cfg.norm_eps, dt, name="attn_norm")(x)
        q = rotary(label(dense((cfg.n_heads, hd), "query")(h), "query_proj"), cfg.rope_theta)
        k = rotary(label(dense((cfg.n_kv_heads, hd), "key")(h), "key_proj"), cfg.rope_theta)
        v = label(dense((cfg.n_kv_heads, hd), "value")(h), "value_proj")
        group = cfg.n_heads // cfg.n_kv_heads
        if group > 1:
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        if cfg.attention == "flash":
            attn = flash_attention(q, k, v)
        else:
            q = q * jnp.asarray(hd**-0.5, dt)
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
            scores = jnp.where(causal_mask(x.shape[1]), scores, jnp.finfo(jnp.float32).min)
            weights = jax.nn.softmax(scores, axis=-1).astype(dt)
            attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        x = x + label(dense(cfg.d_model, "out", axis=(-2, -1))(attn), "out_proj")
        h = RMSNorm(cfg.norm_eps, dt, name="mlp_norm")(x)
        gated = nn.silu(dense(cfg.d_ff, "gate")(h)) * dense(cfg.d_ff, "up")(h)
        return x + dense(cfg.d_model, "down")(gated)


class Llama(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.config, self.config.jnp_dtype
        x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=dt,
                     embedding_init=default_kernel_init, name="embed")(tokens)
        policy = None if not cfg.offload else \
            jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=list(cfg.offload),
                offload_src="device", offload_dst="pinned_host")
        x = blocks(x, LlamaBlock, {"config": cfg}, n_layers=cfg.n_layers, scan=cfg.scan_layers,
                   remat=cfg.remat, name="layer", policy=policy)
        x = RMSNorm(cfg.norm_eps, dt, name="final_norm")(x)
        return nn.Dense(cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=dt,
                        kernel_init=default_kernel_init, name="lm_head")(x)


@register_model(
    "llama",
    config_cls=LlamaConfig,
    presets=LLAMA_PRESETS,
    default_size="small",
    doc="LLaMA-class decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU (flax.linen)",
)
def build_llama(config: LlamaConfig):
    return causal_lm(Llama(config), config, "llama")
