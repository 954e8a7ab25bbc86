"""The WAN testbed's report (no namespaces needed): which measured orders the noise explains."""

import importlib.util
import pathlib

import pytest

TESTBED = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "wan" / "testbed.py"


@pytest.fixture(scope="module")
def testbed():
    spec = importlib.util.spec_from_file_location("wan_testbed_report", TESTBED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(name, predicted, steps):
    """A row measured on one process: ``steps`` (s), the first a warm-up."""
    return {"strategy": name, "predicted_step": predicted,
            "measured_step": sorted(steps[1:])[len(steps[1:]) // 2],
            "step_times": [list(steps)]}  # one process


def test_swapped_pairs_within_noise_are_told_from_real_misrankings(testbed):
    a = _row("a", 1.0, [9.0, 1.10, 1.02, 1.06, 1.04])   # predicted faster, measured 1.04-1.06
    b = _row("b", 1.1, [9.0, 1.00, 1.05, 1.03, 1.01])   # measured 1.01-1.04: overlaps a
    c = _row("c", 0.5, [9.0, 2.0, 2.1, 2.2, 2.05])      # predicted fastest, measured slowest
    swapped = {(x["strategy"], y["strategy"]): noise for x, y, noise in
               testbed._swapped([a, b, c])}
    assert swapped == {("a", "b"): True, ("c", "a"): False, ("c", "b"): False}
    assert testbed._swapped([a, c | {"predicted_step": 3.0}]) == []  # same order: none
