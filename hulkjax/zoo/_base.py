"""The zoo's shared machinery: config base class, model registry, optimizer, losses, step builder.

Where it sits::

    zoo.get("gpt2", size="tiny")  ->  registry entry (config class, presets, builder)
                                          |  builder(config)
                                          v
                                 ZooModel(name, config, step, init, abstract, param_count)
                                          |
           hulkjax.plan / hulk_shard trace ``step`` on ``abstract()`` or ``init()`` values

Every model is a builder ``config -> (init_fn, step)``: ``init_fn(key) -> (state, batch)`` is pure
(so ``jax.eval_shape`` gives the abstract state without allocating) and ``step`` is the un-jitted
``train_step(state, batch) -> (new_state, metrics)`` that hulkjax traces.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hulkjax.errors import InvalidModelConfigError, UnknownModelError

__all__ = [
    "InvalidModelConfigError",
    "TrainConfig",
    "ZooModel",
    "describe",
    "get",
    "names",
    "register_model",
    "sizes",
]

State = dict[str, Any]
Batch = dict[str, jax.Array]
InitFn = Callable[[jax.Array], tuple[State, Batch]]
StepFn = Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]
# loss_fn(params, state, batch) -> (loss, (metrics, state_updates)); state_updates replace entries of
# the state other than params/opt_state (ResNet's batch_stats).
LossFn = Callable[[Any, State, Batch], tuple[jax.Array, tuple[dict[str, jax.Array], State]]]

_DTYPES = ("float32", "bfloat16")
_OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """Fields every zoo model shares: numerics and optimizer.

    Subclasses add the architecture and data fields and a ``size`` field naming the preset the
    other fields started from. Field checks raise :class:`InvalidModelConfigError`.
    """

    dtype: str = "float32"  # params and compute: "float32" or "bfloat16" (losses are float32)
    optimizer: str = "adamw"  # "adamw" | "adam" | "sgd" (sgd with momentum 0.9)
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4  # adamw's decoupled weight decay; ignored by adam and sgd

    def __post_init__(self) -> None:
        try:
            dtype = jnp.dtype(self.dtype).name
        except TypeError:
            dtype = str(self.dtype)
        if dtype not in _DTYPES:
            raise InvalidModelConfigError(
                f"dtype={self.dtype!r} is not supported; use one of {list(_DTYPES)}."
            )
        object.__setattr__(self, "dtype", dtype)
        if self.optimizer not in _OPTIMIZERS:
            raise InvalidModelConfigError(
                f"optimizer={self.optimizer!r} is not supported; use one of {list(_OPTIMIZERS)}."
            )
        if not self.learning_rate > 0:
            raise InvalidModelConfigError(f"learning_rate={self.learning_rate!r} must be positive.")
        if self.weight_decay < 0:
            raise InvalidModelConfigError(f"weight_decay={self.weight_decay!r} must be >= 0.")
        # Normalize sequences to tuples so configs stay hashable and comparable.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))
        self._check()

    def _check(self) -> None:
        """Model-specific checks; subclasses override (slots dataclasses cannot use zero-arg
        ``super()``, so the base ``__post_init__`` calls this hook instead)."""

    @property
    def jnp_dtype(self) -> jnp.dtype:
        """``dtype`` as a numpy dtype object."""
        return jnp.dtype(self.dtype)


def positive(config: Any, *fields: str) -> None:
    """Raise InvalidModelConfigError unless every named integer field of ``config`` is >= 1."""
    for name in fields:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidModelConfigError(
                f"{type(config).__name__}.{name}={value!r} must be a positive integer."
            )


def one_of(config: Any, field: str, allowed: tuple[Any, ...]) -> None:
    """Raise InvalidModelConfigError unless ``config.<field>`` is one of ``allowed``."""
    value = getattr(config, field)
    if value not in allowed:
        raise InvalidModelConfigError(
            f"{type(config).__name__}.{field}={value!r} is not supported; use one of "
            f"{list(allowed)}."
        )


def divides(config: Any, heads_field: str, width_field: str) -> None:
    """Raise InvalidModelConfigError unless ``config.<heads_field>`` divides ``<width_field>``."""
    heads, width = getattr(config, heads_field), getattr(config, width_field)
    if width % heads:
        raise InvalidModelConfigError(
            f"{width_field}={width} is not divisible by {heads_field}={heads}; pick a "
            f"{width_field} that is a multiple of {heads_field}."
        )


# ----------------------------------------------------------------------------------------------
# Optimizer, losses, step builder


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """The optax optimizer named by ``config.optimizer``."""
    if config.optimizer == "adamw":
        return optax.adamw(config.learning_rate, weight_decay=config.weight_decay)
    if config.optimizer == "adam":
        return optax.adam(config.learning_rate)
    return optax.sgd(config.learning_rate, momentum=0.9)


def mse_loss(pred: jax.Array, target: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean squared error in float32, and no extra metrics."""
    diff = pred.astype(jnp.float32) - target.astype(jnp.float32)
    return jnp.mean(diff * diff), {}


def xent_loss(
    logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross-entropy on integer labels in float32 (weighted mean if ``weights``), and the
    (weighted) accuracy as a metric."""
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    if weights is None:
        return jnp.mean(losses), {"accuracy": jnp.mean(correct)}
    weights = weights.astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(weights), 1.0)
    return jnp.sum(losses * weights) / denom, {"accuracy": jnp.sum(correct * weights) / denom}


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, name: str,
                    microbatches: int = 1) -> StepFn:
    """``train_step(state, batch)``: value_and_grad of ``loss_fn`` w.r.t. ``state["params"]``, then
    ``tx.update`` and ``optax.apply_updates``. Not jitted: hulkjax traces it.

    With ``microbatches`` = k > 1, gradient accumulation as Megatron/NeMo's global batch of k
    micro-batches per data-parallel rank runs it: the batch is cut into k microbatches (example
    ``i`` of microbatch ``j`` is example ``j + k i``: rank ``r`` of a contiguous split of the batch
    over data-parallel devices keeps its own examples in every microbatch), a ``lax.scan`` over
    them sums the gradients (the losses and metrics are averaged), and the optimizer runs once on
    the gradients' mean: the same update as the whole batch's for a loss that is a mean over
    equal microbatches. Only for losses without state updates (no BatchNorm statistics)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulated(params, state, batch):
        def cut(x):  # (B, ...) -> (k, B / k, ...): microbatch j holds examples j, j + k, ...
            return jnp.swapaxes(x.reshape(-1, microbatches, *x.shape[1:]), 0, 1)

        def body(acc, mb):  # gradients summed in the carry, losses and metrics stacked
            (loss, (metrics, updates)), grads = grad_fn(params, state, mb)
            if updates:
                raise InvalidModelConfigError(
                    f"{name}: microbatches={microbatches} needs a loss without state updates; "
                    f"this one updates {sorted(updates)}. Use microbatches=1.")
            return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

        grads, (loss, metrics) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params),
                                              jax.tree.map(cut, batch))
        loss, metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), (loss, metrics))
        return (loss, (metrics, {})), jax.tree.map(lambda x: x / microbatches, grads)

    def train_step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        params = state["params"]
        if microbatches > 1:
            (loss, (metrics, state_updates)), grads = accumulated(params, state, batch)
        else:
            (loss, (metrics, state_updates)), grads = grad_fn(params, state, batch)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        new_state = {**state, **state_updates, "params": new_params, "opt_state": opt_state}
        return new_state, {"loss": loss, **metrics}

    train_step.__name__ = train_step.__qualname__ = f"{name.replace('-', '_')}_train_step"
    return train_step


def causal_lm(module, config: Any, name: str):
    """``(init_fn, train_step)`` of a linen language model ``module`` trained on next-token
    prediction: random token sequences of ``config.batch x (config.seq_len + 1)`` split into
    inputs and shifted targets, cross-entropy on the logits, ``make_optimizer(config)``."""
    tx = make_optimizer(config)

    def init_fn(key):
        kp, kd = jax.random.split(key)
        seq = jax.random.randint(
            kd, (config.batch, config.seq_len + 1), 0, config.vocab_size, jnp.int32
        )
        batch = {"tokens": seq[:, :-1], "targets": seq[:, 1:]}
        params = module.init(kp, batch["tokens"][:1])["params"]
        return {"params": params, "opt_state": tx.init(params)}, batch

    def loss_fn(params, state, batch):
        logits = module.apply({"params": params}, batch["tokens"])
        loss, metrics = xent_loss(logits, batch["targets"])
        return loss, (metrics, {})

    return init_fn, make_train_step(loss_fn, tx, name, getattr(config, "microbatches", 1))


def build_nnx_step(name: str, config: Any, model_cls: type, make_batch, loss_of_output):
    """The nnx split-state pattern: ``graphdef, params = nnx.split(model, nnx.Param)`` at init; the
    step ``nnx.merge``\\ s them, differentiates w.r.t. the params ``State`` and updates it with optax.
    ``state["params"]`` is the ``nnx.State`` (a pytree)."""
    tx = make_optimizer(config)
    # The graphdef depends only on the config: take it from an abstract model (allocates nothing).
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0))), nnx.Param)

    def init_fn(key):
        kp, kd = jax.random.split(key)
        _, params = nnx.split(model_cls(config, rngs=nnx.Rngs(kp)), nnx.Param)
        return {"params": params, "opt_state": tx.init(params)}, make_batch(config, kd)

    def loss_fn(params, state, batch):
        model = nnx.merge(graphdef, params)
        return loss_of_output(model, batch)

    return init_fn, make_train_step(loss_fn, tx, name)


# ----------------------------------------------------------------------------------------------
# ZooModel and the registry


@dataclasses.dataclass(frozen=True, eq=False)
class ZooModel:
    """A built-in training step with its config and a way to make (concrete or abstract) inputs.

    Attributes:
      name: registry name, e.g. ``"gpt2"``.
      config: the frozen config dataclass the model was built from.
      step: ``train_step(state, batch) -> (new_state, metrics)``; pure and not jitted.
        ``state`` is ``{"params", "opt_state"}`` (plus ``"batch_stats"`` for a BatchNorm ResNet);
        ``metrics`` is a dict of float32 scalars with at least ``"loss"``.

    >>> from hulkjax import zoo
    >>> m = zoo.get("mlp", size="tiny")
    >>> state, batch = m.abstract()
    >>> batch["x"].shape
    (16, 16)
    """

    name: str
    config: Any
    step: StepFn
    _init_fn: InitFn = dataclasses.field(repr=False)
    _jit_init: Callable[[jax.Array], tuple[State, Batch]] = dataclasses.field(
        init=False, repr=False
    )
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_jit_init", jax.jit(self._init_fn))

    def init(self, seed: int = 0) -> tuple[State, Batch]:
        """Concrete ``(state, batch)``: parameters from flax initializers and a synthetic batch,
        both determined by ``seed``."""
        # Non-partitionable threefry: the same determinism, but XLA:CPU compiles each random draw
        # ~8x faster than the partitionable default (about 2 s -> 0.25 s per initializer on a busy
        # 2-core machine), which is most of a tiny model's init time. Init runs unsharded.
        with jax.threefry_partitionable(False):
            return self._jit_init(jax.random.PRNGKey(seed))

    def abstract(self) -> tuple[State, Batch]:
        """``(state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees (``jax.eval_shape`` of
        ``init``); allocates no parameter arrays, so it is instant even for billion-parameter
        configs."""
        return jax.eval_shape(self._init_fn, jax.ShapeDtypeStruct((2,), jnp.uint32))

    def param_count(self) -> int:
        """Number of trainable parameters (``state["params"]`` leaves; not optimizer state, not
        BatchNorm statistics)."""
        if "param_count" not in self._cache:
            params = self.abstract()[0]["params"]
            self._cache["param_count"] = sum(
                math.prod(leaf.shape) for leaf in jax.tree.leaves(params)
            )
        return self._cache["param_count"]


Builder = Callable[[Any], tuple[InitFn, StepFn]]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    config_cls: type  # the frozen config dataclass
    presets: Mapping[str, Mapping[str, Any]]  # size name -> field values
    default_size: str
    build: Builder  # config -> (init_fn, step)
    doc: str  # one line for listings


_models: dict[str, _Entry] = {}


def register_model(
    name: str,
    *,
    config_cls: type,
    presets: Mapping[str, Mapping[str, Any]],
    default_size: str,
    doc: str,
) -> Callable[[Builder], Builder]:
    """Decorator registering ``build(config) -> (init_fn, step)`` under ``name``."""

    def wrap(build: Builder) -> Builder:
        if name in _models:
            raise ValueError(f"zoo model {name!r} registered twice")
        if default_size not in presets:
            raise ValueError(f"default size {default_size!r} of {name!r} is not a preset")
        _models[name] = _Entry(
            config_cls=config_cls,
            presets=dict(presets),
            default_size=default_size,
            build=build,
            doc=doc,
        )
        return build

    return wrap


def names() -> list[str]:
    """Names of the built-in models, in registration order.

    >>> from hulkjax import zoo
    >>> "gpt2" in zoo.names()
    True
    """
    return list(_models)


def sizes(name: str) -> list[str]:
    """Preset sizes of model ``name`` (the first is not necessarily the default)."""
    return list(_entry(name).presets)


def describe(name: str) -> str:
    """One line about model ``name``: what it is, its sizes and the default size.

    >>> from hulkjax import zoo
    >>> zoo.describe("resnet")
    'resnet: ResNet-50 (v1.5, BatchNorm) image classifier (flax.linen); sizes tiny, 50 (default 50)'
    """
    entry = _entry(name)
    return f"{name}: {entry.doc}; sizes {', '.join(entry.presets)} (default {entry.default_size})"


def _entry(name: str) -> _Entry:
    if name not in _models:
        close = difflib.get_close_matches(str(name), list(_models), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownModelError(
            f"unknown zoo model {name!r}.{hint} Valid names: {', '.join(_models)}."
        )
    return _models[name]


def get(name: str, **overrides: Any) -> ZooModel:
    """Build a zoo model: the preset ``size`` (default: the model's default size) with ``overrides``
    applied to its config fields.

    Equal configs give the same model (the one built last for them, of the 64 most recent), so
    JAX compiles its ``init`` and ``step`` once.

    Raises:
      UnknownModelError: ``name``, ``size`` or an override field is not known (the message lists
        the valid ones).
      InvalidModelConfigError: a field value is out of range.

    >>> from hulkjax import zoo
    >>> m = zoo.get("gpt2", size="tiny", batch=4)
    >>> (m.config.n_layers, m.config.batch)
    (2, 4)
    """
    entry = _entry(name)
    size = overrides.pop("size", entry.default_size)
    if size not in entry.presets:
        raise UnknownModelError(
            f"zoo model {name!r} has no size {size!r}; valid sizes: "
            f"{', '.join(map(repr, entry.presets))}."
        )
    fields = [f.name for f in dataclasses.fields(entry.config_cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise UnknownModelError(
            f"zoo model {name!r} has no config field(s) {unknown}; valid fields: "
            f"{', '.join(f for f in fields if f != 'size')}."
        )
    config = entry.config_cls(**{**entry.presets[size], "size": size, **overrides})
    # (the build is a function of the config; a name is registered once)
    key = (name, config)
    try:
        model = _built.pop(key, None)
    except TypeError:  # a field value that cannot be hashed (a list): not kept
        key = model = None
    if model is None:
        init_fn, step = entry.build(config)
        model = ZooModel(name, config, step, init_fn)
    if key is not None:
        _built[key] = model  # (most recently used last)
    while len(_built) > _BUILT_KEPT:
        _built.pop(next(iter(_built)))
    return model


# The models ``get`` built most recently, by (name, config): a model holds functions
# only, no arrays, but JAX keeps each function's compiled programs while the function lives.
_BUILT_KEPT = 64
_built: dict[tuple, ZooModel] = {}
