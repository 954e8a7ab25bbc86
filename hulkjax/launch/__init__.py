"""Run a planned step as a real multi-process JAX job: one process per node (or region) of the topology.

Where this sits::

    hulkjax launch / launch(...)          the parent: traces and plans ONCE (so every process runs
            |                             the identical plan), writes plan-<strategy>.json and
            |                             job.json to the run directory, spawns the workers
            v
    python -m hulkjax.launch worker       one per process (or `hulkjax launch --coordinator ...` on
            |                             each host of a real cluster): jax.distributed.initialize,
            |                             Plan.load, emit over the GLOBAL devices, N timed steps
            v
    report.json (written by process 0)    plan and predicted cost, measured step times, losses,
                                          the collectives of the compiled multi-process program,
                                          and a numerical check against the unsharded step

Processes map onto the topology's hierarchy: with ``P`` processes of ``L`` local devices each
(``P * L == topology.num_devices``), process ``p`` holds topology devices ``p*L .. (p+1)*L - 1``.
Topology devices are ordered region > node > device, so that block is whole nodes (one process per
node, or per region); a layout that would split a node across processes is refused. The mesh is the
device order reshaped row-major (:meth:`Topology.mesh`), so the mesh axes along which the process
index changes are the ones whose collectives cross process boundaries (gloo over TCP on CPU).

Inputs become global ``jax.Array`` s with :func:`to_global`: every process computes the same host
value (zoo models from the seed) and fills only its own shards (``jax.make_array_from_callback``),
so no input crosses the network. Results are gathered with ``multihost_utils.process_allgather``.

>>> import hulkjax as hj
>>> from hulkjax.launch import process_layout
>>> layout = process_layout(hj.Topology.grid((2, 2), ("proc", "dev")), 2)
>>> layout.blocks, layout.process_axes, layout.local_axes
(((0, 1), (2, 3)), ('proc',), ('dev',))
"""

from hulkjax.launch.arrays import to_global as to_global
from hulkjax.launch.arrays import tree_error as tree_error
from hulkjax.launch.job import REPORT_FORMAT as REPORT_FORMAT
from hulkjax.launch.job import Job as Job
from hulkjax.launch.launcher import launch as launch
from hulkjax.launch.layout import ProcessLayout as ProcessLayout
from hulkjax.launch.layout import ordered_devices as ordered_devices
from hulkjax.launch.layout import process_layout as process_layout
from hulkjax.launch.worker import run_worker as run_worker
