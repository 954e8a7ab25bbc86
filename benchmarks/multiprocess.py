"""Real 2-process JAX jobs over an emulated network, held against the cost model's communication time.

Two network namespaces joined by a veth pair stand for two hosts; ``tc qdisc ... tbf rate R`` on
both ends shapes the link (netem is not available here, so latency is measured, not added). Each
process of a ``hulkjax.launch.launch`` job runs in its own namespace (gloo binds the veth
address: each worker gets a UTS namespace whose hostname is its veth IP), the coordinator listens
on process 0's veth IP.

For every model, devices per process ``k`` and rate ``R``: plan each strategy on
``Topology.grid((2, k), ("proc", "dev"))`` whose ``proc`` axis has the per-device share of the
shaped link (``R / k``; the ``k`` devices of a process share its one link) and the measured
one-way latency; run the plans once with the link shaped and once unshaped (same programs). The
measured communication time is the difference of the two step times (medians after the first
step, slowest process), compared with the cost model's predicted time on the ``proc`` axis.

Needs root (ip netns, tc). Writes ``benchmarks/results/multiprocess.json`` and the generated
section of ``benchmarks/MULTIPROCESS.md``::

    sudo python benchmarks/multiprocess.py                       # ~20 min on 2 cores
    sudo python benchmarks/multiprocess.py --quick               # one small configuration
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import textwrap
import time

import jax

import hulkjax as hj
from hulkjax import zoo
from hulkjax.errors import StrategyNotApplicableError
from hulkjax.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "multiprocess.json")
MARKDOWN = os.path.join(HERE, "MULTIPROCESS.md")
BEGIN, END = "<!-- multiprocess.py: begin -->", "<!-- multiprocess.py: end -->"
# A small token bucket: with a large one (256 KB) every collective that follows a pause for
# compute gets its first burst at line rate, and small collectives look up to ~30% cheaper.
BURST = "4kb"

_PROBE_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    c.sendall(c.recv(1))
n = 0
while (b := c.recv(1 << 20)):
    n += len(b)
c.sendall(b"k")
"""

_PROBE_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
buf, n = b"x" * (1 << 20), int(sys.argv[4])
t = time.perf_counter()
for _ in range(n):
    c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1)
dt = time.perf_counter() - t
rtts.sort()
print(rtts[len(rtts) // 2], n * len(buf) / dt)
"""


class VethPair:
    """Two network namespaces joined by one veth pair: the two 'hosts' of the benchmark."""

    def __init__(self, tag: str, subnet: str = "10.213.7"):
        self.ns = [f"hjb{tag}a", f"hjb{tag}b"]
        self.dev = [f"hjv{tag}a", f"hjv{tag}b"]
        self.ip = [f"{subnet}.1", f"{subnet}.2"]
        self.rate_mbit: float | None = None

    @staticmethod
    def _run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def __enter__(self) -> VethPair:
        for ns in self.ns:
            self._run("ip", "netns", "add", ns)
        try:
            self._run("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, ip in zip(self.ns, self.dev, self.ip):
                self._run("ip", "link", "set", dev, "netns", ns)
                self._run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                self._run("ip", "-n", ns, "link", "set", dev, "up")
                self._run("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in self.ns:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def shape(self, rate_mbit: float | None) -> None:
        """``tbf rate R`` on both ends (both directions); ``None`` removes the shaping."""
        for ns, dev in zip(self.ns, self.dev):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
                           capture_output=True)
            if rate_mbit is not None:
                self._run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                          "tbf", "rate", f"{rate_mbit}mbit", "burst", BURST, "latency", "400ms")
        self.rate_mbit = rate_mbit

    def prefix(self, i: int) -> list[str]:
        """Run process ``i`` in namespace ``i``, with its veth IP as hostname (gloo binds it)."""
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "sh", "-c",
                f'hostname {self.ip[i]} && exec "$0" "$@"']

    def probe(self, megabytes: int) -> dict:
        """Median round trip of 1 byte, and TCP goodput of ``megabytes`` MB, from ns 0 to ns 1."""
        port, pings = "5931", 200
        server = subprocess.Popen(["ip", "netns", "exec", self.ns[1], sys.executable, "-c",
                                   _PROBE_SERVER, self.ip[1], port, str(pings)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()
            out = subprocess.run(["ip", "netns", "exec", self.ns[0], sys.executable, "-c",
                                  _PROBE_CLIENT, self.ip[1], port, str(pings), str(megabytes)],
                                 check=True, capture_output=True, text=True, timeout=300).stdout
        finally:
            server.wait(timeout=30)
        rtt, goodput = map(float, out.split())
        return {"rtt": rtt, "goodput": goodput}


def _plans(model, size, topo, strategies):
    m = zoo.get(model, size=size)
    args = m.abstract()
    graph = hj.trace(m.step, *args)
    plans = []
    for s in strategies:
        try:
            plans.append(hj.plan(m.step, *args, topology=topo, strategy=s, graph=graph))
        except StrategyNotApplicableError:
            continue
    return plans, m.param_count()


def measure(net: VethPair, model: str, size: str, k: int, rate: float, probe: dict,
            strategies, steps: int, run_dir: str, timeout: float) -> list[dict]:
    # The k devices of a process share its one link: each device's share is R / k.
    topo = hj.Topology.grid((2, k), ("proc", "dev"), bandwidth=(rate * 1e6 / 8 / k, 100e9),
                            latency=(probe["rtt"] / 2, 1e-6), name=f"veth{rate:g}mbit-2x{k}")
    plans, params = _plans(model, size, topo, [s for s in strategies if k > 1 or s != "dp_tp"])
    common = dict(size=size, processes=2, steps=steps, host=net.ip[0], prefix=net.prefix,
                  timeout=timeout)
    tag = f"{model}-{size}-k{k}-{rate:g}mbit"
    net.shape(rate)
    shaped = launch(model, topo, strategies=plans, out=os.path.join(run_dir, tag), **common)
    net.shape(None)
    fast = launch(model, topo, strategies=plans, out=os.path.join(run_dir, tag + "-unshaped"),
                  check=False, **common)
    rows = []
    for p, rs, rf in zip(plans, shaped["runs"], fast["runs"]):
        c = p.cost
        cross = [x for x in rs["collectives"] if x["crosses_processes"]]
        measured_comm = rs["step_time"] - rf["step_time"]
        rows.append({
            "model": model, "size": size, "params": params, "local_devices": k,
            "rate_mbit": rate, "goodput": probe["goodput"], "rtt": probe["rtt"],
            "strategy": p.strategy,
            "predicted_step": c.step_time, "predicted_comm": c.comm_time,
            "predicted_comm_proc": c.comm_time_by_axis.get("proc", 0.0),
            "predicted_comm_dev": c.comm_time_by_axis.get("dev", 0.0),
            "predicted_bytes_proc": c.comm_bytes.get("proc", 0.0),
            "hlo_collectives": rs["collectives"],
            "hlo_bytes_crossing": sum(x["bytes"] for x in cross),
            "measured_step": rs["step_time"], "measured_step_unshaped": rf["step_time"],
            "measured_comm": measured_comm,
            "ratio": (measured_comm / c.comm_time_by_axis["proc"]
                      if c.comm_time_by_axis.get("proc", 0.0) > 0 else None),
            "step_times": rs["step_times"], "step_times_unshaped": rf["step_times"],
            "check": rs["check"]["match"] if rs["check"] else None,
        })
        print(f"  {p.strategy:9s} predicted comm {rows[-1]['predicted_comm_proc'] * 1e3:8.1f} ms   "
              f"measured "
              f"{measured_comm * 1e3:8.1f} ms   (step {rs['step_time'] * 1e3:.0f} ms shaped, "
              f"{rf['step_time'] * 1e3:.0f} ms unshaped)   check: {rows[-1]['check']}", flush=True)
    return rows


def _min_step(step_times) -> float:
    """Fastest step after the first (slowest process per step): the least disturbed by other
    work on the machine."""
    per_step = [max(ts) for ts in zip(*step_times)]
    return min(per_step[1:] or per_step)


def _ranking(rows, key) -> list[str]:
    return [r["strategy"] for r in sorted(rows, key=lambda r: r[key])]


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [BEGIN, "", f"Generated by `benchmarks/multiprocess.py` on {result['date']} "
             f"({result['cpus']} CPU cores, jax {result['jax']}; `{result['command'].strip()}`; "
             f"tbf burst {result.get('tbf_burst', '?')}; load average "
             f"{result.get('loadavg_before', [0])[0]:.1f} before, "
             f"{result.get('loadavg_after', [0])[0]:.1f} after).", ""]
    lines += ["Link probes (1 MB TCP writes from one namespace to the other; 1-byte ping-pong):", "",
              "| tbf rate | TCP goodput | share of the rate | median RTT |", "|---:|---:|---:|---:|"]
    for p in result["probes"]:
        share = "-" if p["rate_mbit"] is None else f"{p['goodput'] * 8 / (p['rate_mbit'] * 1e6):.0%}"
        rate = "unshaped" if p["rate_mbit"] is None else f"{p['rate_mbit']:g} Mbit/s"
        lines.append(f"| {rate} | {p['goodput'] / 1e6:.1f} MB/s | {share} | "
                     f"{p['rtt'] * 1e6:.0f} us |")
    lines += ["", "Per strategy: **predicted** is the cost model's communication time on the `proc`"
              " axis (bandwidth = rate / k per device, latency = RTT / 2); **measured** is the step"
              " time with the link shaped minus the step time of the same program unshaped"
              " (medians over the steps after the first, slowest process); *(min)* uses the"
              " fastest step instead of the median, which other work on the machine disturbs"
              " least. *crossing* is what the compiled program's collectives over `proc` move per"
              " device (HLO bytes).", ""]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["size"], r["params"], r["local_devices"]), []).append(r)
    for (model, size, params, k), rs in groups.items():
        lines += [f"### {model} {size} ({params / 1e6:.1f}M parameters), 2 processes x {k} "
                  f"device{'s' if k > 1 else ''}", "",
                  "| rate | strategy | HLO collectives crossing processes | crossing | predicted "
                  "comm | measured comm | measured / predicted | measured comm (min) | step "
                  "shaped | step unshaped | matches unsharded |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|:-:|"]
        for r in rs:
            colls = ", ".join(f"{c['kind']} {'+'.join(c['axes'])} x{c['count']}"
                              for c in r["hlo_collectives"] if c["crosses_processes"]) or "none"
            pred = r["predicted_comm_proc"]
            ratio = "-" if pred <= 0 else f"{r['measured_comm'] / pred:.2f}"
            comm_min = _min_step(r["step_times"]) - _min_step(r["step_times_unshaped"])
            lines.append(
                f"| {r['rate_mbit']:g} Mbit/s | {r['strategy']} | {colls} | "
                f"{r['hlo_bytes_crossing'] / 1e6:.2f} MB | {r['predicted_comm_proc'] * 1e3:.0f} ms |"
                f" {r['measured_comm'] * 1e3:.0f} ms | {ratio} | {comm_min * 1e3:.0f} ms |"
                f" {r['measured_step'] * 1e3:.0f} ms |"
                f" {r['measured_step_unshaped'] * 1e3:.0f} ms | "
                f"{'yes' if r['check'] else 'NO' if r['check'] is False else '-'} |")
        for rate in sorted({r["rate_mbit"] for r in rs}):
            at = [r for r in rs if r["rate_mbit"] == rate]
            lines.append("")
            lines.append(f"At {rate:g} Mbit/s, ranked by predicted comm: "
                         f"{' < '.join(_ranking(at, 'predicted_comm_proc'))}; by measured comm: "
                         f"{' < '.join(_ranking(at, 'measured_comm'))}; by measured step: "
                         f"{' < '.join(_ranking(at, 'measured_step'))}.")
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def write_markdown(section: str) -> None:
    header = textwrap.dedent("""\
        # Multi-process runs over an emulated network

        `hulkjax launch` runs a plan as a real `jax.distributed` job, one process per node. This page
        holds those jobs against the cost model on a link whose bandwidth we control: two network
        namespaces (the two "hosts") joined by a veth pair, shaped with `tc qdisc ... tbf rate R`.
        Collectives between the processes go over gloo/TCP on that link. See
        `benchmarks/multiprocess.py` for the method; the section below is generated by it.
        """)
    text = open(MARKDOWN).read() if os.path.exists(MARKDOWN) else header
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(MARKDOWN, "w") as f:
        f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mlp:small", "transformer-block:small"])
    ap.add_argument("--rates", nargs="+", type=float, default=[100.0, 200.0], help="Mbit/s")
    ap.add_argument("--local-devices", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--strategies", nargs="+",
                    default=["dp", "fsdp", "megatron", "dp_tp", "auto"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--run-dir", default="/tmp/hulkjax-multiprocess")
    ap.add_argument("--quick", action="store_true",
                    help="mlp small, k=1, dp and megatron at 100 Mbit/s, 3 steps")
    ap.add_argument("--markdown-only", action="store_true",
                    help="re-render MULTIPROCESS.md from results/multiprocess.json (no root)")
    args = ap.parse_args()
    if args.markdown_only:
        with open(RESULTS) as f:
            write_markdown(markdown(json.load(f)))
        return
    if args.quick:
        args.models, args.rates, args.local_devices = ["mlp:small"], [100.0], [1]
        args.strategies, args.steps = ["dp", "megatron"], 3
    if os.geteuid() != 0:
        sys.exit("benchmarks/multiprocess.py needs root: it creates network namespaces and "
                 "shapes a veth pair with tc.")
    command = "python benchmarks/multiprocess.py " + " ".join(sys.argv[1:])
    # Leave through the finally blocks (stop the workers, delete the namespaces) on SIGTERM too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
    rows, probes = [], []
    t0 = time.time()
    with VethPair(str(os.getpid() % 100000)) as net:
        net.shape(None)
        probes.append({"rate_mbit": None, **net.probe(200)})
        for rate in args.rates:
            net.shape(rate)
            probe = net.probe(max(8, int(rate / 8 * 1.5)))  # ~1.5 s of traffic
            probes.append({"rate_mbit": rate, **probe})
            print(f"{rate:g} Mbit/s: goodput {probe['goodput'] / 1e6:.2f} MB/s, RTT "
                  f"{probe['rtt'] * 1e6:.0f} us", flush=True)
            for spec in args.models:
                model, size = spec.split(":")
                for k in args.local_devices:
                    print(f"{model} {size}, 2 processes x {k} devices, {rate:g} Mbit/s", flush=True)
                    rows += measure(net, model, size, k, rate, probe, args.strategies, args.steps,
                                    args.run_dir, args.timeout)
    result = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
              "machine": platform.machine(), "jax": jax.__version__, "command": command,
              "wall_time": time.time() - t0, "tbf_burst": BURST,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
              "probes": probes, "rows": rows}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(markdown(result))
    print(f"wrote {RESULTS} and {MARKDOWN} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
