"""The wide-area testbed's network (``benchmarks/wan/testbed.py``): regions as network namespaces
joined through a bridge, each uplink shaped with tbf, and nothing left behind, also when the run
fails. Needs root and network namespaces; skips otherwise, saying which is missing. Rates are
configured and checked in ``tc``'s own report, never timed."""

import importlib.util
import os
import pathlib
import subprocess

import pytest

TESTBED = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "wan" / "testbed.py"


def _netns_ok() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    probe = f"hjwtest{os.getpid() % 10000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


pytestmark = pytest.mark.skipif(_netns_ok() is not None, reason=f"WAN testbed: {_netns_ok()}")


@pytest.fixture(scope="module")
def testbed():
    spec = importlib.util.spec_from_file_location("wan_testbed", TESTBED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _qdiscs(ns, dev):
    return subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                          capture_output=True, text=True, check=True).stdout


def test_regions_are_shaped_reachable_and_torn_down(testbed):
    tag = f"t{os.getpid() % 1000}"
    net = testbed.Regions([40.0, 80.0, 40.0], tag)
    with net:
        assert sorted(testbed.leftovers(tag)) == sorted([net.core, *net.ns])
        net.shape(True)
        for i, rate in enumerate((40, 80, 40)):
            up, down = _qdiscs(net.ns[i], net.dev[i]), _qdiscs(net.core, net.port[i])
            assert "tbf" in up and f"rate {rate}Mbit" in up, up
            assert "tbf" in down and f"rate {rate}Mbit" in down, down
        rtt, goodput = net.probe(0, 2, megabytes=1)  # through the bridge, region 0 to region 2
        assert rtt > 0 and goodput > 0
        net.shape(False)
        assert "tbf" not in _qdiscs(net.ns[0], net.dev[0])
    assert testbed.leftovers(tag) == []


def test_nothing_is_left_when_the_run_fails_inside(testbed):
    tag = f"f{os.getpid() % 1000}"
    with pytest.raises(RuntimeError, match="a worker failed"):
        with testbed.Regions([100.0, 100.0], tag) as net:
            net.shape(True)
            raise RuntimeError("a worker failed")
    assert testbed.leftovers(tag) == []


def test_a_failed_setup_removes_what_it_made(testbed):
    tag = f"s{os.getpid() % 1000}"
    net = testbed.Regions([100.0, 100.0], tag, subnet="10.214.300")  # an invalid address
    with pytest.raises(subprocess.CalledProcessError):
        net.__enter__()
    assert testbed.leftovers(tag) == []
