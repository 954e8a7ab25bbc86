"""``resnet`` (flax.linen): ResNet v1.5 with bottleneck blocks, image classification.

Stem (7x7/2 conv + 3x3/2 max pool, or one 3x3/1 conv with ``small_stem`` for small images), four
stages of bottleneck blocks (1x1 -> 3x3 (stride here, v1.5) -> 1x1 x4, projection shortcut where
the shape changes), global average pool, Dense head. Convolutions have no bias.

Wide-ResNet (``width_factor``): the bottleneck's 3x3 convolution is ``width_factor`` times as
wide (1x1 -> 3x3 x ``width_factor`` -> 1x1 x4), as Alpa's ``wide_resnet.py`` widens it for its
benchmark suite (e.g. its "250M": ResNet-50 layout, width 160, width factor 2). ``remat``
rematerializes each bottleneck block (``nn.remat``), as Alpa's suite runs it.

Normalisation (``norm``): ``"batch"`` (default, as in ResNet-50) uses the batch's statistics in the
step and keeps running averages in ``state["batch_stats"]``, which the step updates (momentum 0.9);
under SPMD the statistics are over the global batch, so a sharded step matches the serial one.
``"group"`` uses GroupNorm (``min(32, channels)`` groups, gcd-adjusted) and has no mutable state.

Batch: ``{"x": (B, image_size, image_size, channels) dtype, "y": (B,) int32 labels}``.

Sizes: tiny: 1 block per stage, base width 8, 32x32 images, small stem, 10 classes, B=8;
50: ResNet-50 ([3, 4, 6, 3], width 64, 224x224, 1000 classes: 25,557,032 parameters), B=32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hulkjax.zoo._base import (
    InvalidModelConfigError,
    TrainConfig,
    make_optimizer,
    make_train_step,
    one_of,
    positive,
    register_model,
    xent_loss,
)
from hulkjax.zoo.cnn import make_image_batch


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResNetConfig(TrainConfig):
    """Config of ``resnet``."""

    size: str = "50"  # preset the other fields started from: tiny | 50
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)  # bottleneck blocks per stage
    width: int = 64  # bottleneck width of the first stage (doubles each stage; outputs x4)
    width_factor: int = 1  # the bottleneck's 3x3 convolution is this many times wider (WRN)
    image_size: int = 224
    channels: int = 3
    num_classes: int = 1000
    small_stem: bool = False  # 3x3 stride-1 stem conv, no max pool (for 32x32 images)
    norm: str = "batch"  # "batch" (BatchNorm, state["batch_stats"]) | "group" (GroupNorm)
    batch: int = 32
    remat: bool = False  # nn.remat (gradient checkpointing) on each bottleneck block

    def _check(self) -> None:
        positive(self, "width", "width_factor", "image_size", "channels", "num_classes", "batch")
        one_of(self, "norm", ("batch", "group"))
        if not self.stage_sizes or any(not isinstance(n, int) or n < 1 for n in self.stage_sizes):
            raise InvalidModelConfigError(
                f"stage_sizes={self.stage_sizes!r} must be a non-empty tuple of positive ints."
            )


RESNET_PRESETS = {
    "tiny": dict(
        stage_sizes=(1, 1, 1, 1), width=8, image_size=32, num_classes=10, small_stem=True, batch=8
    ),
    "50": dict(
        stage_sizes=(3, 4, 6, 3),
        width=64,
        image_size=224,
        num_classes=1000,
        small_stem=False,
        batch=32,
    ),
}


class Bottleneck(nn.Module):
    filters: int
    strides: int
    norm: Any  # (channels, name, zero_init) -> normalisation module
    dtype: Any = jnp.float32
    width_factor: int = 1  # the 3x3 convolution's width, times ``filters``

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)
        s = (self.strides, self.strides)
        y = nn.relu(self.norm(self.filters, "norm_1")(conv(self.filters, (1, 1), name="conv_1")(x)))
        wide = self.filters * self.width_factor
        y = conv(wide, (3, 3), strides=s, name="conv_2")(y)
        y = nn.relu(self.norm(wide, "norm_2")(y))
        y = conv(4 * self.filters, (1, 1), name="conv_3")(y)
        # Zero-init the last norm's scale so each block starts as the identity (Goyal et al.).
        y = self.norm(4 * self.filters, "norm_3", zero_init=True)(y)
        if x.shape != y.shape:
            x = conv(4 * self.filters, (1, 1), strides=s, name="proj_conv")(x)
            x = self.norm(4 * self.filters, "proj_norm")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    config: ResNetConfig

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        cfg, dt = self.config, self.config.jnp_dtype

        def norm(channels: int, name: str, zero_init: bool = False) -> nn.Module:
            scale_init = nn.initializers.zeros if zero_init else nn.initializers.ones
            if cfg.norm == "batch":
                return nn.BatchNorm(
                    use_running_average=not train,
                    momentum=0.9,
                    epsilon=1e-5,
                    dtype=dt,
                    param_dtype=dt,
                    scale_init=scale_init,
                    name=name,
                )
            return nn.GroupNorm(
                num_groups=math.gcd(32, channels),
                epsilon=1e-5,
                dtype=dt,
                param_dtype=dt,
                scale_init=scale_init,
                name=name,
            )

        conv = functools.partial(nn.Conv, use_bias=False, dtype=dt, param_dtype=dt)
        if cfg.small_stem:
            x = conv(cfg.width, (3, 3), name="stem_conv")(x)
            x = nn.relu(norm(cfg.width, "stem_norm")(x))
        else:
            x = conv(cfg.width, (7, 7), strides=(2, 2), padding=[(3, 3), (3, 3)], name="stem_conv")(
                x
            )
            x = nn.relu(norm(cfg.width, "stem_norm")(x))
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        block = nn.remat(Bottleneck, static_argnums=()) if cfg.remat else Bottleneck
        for i, n_blocks in enumerate(cfg.stage_sizes):
            for j in range(n_blocks):
                strides = 2 if i > 0 and j == 0 else 1
                x = block(cfg.width * 2**i, strides, norm, dtype=dt,
                          width_factor=cfg.width_factor, name=f"stage_{i}_block_{j}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(cfg.num_classes, dtype=dt, param_dtype=dt, name="head")(x)


@register_model(
    "resnet",
    config_cls=ResNetConfig,
    presets=RESNET_PRESETS,
    default_size="50",
    doc="ResNet-50 (v1.5, BatchNorm) image classifier (flax.linen)",
)
def build_resnet(config: ResNetConfig):
    module, tx = ResNet(config), make_optimizer(config)
    batch_norm = config.norm == "batch"

    def init_fn(key):
        kp, kd = jax.random.split(key)
        batch = make_image_batch(
            kd,
            config.batch,
            config.image_size,
            config.channels,
            config.num_classes,
            config.jnp_dtype,
        )
        variables = module.init(kp, batch["x"][:1], train=False)
        params = variables["params"]
        state = {"params": params, "opt_state": tx.init(params)}
        if batch_norm:
            state["batch_stats"] = variables["batch_stats"]
        return state, batch

    def loss_fn(params, state, batch):
        if batch_norm:
            logits, updated = module.apply(
                {"params": params, "batch_stats": state["batch_stats"]},
                batch["x"],
                mutable=["batch_stats"],
            )
            new = {"batch_stats": updated["batch_stats"]}
        else:
            logits, new = module.apply({"params": params}, batch["x"]), {}
        loss, metrics = xent_loss(logits, batch["y"])
        return loss, (metrics, new)

    return init_fn, make_train_step(loss_fn, tx, "resnet")
