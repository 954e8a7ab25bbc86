"""Train the device-group head (``hulkjax train-gnn --head groups``).

The head (:class:`hulkjax.training.model.GroupHead`) learns ``P(unit k runs on group j)`` from
the staged search over every order of a cluster's groups (:mod:`hulkjax.training.group_data`).
Its targets are soft and regret-aware: each order's best layout votes for the group of every
unit with weight ``exp(-(regret - 1) / temperature)`` (regret: the order's step over the best of
all), so the layouts of orders within a few percent of the best share the target, and a hard
argmax of one of several equally good layouts is not forced on the network. Cross-entropy per
unit, optax AdamW, a fixed seed, a tqdm bar; each epoch the held-out labels measure what planning
uses the head for: the regret of the search's own orders plus the head's proposed orders
(:func:`hulkjax.gnn.groups.propose_orders`), against the own orders alone and against as many
random orders. The weights of the epoch with the least validation regret ship in
``hulkjax/gnn/weights/groups.msgpack``; a third draw, the test labels, evaluates them once
(``groups.json``: size, the command, sizes, history and the test numbers).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

from hulkjax.gnn.groups import group_log_probs, propose_orders
from hulkjax.gnn.weights import GROUP_CONFIG, WEIGHTS_DIR
from hulkjax.strategies.auto import HEAD_ORDERS
from hulkjax.training import group_data
from hulkjax.training.model import GroupHead

log = logging.getLogger("hulkjax.training")

TEMPERATURE = 0.01
"""Regret at which an order's layout weighs ``1 / e`` of the best's in the soft targets."""


def soft_targets(label: group_data.Label, temperature: float = TEMPERATURE) -> np.ndarray:
    """``[U, G]`` target distribution per unit (see the module docstring).

    >>> import numpy as np
    >>> from hulkjax.gnn.groups import StageGraph
    >>> lab = group_data.Label("region", StageGraph(np.zeros((2, 1)), np.zeros((2, 1)),
    ...     np.zeros((2, 2, 1))), orders=np.array([[0, 1], [1, 0]]), steps=np.array([1.0, 2.0]),
    ...     assign=np.array([[0, 1], [1, 0]]), own_step=1.0, own_assign=np.array([0, 1]),
    ...     own_orders=np.array([[0, 1]]))
    >>> soft_targets(lab).round(3).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    U, G = label.graph.unit_x.shape[0], label.graph.group_x.shape[0]
    steps = np.append(label.steps, label.own_step)
    assign = np.vstack([label.assign, label.own_assign[None]])
    ok = np.isfinite(steps) & (assign >= 0).all(1)
    w = np.exp(-(steps[ok] / label.best - 1) / temperature)
    target = np.zeros((U, G))
    for weight, row in zip(w, assign[ok]):
        target[np.arange(U), row] += weight
    return (target / target.sum(1, keepdims=True)).astype(np.float32)


def _loss_fn(head):
    def loss(params, unit_x, group_x, link_x, target):
        logp = head.apply(params, unit_x, group_x, link_x)
        return -jnp.mean(jnp.sum(target * logp, axis=-1))

    return loss


ALONE_CAP = 2.0
"""The regret counted for orders alone along which no layout fits (``inf``)."""


def alone_regret(label: group_data.Label, orders) -> float:
    """The regret of ``orders`` without the search's own: how good the proposals are by
    themselves (a held-out measure that does not saturate where the own orders are best;
    :data:`ALONE_CAP` where nothing fits along them)."""
    at = {tuple(o): s for o, s in zip(label.orders.tolist(), label.steps)}
    return float(min(min(at[tuple(o)] for o in orders) / label.best, ALONE_CAP))


def random_regret(label: group_data.Label, n: int, *, own: bool = True) -> float:
    """The expected regret of the search's own orders (``own``) plus ``n`` distinct orders
    drawn at random (every choice of ``n`` orders, averaged)."""
    m = np.minimum((np.minimum(label.steps, label.own_step) if own else label.steps)
                   / label.best, ALONE_CAP)
    if n == 1:
        return float(m.mean())
    if n == 2:
        pair = np.minimum.outer(m, m)
        return float(pair[np.triu_indices(len(m), 1)].mean())
    return float(np.mean([min(m[list(c)]) for c in itertools.combinations(range(len(m)), n)]))


def evaluate(params, labels, *, layers: int, orders: int = HEAD_ORDERS) -> dict:
    """Held-out regret (geometric mean and worst) of the search's own orders, own + the head's
    ``orders`` proposals, and own + as many random orders (the exact expectation over them);
    and of the head's and random orders alone (``*_alone``)."""
    own, head, rand, head_alone, rand_alone = [], [], [], [], []
    for lab in labels:
        logp = group_log_probs(params, lab.graph, layers=layers)
        proposed = propose_orders(logp, orders)
        own.append(lab.own_step / lab.best)
        head.append(lab.regret(proposed))
        rand.append(random_regret(lab, len(proposed)))
        head_alone.append(alone_regret(lab, proposed))
        rand_alone.append(random_regret(lab, len(proposed), own=False))
    if not own:
        return {}
    geo = lambda xs: float(math.exp(np.mean(np.log(xs))))  # noqa: E731
    return {"val_own_regret": geo(own), "val_head_regret": geo(head),
            "val_random_regret": geo(rand), "val_head_worst": float(max(head)),
            "val_own_worst": float(max(own)),
            "val_head_optimal": float(np.mean(np.asarray(head) <= 1.005)),
            "val_head_alone_regret": geo(head_alone), "val_random_alone_regret": geo(rand_alone),
            "val_head_alone_optimal": float(np.mean(np.asarray(head_alone) <= 1.005))}


def train(labels, *, val=(), epochs: int = 40, lr: float = 2e-3, seed: int = 0,
          hidden: int = GROUP_CONFIG["hidden"], layers: int = GROUP_CONFIG["layers"],
          temperature: float = TEMPERATURE, orders: int = HEAD_ORDERS, progress: bool = True):
    """Fit the head on :class:`~hulkjax.training.group_data.Label` s; returns ``(params,
    history)``, the params of the epoch with the least held-out regret of own + head orders,
    then of the head's orders alone (the last epoch's without ``val``)."""
    from tqdm.auto import tqdm

    head = GroupHead(hidden=hidden, layers=layers)
    data = [(lab.graph.unit_x, lab.graph.group_x, lab.graph.link_x,
             soft_targets(lab, temperature)) for lab in labels]
    params = head.init(jax.random.key(seed), *data[0][:3])
    steps = max(epochs * len(data), 2)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 20, 1), steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=1e-4))
    opt_state = opt.init(params)
    loss_fn = _loss_fn(head)

    @jax.jit  # one compilation per (units, groups) shape
    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    history: dict[str, list] = {"train_loss": [], "epoch_time": []}
    rng = np.random.default_rng(seed)
    best, best_params = (math.inf, math.inf), params
    bar = tqdm(total=epochs * len(data), desc="train group head", disable=not progress)
    for _ in range(epochs):
        t0 = time.perf_counter()
        losses = []
        for i in rng.permutation(len(data)):
            params, opt_state, loss = step(params, opt_state, *data[i])
            losses.append(float(loss))
            bar.update(1)
        history["train_loss"].append(float(np.mean(losses)))
        if val:
            for k, v in evaluate(params, val, layers=layers, orders=orders).items():
                history.setdefault(k, []).append(v)
            # Selected on the proposals alone: with the own orders the held-out regret is
            # mostly 1 (they are the best there), which tells epochs apart on few labels.
            score = (history["val_head_regret"][-1], history["val_head_alone_regret"][-1])
            if score < best:
                best, best_params = score, params
                history["selected_epoch"] = len(history["train_loss"])
        else:
            best_params = params
        history["epoch_time"].append(time.perf_counter() - t0)
        bar.set_postfix({k: f"{v[-1]:.4f}" for k, v in history.items()
                         if k in ("train_loss", "val_head_regret", "val_head_alone_regret")})
    bar.close()
    return best_params, history


def save(params, directory: str, *, history=None, extra=None) -> str:
    """Write ``groups.msgpack`` (weights) and ``groups.json`` (size, history)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "groups.msgpack")
    with open(path, "wb") as f:
        f.write(serialization.to_bytes(params))
    meta = dict(GROUP_CONFIG, **(extra or {}))
    if history is not None:
        meta["history"] = history
    with open(os.path.join(directory, "groups.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return path


def make(specs, *, desc: str, progress: bool = True) -> list[group_data.Label]:
    """The labels of ``specs`` (cached; a spec that fails to label is logged and skipped)."""
    from tqdm.auto import tqdm

    out = []
    for spec in tqdm(specs, desc=desc, disable=not progress):
        try:
            out.extend(group_data.load_or_make(spec))
        except Exception as e:  # noqa: BLE001 - one model the zoo or the search refuses
            log.warning("labelling %s failed: %s", group_data.key(spec), e)
    return out


def run(*, samples: int = 300, val_samples: int = 60, test_samples: int = 0, epochs: int = 40,
        seed: int = 0, out_dir: str | None = None, progress: bool = True,
        command: str | None = None) -> dict:
    """The whole job behind ``hulkjax train-gnn --head groups``: label (or load the cached
    labels of) ``samples`` training, ``val_samples`` validation (the epoch kept) and
    ``test_samples`` test (model, cluster) pairs, three seeded draws; train; evaluate the kept
    epoch once on the test labels (:func:`evaluate` with 1-3 proposed orders: the numbers to
    quote, nothing was chosen on them); save the weights (default: the package's) with
    ``groups.json``: the command, the data version, the sizes and the test metrics. Returns the
    history."""
    t0 = time.perf_counter()
    train_set = make(group_data.sample_specs(samples, seed=seed + 1), desc="label (every order)",
                     progress=progress)
    val_set = make(group_data.sample_specs(val_samples, seed=seed + 2), desc="label validation",
                   progress=progress)
    test_set = make(group_data.sample_specs(test_samples, seed=seed + 3), desc="label test",
                    progress=progress) if test_samples else []
    t1 = time.perf_counter()
    params, history = train(train_set, val=val_set, epochs=epochs, seed=seed, progress=progress)
    history["labels"] = {"train": len(train_set), "val": len(val_set), "test": len(test_set),
                         "seconds_labelling_or_loading": t1 - t0,
                         "seconds_training": time.perf_counter() - t1}
    layers = GROUP_CONFIG["layers"]
    test = {str(n): {k.removeprefix("val_"): v for k, v in
                     evaluate(params, test_set, layers=layers, orders=n).items()}
            for n in (1, 2, 3)} if test_set else {}
    counts = {}
    for lab in [*train_set, *val_set, *test_set]:
        G = str(lab.orders.shape[1])
        counts[G] = counts.get(G, 0) + 1
    save(params, out_dir or WEIGHTS_DIR, history=history, extra={
        "command": command, "data_version": group_data.DATA_VERSION,
        "samples": {"train": samples, "val": val_samples, "test": test_samples, "seed": seed},
        "labels_by_groups": counts, "test": test})
    history["test"] = test
    return history


__all__ = ["alone_regret", "evaluate", "make", "random_regret", "run", "save", "soft_targets",
           "train"]
