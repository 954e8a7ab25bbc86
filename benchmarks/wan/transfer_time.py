"""How long one value takes from one JAX process to another through cross-host
``jax.device_put`` (the path a staged step's sends take, :mod:`hulkjax.emit.transfer`), on
loopback or between two of the WAN testbed's shaped network namespaces.

    python benchmarks/wan/transfer_time.py                 # loopback, unshaped
    sudo python benchmarks/wan/transfer_time.py --rate 100 # two namespaces, tbf at 100 Mbit/s

Per size and *gap*, 12 one-way sends from process 0's device to process 1's: both processes meet
at a barrier, the receiver posts its ``device_put`` at once (the bytes are pulled: it waits for
the sender), the sender waits ``gap`` ms (the compute between a staged step's sends, during which
the link idles) and sends; the time is from the sender's ``device_put`` to the value being ready
on the receiver (one machine, one monotonic clock). The median of the last 10 is printed, with
the link's alpha-beta time (the RTT / 2 plus the bytes at the TCP goodput ``Regions.probe``
measures) where the link is shaped. Nothing is written; nothing here is a timed test.

``--mode`` puts compute beside the send (a chain of 1024 x 1024 matmuls, about 0.3 s on one
core): ``busy`` on both processes, ``busy0`` / ``busy1`` on the sender / the receiver only,
dispatched before the send; ``after0`` on the sender, dispatched right after the send; ``both``
sends a value of the same size back at the same time instead. What it showed (2026-11-27, two
namespaces at 100 Mbit/s, one core each): alone, a send takes the link's alpha-beta time, idle
gaps included; the receiver computing does not delay it; **the sender's queued compute does**:
with the chain dispatched before the send, every send lands when the chain ends (4 kB: 254 ms),
with or without ``move``'s copy (a plain ``jax.device_put`` too); dispatched after the send, the
send still waits for the chain when the receiver asks after the chain was dispatched (no gap
before the send: 262-435 ms) and goes at once when the receiver was already waiting (a 100 ms
gap: 0.84-176 ms, the alpha-beta time). XLA:CPU reads a cross-host send from the device in its
queue order at the time both ends have posted it. And a receive costs the receiving core
compute: ``busy1`` printed the receiver's chain at 264-267 ms beside 4 kB sends, 268-278 ms
beside 512 kB ones (a 45 ms transfer) and 313-332 ms beside 2 MB ones (177 ms; two runs): up to
a quarter to a third of the transfer's time is lost to the device's compute when one core runs
both.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SIZES = (4096, 131072, 524288, 2097152)
GAPS_MS = (0, 100)
REPEAT = 12


def worker(pid: int, coordinator: str, host: str, out: str, mode: str = "plain",
           sizes=SIZES, gaps=GAPS_MS) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    sys.path.insert(0, ROOT)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hulkjax.emit import transfer

    jax.config.update("jax_platforms", "cpu")
    transfer.enable(host)
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid)
    devs = jax.devices()
    at = [NamedSharding(Mesh(np.array([d]), ("a",)), P()) for d in devs[:2]]
    stamps, chains = [], []  # chains: (size, seconds) of each matmul chain run beside a send
    # "busy": both processes compute (a chain of 1024 x 1024 matmuls, about 0.3 s) while the
    # value crosses, as a staged step's stages do; "both": process 1 sends a value of the same
    # size back at the same time (1F1B's activations one way, gradients the other).
    mine = at[pid]
    w = jax.device_put(np.full((1024, 1024), 1e-3, np.float32), mine)
    chain = jax.jit(lambda a: jax.lax.fori_loop(0, 30, lambda i, b: b @ a, a))
    chain(w).block_until_ready()
    for nbytes in sizes:
        n = nbytes // 4
        x = jax.device_put(np.ones(n, np.float32), at[0]).block_until_ready() if pid == 0 \
            else transfer.placeholder((n,), np.float32, at[0])
        back = jax.device_put(np.ones(n, np.float32), at[1]).block_until_ready() if pid == 1 \
            else transfer.placeholder((n,), np.float32, at[1])
        for gap in gaps:
            for _ in range(REPEAT):
                transfer.settle(())
                c0 = time.perf_counter()
                busy = chain(w) if mode == "busy" or mode == f"busy{pid}" else None
                if pid == 0:
                    time.sleep(gap / 1e3)
                    stamps.append(time.perf_counter())
                    transfer.move(x, at[1])
                    if mode == "after0":  # the sender's next program, dispatched after the send
                        busy = chain(w)
                    if mode == "both":
                        transfer.move(back, at[0])
                else:
                    if mode == "both":
                        time.sleep(gap / 1e3)
                    y = transfer.move(x, at[1])
                    if mode == "both":
                        transfer.move(back, at[0])
                    y.block_until_ready()
                    stamps.append(time.perf_counter())
                if busy is not None:
                    busy.block_until_ready()
                    chains.append((nbytes, time.perf_counter() - c0))
    transfer.settle(())
    with open(out, "w") as f:
        json.dump({"stamps": stamps, "chains": chains}, f)


def _table(sent, got, alpha_beta=None) -> str:
    rows = ["| size | gap | one-way (median) |" + (" alpha-beta |" if alpha_beta else ""),
            "|---:|---:|---:|" + ("---:|" if alpha_beta else "")]
    i = 0
    for nbytes in SIZES:
        for gap in GAPS_MS:
            dt = sorted(b - a for a, b in zip(sent[i + 2:i + REPEAT], got[i + 2:i + REPEAT]))
            i += REPEAT
            row = f"| {nbytes:,} B | {gap} ms | {dt[len(dt) // 2] * 1e3:.2f} ms |"
            if alpha_beta:
                row += f" {alpha_beta(nbytes) * 1e3:.2f} ms |"
            rows.append(row)
    return "\n".join(rows)


def run_pair(mode: str, net=None, sizes=SIZES, gaps=GAPS_MS) -> list[dict]:
    """Both processes' records (``{"stamps", "chains"}``): on loopback, or in regions 0 and 1
    of ``net`` (a :class:`testbed.Regions`, shaped as it is)."""
    import socket

    tmp = tempfile.mkdtemp(prefix="hulkjax-xfer-")
    outs = [os.path.join(tmp, f"p{i}.json") for i in range(2)]
    tail = [",".join(map(str, sizes)), ",".join(map(str, gaps))]
    me = [sys.executable, os.path.abspath(__file__), "--worker", mode]
    if net is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        coord = f"127.0.0.1:{port}"
        cmds = [[*me, str(i), coord, "127.0.0.1", outs[i], *tail] for i in range(2)]
    else:
        coord = f"{net.ip[0]}:23571"
        cmds = [[*net.prefix(i), *me, str(i), coord, net.ip[i], outs[i], *tail] for i in range(2)]
    procs = [subprocess.Popen(c) for c in cmds]
    for p in procs:
        p.wait(timeout=600)
    return [json.load(open(o)) for o in outs]


def receive_share(net=None) -> dict:
    """The share of a receive's time that the receiving process's compute loses (the
    ``DeviceSpec.receive_overhead`` of a device that computes on the cores the process receives
    on): a matmul chain on the receiver beside 4 kB and beside 2 MB receives, the difference
    over the 2 MB receive's time, clipped to [0, 1]. Returns the share and what it read."""
    big = 2 << 20
    res = run_pair("busy1", net, sizes=(4096, big), gaps=(0,))
    by: dict[int, list[float]] = {}
    for nbytes, dt in res[1]["chains"]:
        by.setdefault(nbytes, []).append(dt)
    chain = {n: sorted(d)[len(d) // 2] for n, d in by.items()}
    sent, got = res[0]["stamps"], res[1]["stamps"]
    dt = sorted(b - a for a, b in zip(sent[REPEAT + 2:], got[REPEAT + 2:]))
    receive = dt[len(dt) // 2]
    share = min(max((chain[big] - chain[4096]) / receive, 0.0), 1.0)
    return {"share": share, "chain_small": chain[4096], "chain_big": chain[big],
            "receive_big": receive, "bytes_big": big}


def main(argv=None) -> int:

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=None,
                    help="Mbit/s: run in two shaped network namespaces (root)")
    ap.add_argument("--mode", choices=("plain", "busy", "busy0", "busy1", "after0", "both"),
                    default="plain",
                    help="busy: both processes compute meanwhile (busy0 / busy1: the sender / "
                         "the receiver only; after0: the sender computes after dispatching the send); both: "
                         "a value goes back at the same time")
    args = ap.parse_args(argv)
    if args.rate is None:
        res = run_pair(args.mode)
        alpha_beta = None
    else:
        sys.path.insert(0, HERE)
        from testbed import Regions

        with Regions([args.rate, args.rate], tag="xf") as net:
            net.shape(True)
            rtt, goodput = net.probe()
            res = run_pair(args.mode, net)
        print(f"shaped at {args.rate:g} Mbit/s: RTT {rtt * 1e6:.0f} us, TCP goodput "
              f"{goodput / 1e6:.3g} MB/s")
        alpha_beta = lambda b: rtt / 2 + b / goodput  # noqa: E731
    print(_table(res[0]["stamps"], res[1]["stamps"], alpha_beta))
    for i, r in enumerate(res):  # the compute beside the sends: how long its chain took
        if r["chains"]:
            by: dict[int, list[float]] = {}
            for nbytes, dt in r["chains"]:
                by.setdefault(nbytes, []).append(dt)
            print(f"process {i}'s matmul chain beside the sends (median): " + ", ".join(
                f"{n:,} B: {sorted(d)[len(d) // 2] * 1e3:.1f} ms" for n, d in by.items()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "--worker":
        worker(int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], mode=sys.argv[2],
               sizes=tuple(map(int, sys.argv[7].split(","))),
               gaps=tuple(map(float, sys.argv[8].split(","))))
    else:
        raise SystemExit(main())
