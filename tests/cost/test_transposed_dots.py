"""``DeviceSpec.transposed_dot_efficiency``: XLA:CPU runs a matmul whose operands are both stored
transposed (a weight gradient whose forward activation ends up on the left) with Eigen's
contraction, at 0.39-0.46 of the rate of its fused matmuls on one core (``benchmarks/COMPUTE.md``);
:func:`hulkjax.cost.dots.transposed_dots` says which dots, and the cost model charges them at
that share of the matmul rate. The rule is held against the compiled HLO here."""

import re

import jax
import jax.numpy as jnp
import pytest

import hulkjax as hj
from hulkjax.cost.dots import transposed_dots, weight_gradients
from hulkjax.cost.model import CostModel
from hulkjax.errors import InvalidTopologyError
from hulkjax.launch.calibrate import device_spec, transposed_dot_efficiency
from hulkjax.topology import DeviceSpec
from hulkjax.topology.specs import DEVICE_SPECS
from tests.helpers import cpu_regions

X = jax.ShapeDtypeStruct((8, 64, 96), jnp.float32)  # batch x sequence x in


def dense_grad(w, x):
    """A dense layer's weight gradient, the kernel stored (in, out) as Flax's ``nn.Dense``."""
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)


def conv1d_grad(w, x):
    """The same with the kernel stored (out, in) and transposed in the forward pass (HF GPT-2's
    ``Conv1D`` reads its kernel so)."""
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w.T)))(w)


def _compiled_transposed_dots(fn, *args) -> int:
    """Dots of the compiled XLA:CPU program with both operands transposed."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return sum(1 for line in hlo.splitlines() if re.search(r" dot\(", line)
               and "lhs_contracting_dims={0}" in line and "rhs_contracting_dims={1}" in line
               and "batch_dims" not in line)


@pytest.mark.parametrize("fn, w, expected", [
    (dense_grad, jax.ShapeDtypeStruct((96, 160), jnp.float32), 1),
    (conv1d_grad, jax.ShapeDtypeStruct((160, 96), jnp.float32), 0),
])
def test_the_rule_finds_the_dots_xla_cpu_lays_out_both_transposed(fn, w, expected):
    graph = hj.trace(fn, w, X)
    found = transposed_dots(graph)
    assert len(found) == expected
    assert all(graph.nodes[i].name == "dot_general" for i in found)
    # what XLA:CPU compiles: the same count (the forward dot is never one of them)
    assert _compiled_transposed_dots(fn, w, X) == expected


@pytest.mark.parametrize("fn, w", [
    (dense_grad, jax.ShapeDtypeStruct((96, 160), jnp.float32)),
    (conv1d_grad, jax.ShapeDtypeStruct((160, 96), jnp.float32)),
])
def test_weight_gradients_are_the_dots_of_a_forward_and_a_backward_operand(fn, w):
    graph = hj.trace(fn, w, X)
    grads = weight_gradients(graph)
    # one weight gradient either way (the forward matmul reads an input and a parameter, no
    # backward value), its cotangent the backward operand: batch x sequence x out
    (nid, cot), = grads.items()
    assert graph.nodes[nid].name == "dot_general"
    assert graph.nodes[graph.values[cot].producer].backward
    assert graph.values[cot].shape == (8, 64, 160)
    other = [v for v in graph.nodes[nid].inputs[:2] if v != cot]
    assert other == [graph.inputs[1]]  # the activation: here the input x itself
    # the both-transposed ones are among them
    assert transposed_dots(graph) <= frozenset(grads)


def _dense_model(efficiency: float):
    graph = hj.trace(dense_grad, jax.ShapeDtypeStruct((96, 160), jnp.float32), X)
    # memory fast enough that every matmul is compute-bound
    topo = cpu_regions(hbm_bandwidth=1e15, kernel_overhead=1e-6,
                       transposed_dot_efficiency=efficiency)
    return graph, CostModel(graph, topo)


def test_a_transposed_dot_is_charged_at_its_share_of_the_matmul_rate():
    graph, cm = _dense_model(0.4)
    (tt,) = transposed_dots(graph)
    node = graph.nodes[tt]
    assert node.flops == 2 * 8 * 64 * 96 * 160
    # 100 GFLOP/s (cpu_regions) at 0.4 of it, plus the kernel's launch
    assert cm.compute_time(node, 1) == pytest.approx(node.flops / (0.4 * 1e11) + 1e-6)
    assert cm.compute_time(node, 2) == pytest.approx(node.flops / 2 / (0.4 * 1e11) + 1e-6)
    # the forward matmul is not one of them: the plain rate
    (fwd,) = [n for n in graph.nodes if n.name == "dot_general" and n.id != tt]
    assert cm.compute_time(fwd, 1) == pytest.approx(fwd.flops / 1e11 + 1e-6)
    plain = _dense_model(1.0)[1]
    assert plain.transposed_dots == frozenset()
    assert plain.compute_time(node, 1) == pytest.approx(node.flops / 1e11 + 1e-6)
    a = cm.replicated_assignment()
    extra = node.flops / 1e11 * (1 / 0.4 - 1)
    assert cm.evaluate(a).compute_time == pytest.approx(plain.evaluate(a).compute_time + extra)


def test_the_default_leaves_accelerators_unchanged():
    assert all(spec.transposed_dot_efficiency == 1.0 for spec in DEVICE_SPECS.values())
    graph = hj.trace(dense_grad, jax.ShapeDtypeStruct((96, 160), jnp.float32), X)
    cm = CostModel(graph, hj.Topology.preset("dgx-h100"))
    assert cm.transposed_dots == frozenset()  # not even looked for
    assert "transposed_dot_efficiency" not in str(hj.Topology.preset("dgx-h100").to_dict())


def test_the_json_form_keeps_it_and_bad_values_are_refused():
    topo = cpu_regions(transposed_dot_efficiency=0.4)
    again = hj.Topology.from_dict(topo.to_dict())
    assert again == topo and again.devices[0].spec.transposed_dot_efficiency == 0.4
    assert "transposed_dot_efficiency" not in str(cpu_regions().to_dict())  # ideal: not written
    for bad in (0.0, -0.3, 1.5):
        with pytest.raises(InvalidTopologyError, match="transposed_dot_efficiency"):
            DeviceSpec(kind="x", peak_flops=1e11, memory=1e10, hbm_bandwidth=1e9,
                       transposed_dot_efficiency=bad)
    data = topo.to_dict()
    (kind,) = data["devices"]["kinds"]
    data["devices"]["kinds"][kind]["transposed_dot_efficiency"] = 2.0
    with pytest.raises(InvalidTopologyError, match="transposed_dot_efficiency"):
        hj.Topology.from_dict(data)


def test_calibration_reads_the_share_from_the_two_matmul_rates():
    meas = {"matmul": {"flops_per_device": 2e10, "seconds": 0.1},  # 200 GFLOP/s
            "memory": {"traffic_per_device": 4e9, "seconds": 0.1},
            "transposed_matmul": {"flops_per_device": 1e10, "seconds": 0.125}}  # 80 GFLOP/s
    assert device_spec(meas, memory=1e10).transposed_dot_efficiency == pytest.approx(0.4)
    # a device that runs them faster than the chain is charged no more than the chain's rate
    fast = {**meas, "transposed_matmul": {"flops_per_device": 1e10, "seconds": 0.01}}
    assert transposed_dot_efficiency(fast["matmul"], fast["transposed_matmul"]) == 1.0
    # an older measurement without it: no slower
    old = {k: v for k, v in meas.items() if k != "transposed_matmul"}
    assert device_spec(old, memory=1e10).transposed_dot_efficiency == 1.0
