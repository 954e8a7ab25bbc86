"""A wide-area testbed in one command: one network namespace per region, real JAX processes,
measured step times against the cost model's predictions.

What it builds (root only; everything is torn down in ``finally``, also on errors and SIGTERM)::

    ns hjw<tag>r0 (region 0)        ns hjw<tag>r1 (region 1)      ...
      veth r0 10.214.x.1/24           veth r1 10.214.x.2/24
      tbf rate R0 (egress: upload)    tbf rate R1
            |                               |
      ns hjw<tag>core: bridge, one port per region, tbf rate Ri on port i (download of region i)

A transfer from region a to region b is shaped by a's upload and b's download: ``min(Ra, Rb)``.
``netem`` is not available on these machines, so **latency is modelled, not emulated**: the veth
links add microseconds, and wide-area delays of tens of ms are not reproduced. The topology's
latency per ring step between regions is the calibrated one where the calibration can tell it
from the fixed cost of a call (two or more devices per region), never below the measured round
trip / 2; the fixed cost of each collective call, gloo's own (milliseconds here), is the
calibrated device's ``collective_overhead`` (``hulkjax.launch.calibrate.split_call_cost``; runs
before 2026-11-28 had neither, and used the round trip / 2 alone).

Then, per run:
1. ``hulkjax.launch.calibrate`` in the namespaces (one process per region, ``--devices`` fake CPU
   devices each): per-device matmul FLOP/s and memory bandwidth with every device working, and the
   gloo all-reduce between regions over the shaped links (bandwidth from an alpha-beta fit over
   sizes; a call's fixed cost and latency from combined all-reduces of small operands).
2. The topology: the ``regional`` preset's hierarchy (one site per region, ``devices`` devices
   each; mesh axes ``("region", "gpu")``) with the calibrated device, the link between sites at
   the calibrated bandwidth (the nominal tbf rate alongside in the results) and inside a site the
   calibrated local link; written to ``benchmarks/wan/topology.json``. Its sites are device
   groups, so ``pipeline`` and ``auto`` can place layers on regions (staged plans, values sent
   between the processes with cross-host ``jax.device_put``).
3. ``hulkjax.launch.launch`` of a small GPT-2 step (zoo ``gpt2`` tiny unless ``--model``) under each
   strategy, one process per region, shaped; then the same plans unshaped, so the measured
   communication is the difference of the two medians.
4. Results: ``benchmarks/results/wan-<regions>x<devices>[-<tag>].json``; ``benchmarks/WAN.md`` is rendered from
   every ``wan-*.json`` there.

Afterwards it checks that no namespace it made is left (``ip netns list``) and says so in the
results. Usage::

    sudo python benchmarks/wan/testbed.py                      # 2 regions at 100 Mbit/s
    sudo python benchmarks/wan/testbed.py --regions 3 --rates 100 50 100
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(BENCH, "results")  # wan-<regions>x<devices>[-<tag>].json, one per configuration
MARKDOWN = os.path.join(BENCH, "WAN.md")
TOPOLOGY = os.path.join(HERE, "topology.json")
BURST = "4kb"  # small bucket: no line-rate bursts after compute pauses (see multiprocess.py)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


class Regions:
    """``n`` region namespaces joined through a bridge in a core namespace, each uplink shaped."""

    def __init__(self, rates_mbit, tag: str, subnet: str = "10.214.9"):
        self.rates = list(rates_mbit)
        self.n = len(self.rates)
        self.cpus = pinning(self.n)
        self.core = f"hjw{tag}core"
        self.ns = [f"hjw{tag}r{i}" for i in range(self.n)]
        self.dev = [f"hjw{tag}v{i}" for i in range(self.n)]  # region end
        self.port = [f"hjw{tag}p{i}" for i in range(self.n)]  # bridge end
        self.ip = [f"{subnet}.{i + 1}" for i in range(self.n)]
        self.made: list[str] = []

    def __enter__(self) -> Regions:
        try:
            for ns in [self.core, *self.ns]:
                _run("ip", "netns", "add", ns)
                self.made.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.core, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.core, "link", "set", "br0", "up")
            for ns, dev, port, ip in zip(self.ns, self.dev, self.port, self.ip):
                _run("ip", "-n", self.core, "link", "add", port, "type", "veth", "peer", "name",
                     dev, "netns", ns)
                _run("ip", "-n", self.core, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.core, "link", "set", port, "up")
                _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        # Deleting a namespace deletes its veth ends, the bridge and their qdiscs.
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []

    def shape(self, on: bool) -> None:
        """``tbf`` on each region's upload (its veth) and download (its bridge port), or none."""
        for i in range(self.n):
            for ns, dev in ((self.ns[i], self.dev[i]), (self.core, self.port[i])):
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev,
                                "root"], capture_output=True)
                if on:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                         "tbf", "rate", f"{self.rates[i]}mbit", "burst", BURST, "latency",
                         "400ms")

    def prefix(self, i: int) -> list[str]:
        """Run process ``i`` in region ``i`` with its IP as hostname (gloo binds it), on its own
        cores where there are enough (:func:`pinning`)."""
        pin = ["taskset", "-c", ",".join(map(str, self.cpus[i]))] if self.cpus else []
        return ["ip", "netns", "exec", self.ns[i], *pin, "unshare", "--uts", "sh", "-c",
                f'hostname {self.ip[i]} && exec "$0" "$@"']

    def probe(self, a: int = 0, b: int = 1, megabytes: int = 4) -> tuple[float, float]:
        """Median TCP 1-byte round trip (s) and goodput (bytes/s) from region a to b."""
        port = "5937"
        server = subprocess.Popen(["ip", "netns", "exec", self.ns[b], sys.executable, "-c",
                                   _PROBE_SERVER, self.ip[b], port, "100"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            server.stdout.readline()
            out = subprocess.run(["ip", "netns", "exec", self.ns[a], sys.executable, "-c",
                                  _PROBE_CLIENT, self.ip[b], port, "100", str(megabytes)],
                                 check=True, capture_output=True, text=True, timeout=300).stdout
        finally:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        rtt, goodput = map(float, out.split())
        return rtt, goodput


_PROBE_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    c.sendall(c.recv(1))
while c.recv(1 << 20):
    pass
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
rtts.sort()
print(rtts[len(rtts) // 2], n * len(buf) / (time.perf_counter() - t))
"""


def pinning(regions: int) -> list[list[int]] | None:
    """Per region, the cores its process runs on: the cores this process may use, split evenly
    (``None`` when there are fewer cores than regions).

    Fake CPU devices in different processes share the machine's cores, so unpinned a device
    computes at twice its all-busy rate while the others wait (in a pipeline's bubble) and at
    that rate when they compute: its speed depends on the plan. Pinned, each region's devices
    have cores of their own, as the devices of a real cluster do, and the calibration measures
    the rate they compute at in every plan."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < regions:
        return None
    per = len(cpus) // regions
    return [cpus[i * per:(i + 1) * per] for i in range(regions)]


def leftovers(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(f"hjw{tag}")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--rates", type=float, nargs="+", default=None,
                    help="Mbit/s per region uplink (default 100 each)")
    ap.add_argument("--devices", type=int, default=2, help="fake CPU devices per region")
    ap.add_argument("--model", default="gpt2:tiny",
                    help="zoo model:size, or path/file.py:function returning (step, state, "
                         "batch) (e.g. benchmarks/wan/thirdparty.py:gpt2, Hugging Face's Flax "
                         "GPT-2; --batch and --set are then the function's own)")
    ap.add_argument("--batch", type=int, default=None,
                    help="batch size (default: the smallest multiple of regions x devices that is "
                         ">= 8, so that every strategy can split it)")
    ap.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="model config overrides (integers), e.g. --set n_layers=6 d_model=256")
    ap.add_argument("--strategies", nargs="+", default=["replicate", "dp", "fsdp", "dp_tp", "pipeline", "auto"])
    ap.add_argument("--steps", type=int, default=6, help="steps per plan; the first is warm-up")
    ap.add_argument("--tag", default="",
                    help="results name suffix: results/wan-<regions>x<devices>[-TAG].json")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--run-dir", default="/tmp/hulkjax-wan")
    ap.add_argument("--markdown-only", action="store_true",
                    help="re-render WAN.md from results/wan-*.json (no root, nothing run)")
    ap.add_argument("--replan", action="store_true",
                    help="plan every recorded run's strategies again with this checkout, on its "
                         "recorded topology, and say whether the plans and predictions are still "
                         "the ones measured (no root, nothing run; exit 1 if any differs)")
    args = ap.parse_args(argv)
    if args.markdown_only:
        write_markdown()
        return 0
    if args.replan:
        return replan()
    rates = args.rates or [100.0] * args.regions
    if len(rates) != args.regions:
        sys.exit(f"--rates has {len(rates)} values for {args.regions} regions.")
    if os.geteuid() != 0:
        sys.exit("benchmarks/wan/testbed.py needs root: it creates network namespaces, veth "
                 "links and a bridge, and shapes them with tc.")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        sys.exit("ip netns does not work here: no network namespaces, no testbed.")

    import jax

    import hulkjax as hj
    from hulkjax.launch import launch
    from hulkjax.launch.calibrate import calibrate
    from hulkjax.loading import absolute_spec, load_step
    from hulkjax.topology import LinkSpec

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tag = str(os.getpid() % 10000)
    user = ".py:" in args.model  # a user step (file:function), else a zoo model:size
    if user and (args.batch or args.set):
        sys.exit(f"--batch and --set configure zoo models; {args.model} builds its own step.")
    model, size = (absolute_spec(args.model), None) if user else args.model.split(":")
    devices = args.regions * args.devices
    batch = None if user else args.batch or -(-8 // devices) * devices
    overrides = None if user else {"batch": batch}
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            sys.exit(f"--set {item!r}: expected FIELD=INTEGER, e.g. n_layers=6.")
        overrides[field] = int(value)
    command = "python benchmarks/wan/testbed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    result = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
              "jax": jax.__version__, "command": command.strip(), "regions": args.regions,
              "rates_mbit": rates, "devices_per_region": args.devices, "model": args.model, "batch": batch,
              "overrides": overrides,
              "steps": args.steps, "tbf_burst": BURST,
              "latency": "modelled, not emulated (netem unavailable): the topology's latency is "
                         "the measured RTT / 2 of the veth links"}
    rows = []
    net = Regions(rates, tag)
    result["pinning"] = net.cpus
    try:
        with net:
            net.shape(True)
            rtt, goodput = net.probe(megabytes=max(2, int(min(rates) / 8 * 1.5)))
            print(f"{args.regions} regions at {rates} Mbit/s: RTT {rtt * 1e6:.0f} us, TCP "
                  f"goodput {goodput / 1e6:.3g} MB/s", flush=True)
            topo_cal, cal = calibrate(processes=args.regions, local_devices=args.devices,
                                      memory_bytes=64 << 20,
                                      link_bytes=(1 << 18, 1 << 20, 1 << 22), repeats=5,
                                      out=os.path.join(args.run_dir, "calibrate"),
                                      host=net.ip[0], prefix=net.prefix, timeout=args.timeout)
            spec = topo_cal.slowest_device()
            # What a receive costs the receiving core's compute (the processes' network stacks
            # run on the cores their devices compute on): charged to staged plans' receivers.
            from transfer_time import receive_share

            recv = receive_share(net)
            spec = dataclasses.replace(spec, receive_overhead=recv["share"])
            print(f"receive overhead: {recv['share']:.2f} of a receive's link time (matmul chain "
                  f"{recv['chain_small'] * 1e3:.0f} ms beside 4 kB receives, "
                  f"{recv['chain_big'] * 1e3:.0f} ms beside {recv['bytes_big'] >> 20} MB ones "
                  f"taking {recv['receive_big'] * 1e3:.0f} ms)", flush=True)
            link_bw = cal["link"]["bandwidth"]
            nominal_bw = min(rates) * 1e6 / 8
            local = cal.get("local_link", {"bandwidth": 10e9, "latency": 1e-6})
            link_lat = max(cal["link"]["latency"], rtt / 2)

            def sites(bw, name):
                topo = hj.Topology.preset(
                    "regional", regions=args.regions, gpus_per_node=args.devices, device=spec,
                    metro=LinkSpec(bandwidth=bw, latency=link_lat),
                    intra_node={spec.kind: LinkSpec(bandwidth=local["bandwidth"],
                                                    latency=local["latency"])})
                return hj.Topology.from_dict({**topo.to_dict(), "name": name})

            topo = sites(link_bw, f"wan-{args.regions}x{args.devices}-calibrated")
            topo_nominal = sites(nominal_bw, f"wan-{args.regions}x{args.devices}-nominal")
            # The same plans with links between regions 1000x faster: the predicted step less
            # this is the communication the shaping adds, what "measured comm" measures.
            topo_free = sites(link_bw * 1e3, f"wan-{args.regions}x{args.devices}-free-links")
            topo.save(TOPOLOGY)
            result |= {"rtt": rtt, "tcp_goodput": goodput, "wan_latency": link_lat,
                       "calibration": {**{k: cal[k] for k in ("device", "link")},
                                       "receive_overhead": recv},
                       "link_nominal": nominal_bw, "topology": topo.to_dict()}
            print(f"calibrated: {spec.peak_flops / 1e9:.3g} GFLOP/s, "
                  f"{spec.hbm_bandwidth / 1e9:.3g} GB/s in place and "
                  f"{spec.fresh_page_time * 1e6:.3g} us per fresh page per device; region link "
                  f"{link_bw / 1e6:.3g} MB/s (nominal {nominal_bw / 1e6:.3g} MB/s)", flush=True)

            loaded = load_step(model, size=size, overrides=overrides)
            step, margs = loaded.step, loaded.args
            graph = hj.trace(step, *margs)
            if user:  # what the results say of it: its parameters (the state's "params",
                # else all of the state) and its batch's shapes
                state, batch_args = margs
                held = state.get("params", state) if isinstance(state, dict) else state
                result["model_params"] = sum(math.prod(x.shape)
                                             for x in jax.tree_util.tree_leaves(held))
                result["model_batch"] = ({k: list(v.shape) for k, v in batch_args.items()}
                                         if isinstance(batch_args, dict) else None)
            plans = []
            for s in args.strategies:
                try:
                    plans.append(hj.plan(step, *margs, topology=topo, strategy=s, graph=graph))
                except hj.HulkjaxError as e:
                    print(f"  {s}: not planned ({type(e).__name__}: {e})", flush=True)
            common = dict(size=size, overrides=overrides, processes=args.regions, steps=args.steps, host=net.ip[0],
                          prefix=net.prefix, timeout=args.timeout)
            shaped = launch(model, topo, strategies=plans,
                            out=os.path.join(args.run_dir, "shaped"), **common)
            net.shape(False)
            fast = launch(model, topo, strategies=plans, check=False,
                          out=os.path.join(args.run_dir, "unshaped"), **common)
            for p, rs, rf in zip(plans, shaped["runs"], fast["runs"]):
                nominal = hj.plan(step, *margs, topology=topo_nominal, strategy=p.strategy,
                                  graph=graph).cost if p.strategy != "auto" else None
                crossing = [c for c in rs["collectives"] if c["crosses_processes"]] + \
                    [t for t in rs.get("transfers", []) if t["from_processes"] != t["to_processes"]]
                rows.append({
                    "strategy": p.strategy,
                    "plan": plan_label(p, topo),
                    "predicted_step": p.cost.step_time,
                    # what the shaped links add to the step (exposed transfers and collectives
                    # between regions): step - step with free links, the same plan
                    "predicted_comm": None if (fs := free_step(p, graph, step, margs, topo_free))
                    is None else p.cost.step_time - fs,
                    "predicted_collectives": p.cost.comm_time,
                    "predicted_comm_region": p.cost.comm_time_by_axis.get("region", 0.0),
                    "predicted_step_nominal_link": None if nominal is None else nominal.step_time,
                    "measured_step": rs["step_time"],
                    "measured_step_unshaped": rf["step_time"],
                    "measured_comm": rs["step_time"] - rf["step_time"],
                    "step_times": rs["step_times"],
                    "collectives": rs["collectives"],
                    "crosses_regions": bool(crossing),
                    "check": None if rs["check"] is None else rs["check"]["match"],
                    "check_tolerance": None if rs["check"] is None else rs["check"]["tolerance"],
                })
                r = rows[-1]
                print(f"  {p.strategy:7s} predicted {r['predicted_step'] * 1e3:7.1f} ms "
                      f"(comm {(r['predicted_comm'] or 0.0) * 1e3:6.1f})  measured {r['measured_step'] * 1e3:7.1f}"
                      f" ms (comm {r['measured_comm'] * 1e3:6.1f}, unshaped "
                      f"{r['measured_step_unshaped'] * 1e3:.1f})  check {r['check']}", flush=True)
    finally:
        net.__exit__()
        left = leftovers(tag)
        result["left_behind"] = left
        result["wall_time"] = time.time() - t0
        # other jobs on the machine share the cores the regions are pinned to
        result["load_average"] = os.getloadavg()[1]
        result["rows"] = rows
        if left:
            print(f"WARNING: namespaces left behind: {left}", flush=True)
    os.makedirs(RESULTS_DIR, exist_ok=True)
    suffix = f"-{args.tag}" if args.tag else ""
    path = os.path.join(RESULTS_DIR, f"wan-{args.regions}x{args.devices}{suffix}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    write_markdown()
    print(f"wrote {path} and {MARKDOWN} ({result['wall_time']:.0f} s)")
    return 0


def plan_label(p, topo) -> str:
    """How a results row names a plan: ``SPMD``, or its stages, microbatches and schedule (and
    how many of the devices it uses, where not all)."""
    if not p.stages:
        return "SPMD"
    used = {d for st in p.stages for d in st.devices}
    return (f"{len(p.stages)} stage{'s' if len(p.stages) > 1 else ''} x {p.microbatches} mb "
            f"({p.schedule})" + (f" on {len(used)} of {topo.num_devices} devices"
                                 if len(used) < topo.num_devices else ""))


def replan(rel: float = 1e-9) -> int:
    """Plan every row of every ``results/wan-*.json`` again, with this checkout, on the run's
    recorded (calibrated) topology, and print the recorded plan and predicted step beside the
    new ones: whether the measurements still describe what hulkjax plans today (a change of the
    cost model or of a planner can move them; the measurements themselves need root and an hour
    to redo). Returns 1 if a plan or a prediction (relative ``rel``) differs."""
    import hulkjax as hj
    from hulkjax.formatting import format_time
    from hulkjax.loading import load_step

    changed = 0
    for name, res in recorded_runs():
        topo = hj.Topology.from_dict(res["topology"])
        if ".py:" in res["model"]:  # a user step, recorded relative to the repository
            where, _, fn = res["model"].rpartition(":")
            model, size, overrides = f"{os.path.join(os.path.dirname(BENCH), where)}:{fn}", None, None
        else:
            model, size = res["model"].split(":")
            overrides = res.get("overrides")
        loaded = load_step(model, size=size, overrides=overrides)
        graph = hj.trace(loaded.step, *loaded.args)
        for row in res["rows"]:
            p = hj.plan(loaded.step, *loaded.args, topology=topo, strategy=row["strategy"],
                        graph=graph)
            label, t = plan_label(p, topo), p.cost.step_time
            same = label == row["plan"] and abs(t / row["predicted_step"] - 1) <= rel
            changed += not same
            print(f"{name:26s} {row['strategy']:9s} measured: {row['plan']} "
                  f"{format_time(row['predicted_step'])} | now: "
                  f"{'the same' if same else f'{label} {format_time(t)}'}", flush=True)
    print("every plan and prediction as measured" if not changed else
          f"{changed} plan(s) or prediction(s) differ from the measured ones: rerun those "
          "configurations' commands (results/wan-*.json 'command')")
    return int(changed > 0)


def recorded_runs() -> list[tuple[str, dict]]:
    """``(file name, results)`` of every ``results/wan-*.json``, by name."""
    runs = []
    for name in sorted(os.listdir(RESULTS_DIR)):
        if name.startswith("wan-") and name.endswith(".json"):
            with open(os.path.join(RESULTS_DIR, name)) as f:
                runs.append((name, json.load(f)))
    return runs


def write_markdown() -> None:
    """``benchmarks/WAN.md`` from every ``results/wan-*.json``."""
    runs = [res for _, res in recorded_runs()]
    parts = ["# Wide-area testbed: measured against predicted", "",
             "Each section: one command of `benchmarks/wan/testbed.py` (root). The numbers are "
             "what it measured; nothing here is hand-edited. `python benchmarks/wan/testbed.py "
             "--replan` (no root) says whether today's checkout still makes the plans and "
             "predictions measured here.", ""]
    parts += summary(runs)
    parts += [markdown(r) for r in runs]
    with open(MARKDOWN, "w") as f:
        f.write("\n".join(parts))


def _model_config(res: dict) -> str:
    """The model's configuration as a results file records it: a zoo model's overrides, or what
    a user step (``file.py:function``) says of itself."""
    if res.get("model_params") is not None:
        batch = res.get("model_batch")
        return f"{res['model_params'] / 1e6:.2f}M parameters" + (", batch " + ", ".join(
            f"{k} {'x'.join(map(str, v))}" for k, v in batch.items()) if batch else "")
    overrides = res.get("overrides") or {"batch": res.get("batch", "?")}
    return ", ".join(f"{k} {v}" for k, v in overrides.items())


def free_step(p, graph, step, margs, topo_free) -> float | None:
    """The predicted step of plan ``p`` (made for ``graph``) with the topology's links between
    regions free: the same stages re-costed (staged plans), the same assignment evaluated
    (SPMD plans; the candidates depend on the mesh, not on link speeds: checked, ``None``
    where they differ, so the run's measurements are kept)."""
    import hulkjax as hj
    from hulkjax.strategies.realize import cost_model

    if p.stages is not None:
        return hj.estimate(step, *margs, plan=p, topology=topo_free).step_time
    cm, cm_free = cost_model(graph, p.topology), cost_model(graph, topo_free)
    same = len(cm.groups) == len(cm_free.groups) and all(
        a.candidates == b.candidates for a, b in zip(cm.groups, cm_free.groups))
    if not same:
        print(f"  {p.strategy}: the free-links topology changes the cost model's candidates; "
              f"no predicted comm", flush=True)
        return None
    return cm_free.evaluate(p.assignment).step_time


def _ranking(rows) -> str:
    """How the measured ranking compares with the predicted one, in a few words."""
    swapped = _swapped(rows)
    if not swapped:
        return "same, up to ties" if _ties(rows) else "same"
    wrong = sum(not noise for _, _, noise in swapped)
    if not wrong:
        return f"{len(swapped)} pair(s) swapped within noise"
    return f"{wrong} pair(s) wrong" + (f", {len(swapped) - wrong} within noise"
                                       if wrong < len(swapped) else "")


def summary(runs) -> list[str]:
    """One row per run: the setting, ``auto`` against ``dp`` and the best measured SPMD baseline,
    the ranking, and how close the predictions came (issue 13's three targets)."""
    lines = ["## Summary", "",
             "One row per section below. Cores: each process on cores of its own (`pinned`) or "
             "more processes or devices than cores (`shared`: the measurement then includes the "
             "contention). Targets (issue 13): `auto` at least 1.2x `dp` and the best measured "
             "SPMD baseline; the measured ranking the predicted one; plans whose predicted "
             "communication is over half their step within 30% of their prediction.", "",
             "| setting | model | cores | `auto`'s plan | `auto` vs `dp` | `auto` vs best SPMD | "
             "ranking | communication-bound within 30% | measured / predicted, all plans |",
             "|---|---|---|---|---:|---:|---|---:|---:|"]
    for res in runs:
        rows = res["rows"]
        by = {r["strategy"]: r for r in rows}
        if "auto" not in by:
            continue
        a = by["auto"]["measured_step"]
        spmd = [r for r in rows if r.get("plan", "SPMD") == "SPMD"
                and r["strategy"] not in ("auto", "ilp", "pipeline")]
        best = min(spmd, key=lambda r: r["measured_step"]) if spmd else None
        bound = [r for r in rows if (r["predicted_comm"] or 0.0) > 0.5 * r["predicted_step"]]
        ok = sum(abs(r["measured_step"] / r["predicted_step"] - 1) <= 0.3 for r in bound)
        ratios = [r["measured_step"] / r["predicted_step"] for r in rows]
        processes = res["regions"]
        devices = processes * res["devices_per_region"]
        cores = "pinned" if _pinned(res) else (
            f"shared ({processes} processes, {devices} devices on {res['cpus']} cores)")
        model = f"`{res['model']}`" + "".join(
            f", {k} {v}" for k, v in (res.get("overrides") or {}).items() if k != "batch")
        vs_dp = f"{by['dp']['measured_step'] / a:.2f}x" if "dp" in by else "-"
        vs_best = (f"{best['measured_step'] / a:.2f}x (`{best['strategy']}`; predicted "
                   f"{best['predicted_step'] / by['auto']['predicted_step']:.2f}x)"
                   if best else "-")
        lines.append(
            f"| {res['regions']} x {res['devices_per_region']}, "
            f"{'/'.join(f'{r:g}' for r in res['rates_mbit'])} Mbit/s | {model} | "
            f"{cores} | {by['auto'].get('plan', 'SPMD')} | {vs_dp} | {vs_best} | "
            f"{_ranking(rows)} | {ok}/{len(bound)} | {min(ratios):.2f}-{max(ratios):.2f} |")
    return lines + [""]


def _pinned(res) -> bool:
    """Whether every process of a run had cores of its own (none shared with another)."""
    return bool(res.get("pinning")) and res["regions"] * res["devices_per_region"] <= res["cpus"]


def _targets(rows, shared: bool = False) -> list[str]:
    """Issue 13's targets on this run: hulkjax's plan (``auto``) against ``dp`` and the best
    measured SPMD baseline (the issue's target), and against the best measured baseline of all
    (``pipeline`` included); predicted against measured step time where communication dominates
    the prediction."""
    by = {r["strategy"]: r for r in rows}
    out = []
    baselines = [r for r in rows if r["strategy"] not in ("auto", "ilp")]
    spmd = [r for r in baselines if r.get("plan", "SPMD") == "SPMD" and r["strategy"] != "pipeline"]
    if "auto" in by and baselines:
        a = by["auto"]["measured_step"]
        parts = [f"{by['dp']['measured_step'] / a:.2f}x `dp`"] if "dp" in by else []
        for label, pool in (("SPMD baseline", spmd), ("baseline of all", baselines)):
            if pool:
                best = min(pool, key=lambda r: r["measured_step"])
                parts.append(f"{best['measured_step'] / a:.2f}x the best measured {label} "
                             f"(`{best['strategy']}`)")
        out.append(f"`auto` measured: {', '.join(parts)}; target 1.2x `dp` and the best SPMD "
                   f"baseline.")
        if spmd:
            # The model's own ratio against the same baseline: where the measured one is far
            # larger on shared cores, the cores explain it (a plan that leaves processes idle
            # gives the busy ones more of the machine), not the network.
            best = min(spmd, key=lambda r: r["measured_step"])
            ratio = best["predicted_step"] / by["auto"]["predicted_step"]
            out.append(f"Predicted: {ratio:.2f}x `{best['strategy']}`"
                       + ("." if not shared else
                          "; on shared cores a plan's speed depends on how many processes "
                          "compute at once, so a measured ratio far above this one is the "
                          "cores', not the network's."))
    bound = [r for r in rows if (r["predicted_comm"] or 0.0) > 0.5 * r["predicted_step"]]
    if bound:
        ok = [r for r in bound if abs(r["measured_step"] / r["predicted_step"] - 1) <= 0.3]
        ratios = ", ".join(f"{r['strategy']} {r['measured_step'] / r['predicted_step']:.2f}"
                           for r in bound)
        out.append(f"Communication-bound plans (predicted comm > half the predicted step): "
                   f"{len(ok)}/{len(bound)} measured within 30% of the prediction "
                   f"(measured / predicted: {ratios}).")
    return [""] + out if out else []


def _rank(rows, key):
    return [r["strategy"] for r in sorted(rows, key=lambda r: r[key])]


def _quartiles(r) -> tuple[float, float]:
    """25th and 75th percentile (s) of a row's shaped steps after the first, slowest process."""
    per_step = [max(ts) for ts in zip(*r["step_times"])][1:]
    return float(np.percentile(per_step, 25)), float(np.percentile(per_step, 75))


def _swapped(rows) -> list[tuple[dict, dict, bool]]:
    """Pairs the measurement orders the other way round from the prediction: ``(faster
    predicted, faster measured, within noise)``, within noise where their step quartile ranges
    overlap (the run-to-run spread cannot tell them apart)."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if (a["predicted_step"] - b["predicted_step"]) * \
                    (a["measured_step"] - b["measured_step"]) < 0:
                first, second = (a, b) if a["predicted_step"] < b["predicted_step"] else (b, a)
                (lo1, hi1), (lo2, hi2) = _quartiles(first), _quartiles(second)
                out.append((first, second, lo1 <= hi2 and lo2 <= hi1))
    return out


def _ties(rows) -> list[tuple[str, str]]:
    """Pairs of strategies whose predicted steps are equal (to 1e-9 relative)."""
    return [(a["strategy"], b["strategy"]) for i, a in enumerate(rows) for b in rows[i + 1:]
            if abs(a["predicted_step"] - b["predicted_step"])
            <= 1e-9 * max(a["predicted_step"], b["predicted_step"])]


def markdown(res: dict) -> str:
    cal = res["calibration"]
    lines = [
        f"## {res['regions']} regions x {res['devices_per_region']} devices, "
        f"{', '.join(f'{r:g}' for r in res['rates_mbit'])} Mbit/s, `{res['model']}`", "",
        f"Generated by `{res['command']}` on {res['date']} ({res['cpus']} CPU cores, jax "
        f"{res['jax']}, {res['wall_time']:.0f} s). {res['regions']} regions (one network namespace"
        f" and one JAX process each, {res['devices_per_region']} fake CPU device(s) per process), "
        f"uplinks shaped with `tc tbf` at {', '.join(f'{r:g}' for r in res['rates_mbit'])} Mbit/s "
        f"(burst {res['tbf_burst']}), model `{res['model']}` ({_model_config(res)}), "
        f"{res['steps']} steps per plan "
        f"(median of the steps after the first, slowest process).", "",
        f"**Latency is modelled, not emulated**: `netem` is not available, so the links add only "
        f"the veth round trip ({res['rtt'] * 1e6:.0f} us measured, TCP 1-byte ping-pong)"
        + (f". The topology's latency per ring step between regions is "
           f"{res['wan_latency'] * 1e6:.0f} us (calibrated, at least the round trip / 2), and "
           f"each collective call costs a further "
           f"{res['calibration']['device'].get('collective_overhead', 0.0) * 1e3:.2f} ms "
           f"(the calibrated `collective_overhead`: gloo's fixed cost per call, which XLA:CPU "
           f"pays once per operand of a combined all-reduce)"
           if "wan_latency" in res else ", which is the latency the topology uses")
        + f". TCP goodput region 0 -> 1: {res['tcp_goodput'] / 1e6:.3g} MB/s.", "",
        f"Calibrated (`hulkjax.launch.calibrate` in the namespaces): "
        f"{cal['device']['peak_flops'] / 1e9:.3g} GFLOP/s and "
        f"{cal['device']['hbm_bandwidth'] / 1e9:.3g} GB/s per device with every device busy"
        + (f" (in place), {pt * 1e6:.3g} us per fresh 4 KiB page (`DeviceSpec.fresh_page_time`: "
           f"the temporaries XLA:CPU allocates afresh on every program call above 32 MiB)"
           if (pt := cal['device'].get('fresh_page_time')) else "") + "; "
        f"gloo all-reduce between regions {cal['link']['bandwidth'] / 1e6:.3g} MB/s, "
        f"{cal['link']['latency'] * 1e6:.0f} us (nominal tbf rate "
        f"{res['link_nominal'] / 1e6:.3g} MB/s)"
        + (f"; a receive costs the receiving core's compute {ro['share']:.2f} of its link time "
           f"(`benchmarks/wan/transfer_time.py`'s `receive_share`: a matmul chain "
           f"{ro['chain_small'] * 1e3:.0f} ms beside 4 kB receives, {ro['chain_big'] * 1e3:.0f} "
           f"ms beside 2 MB ones taking {ro['receive_big'] * 1e3:.0f} ms; `DeviceSpec."
           f"receive_overhead`, charged to staged plans' receiving stages)"
           if (ro := cal.get("receive_overhead")) else "")
        + ". Plans and predictions use the calibrated numbers (`benchmarks/wan/topology.json`).",
        "",
        (f"**Cores**: each region's process runs on cores of its own (`taskset`: "
         f"{'; '.join(f'region {i}: {c}' for i, c in enumerate(res['pinning']))}), so a "
         f"device computes at the calibrated rate whatever the others do"
         + (f" (5-minute load average when the run ended: {la:.1f} on {res['cpus']} cores"
            + (f", above the {res['regions']} processes: other jobs shared the pinned cores and "
               f"slowed the measurements" if la > res["regions"] + 0.5 else "") + ")"
            if (la := res.get("load_average")) is not None else "")
         + "." if res.get("pinning")
         else f"**Cores**: {res['cpus']} cores for {res['regions']} processes, not pinned"
              f"{'' if 'pinning' in res else ' (runs before pinning existed)'}: a device "
              f"computes faster while the others wait than while they compute, so its speed "
              f"depends on the plan."), "",
        *([f"**More fake devices than cores**: {res['regions'] * res['devices_per_region']} "
           f"devices on {res['cpus']} cores: a process's devices share its core, and the "
           f"calibration measures them so (every device busy)."
           + (" Runs of this setting before 2026-11-28 measured plans with collectives inside a "
              "process 10-75x slower than predicted, which their notes put down to the "
              "oversubscription; the cause was the fixed cost of each gloo call (the "
              "`collective_overhead` above), which XLA:CPU pays once per operand of a combined "
              "all-reduce and the model did not charge: a 2 ms `auto` plan with one 40-operand "
              "all-reduce between a process's devices measured 155 ms."
              if "wan_latency" in res else
              " Plans whose program has collectives between the devices of one process ran far "
              "slower than this run's model predicted: it did not charge the fixed cost of each "
              "gloo call, which XLA:CPU pays once per operand of a combined all-reduce (runs "
              "from 2026-11-28 on do)."), ""]
          if res["regions"] * res["devices_per_region"] > res["cpus"]
          and res["devices_per_region"] > 1 else []),
        "Step quartiles: 25th-75th percentile of the shaped steps after the first (slowest "
        "process), to show the run-to-run noise. "
        "Measured comm = step shaped - step unshaped (same programs); a plan whose compiled "
        "program has no collective between regions and sends no value between them shows '-' (its "
        "processes do not wait for each other, and the difference is noise). "
        + ("Predicted comm, likewise = predicted step - the same plan's predicted step with the "
           "links between regions 1000x faster: collectives between regions, and a staged "
           "plan's transfers where they stall its stages." if all(
               "predicted_collectives" in r for r in res["rows"]) else
           "Predicted comm = the plan's predicted collective time (a run from before "
           "2026-11-27: a staged plan's exposed transfers are not in it)."),
        "",
        "| strategy | plan | predicted step | measured step | step quartiles | measured / predicted | "
        "predicted comm | measured comm | measured / predicted comm | predicted step (nominal "
        "link) | unshaped step | matches unsharded |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for r in res["rows"]:
        pc = r["predicted_comm"]
        nom = r["predicted_step_nominal_link"]
        crosses = r.get("crosses_regions", True)
        mc = f"{r['measured_comm'] * 1e3:.1f} ms" if crosses else "-"
        ratio = f"{r['measured_comm'] / pc:.2f}" if crosses and pc and pc > 1e-6 else "-"
        q1, q3 = (q * 1e3 for q in _quartiles(r))
        lines.append(
            f"| {r['strategy']} | {r.get('plan', 'SPMD')} | {r['predicted_step'] * 1e3:.1f} ms | "
            f"{r['measured_step'] * 1e3:.1f} ms | {q1:.0f}-{q3:.0f} ms | "
            f"{r['measured_step'] / r['predicted_step']:.2f} | "
            f"{'-' if pc is None else f'{pc * 1e3:.1f} ms'} | {mc} | {ratio} | "
            f"{'-' if nom is None else f'{nom * 1e3:.1f} ms'} | "
            f"{r['measured_step_unshaped'] * 1e3:.1f} ms | "
            f"{'yes' if r['check'] else 'NO' if r['check'] is False else '-'} |")
    rows = res["rows"]
    if rows:
        swapped = _swapped(rows)
        ties = _ties(rows)
        # The same ranking: no pair measured in the other order than predicted (plans predicted
        # equal, e.g. two strategies that chose the same plan, may measure in either order).
        same = "the same" if not swapped else "not the same"
        if ties and not swapped:
            same += (" up to the plans predicted equal: "
                     + ", ".join(f"{a} = {b}" for a, b in ties))
        lines += ["", f"Ranking by predicted step: {' < '.join(_rank(rows, 'predicted_step'))}; "
                      f"by measured step: {' < '.join(_rank(rows, 'measured_step'))} "
                      f"({same})."]
        if swapped:
            noise = [x for x in swapped if x[2]]
            lines[-1] += (
                f" Pairs ordered the other way round: "
                f"{', '.join(a['strategy'] + ' / ' + b['strategy'] for a, b, _ in swapped)}; "
                f"{len(noise)} of {len(swapped)} within the run-to-run noise (their step "
                f"quartile ranges overlap)"
                + ("." if len(noise) == len(swapped) else
                   f", {len(swapped) - len(noise)} not: a ranking the model gets wrong."))
        lines += _targets(rows, shared=not _pinned(res))
    lines += ["", f"Left behind after teardown: {res['left_behind'] or 'nothing'} "
                  f"(namespaces, and with them links, the bridge and qdiscs).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
