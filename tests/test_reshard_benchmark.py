"""``benchmarks/reshard.py`` (every layout change of a 3-D array, predicted against compiled) on a
few pairs of the 2 x 4 sweep, two of them made in two steps: the results have the shape the
markdown is written from, and every change compiles to the collectives predicted, so a broken
``reshard_comms``, ``CostModel.reshard_via`` or path emission fails here."""

import json

import pytest

from tests.helpers import benchmark_module

# Two changes the cost model makes through an intermediate layout (tests/cost/test_reshard.py
# PATHS): an involuntary full rematerialization, and an all-to-all of the whole block.
PATH_PAIRS = [((("data", "model"), (), ()), ((), (), ("model",))),
              (((), (), ("data",)), ((), ("data", "model"), ()))]


@pytest.fixture(scope="module")
def reshard():
    with benchmark_module("reshard") as module:
        yield module


def test_the_sweep_covers_every_ordered_pair_and_samples_deterministically(reshard):
    pairs = reshard.all_pairs(reshard.MESHES["2x4"][1])
    assert len(pairs) == 342 and len(set(pairs)) == 342
    assert all(s != d for s, d in pairs)
    a = reshard.select(pairs, sample=20, seed=3)
    assert a == reshard.select(pairs, sample=20, seed=3) and len(a) == 20
    assert set(a) <= set(pairs) and a != reshard.select(pairs, sample=20, seed=4)
    assert reshard.select(pairs, limit=5) == pairs[:5]


def test_a_few_pairs_compile_as_predicted_directly_and_through_their_paths(reshard, tmp_path):
    pairs = reshard.select(reshard.all_pairs(reshard.MESHES["2x4"][1]), limit=8) + PATH_PAIRS
    row = reshard.sweep("2x4", pairs, progress=False)
    assert row["pairs"] == 10 and row["errors"] == 0, row["error_cases"]
    assert row["direct_agree"] == 10 and row["misses"] == [], row["misses"]
    paths = {(tuple(map(tuple, p["src"])), tuple(map(tuple, p["dst"]))): p
             for p in row["path_cases"]}
    assert set(PATH_PAIRS) <= set(paths) and row["paths"] == len(paths)
    assert row["paths_as_priced"] == row["paths"], [p for p in paths.values()
                                                     if not p["as_priced"]]
    for p in paths.values():
        assert len(p["via"]) == 1 and p["priced"] == p["compiled"]
        assert p["speedup"] > 1 and p["path_s"] < p["direct_s"]
    assert 1 < row["path_speedup_median"] <= row["path_speedup_max"]
    row["subset"] = "test"
    result = {"command": "test", "commit": "x", "jax": "x", "rows": [row]}
    md = reshard.markdown(json.loads(json.dumps(result)))  # as written to and read from JSON
    assert "| 2x4 (data x model), test | 10 | 10 | 0 | 0 |" in md
