"""Round trips of a value between two JAX processes on loopback through cross-host
``jax.device_put`` (the path a staged step's sends take, :mod:`hulkjax.emit.transfer`), unshaped:
what one transfer costs beyond its bytes on the link.

    python benchmarks/wan/transfer_roundtrip.py            # starts both processes, prints a table

Each size is sent from process 0's device to process 1's and back, 12 times; the median of the
last 10 round trips is printed (milliseconds). Nothing is written; nothing here is a timed test.
"""

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SIZES = (4096, 65536, 524288, 2097152)


def worker(pid: int, port: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    sys.path.insert(0, ROOT)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from hulkjax.emit import transfer

    jax.config.update("jax_platforms", "cpu")
    transfer.enable("127.0.0.1")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    devs = jax.devices()
    at = [NamedSharding(Mesh(np.array([d]), ("a",)), P()) for d in devs[:2]]
    for nbytes in SIZES:
        n = nbytes // 4
        x = jax.device_put(np.ones(n, np.float32), at[0]) if pid == 0 else \
            transfer.placeholder((n,), np.float32, at[0])
        times = []
        for _ in range(12):
            transfer.settle(())
            t0 = time.perf_counter()
            y = transfer.move(x, at[1])
            z = transfer.move(y, at[0])
            (z if pid == 0 else y).block_until_ready()
            times.append(time.perf_counter() - t0)
        if pid == 0:
            rest = sorted(times[2:])
            print(f"| {nbytes:>9,} B | {rest[len(rest) // 2] * 1e3:7.2f} ms |", flush=True)
    transfer.settle(())


def main() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    other = subprocess.Popen([sys.executable, __file__, "--worker", "1", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("| size | round trip (median) |\n|---:|---:|", flush=True)
    try:
        worker(0, port)
    finally:
        other.wait(timeout=60)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(main())
