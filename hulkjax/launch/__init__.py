"""Run a planned step as a real multi-process JAX job: one process per node (or region) of the topology.

Where this sits::

    hulkjax launch / launch(...)          the parent: traces and plans ONCE (so every process runs
            |                             the identical plan), writes plan-<strategy>.json and
            |                             job.json to the run directory, spawns the workers
            v
    python -m hulkjax.launch worker       one per process (or `hulkjax launch --coordinator ...` on
            |                             each host of a real cluster): jax.distributed.initialize,
            |                             Plan.load, emit over the GLOBAL devices, N timed steps
            |                             (a staged plan: each process runs its own stages' programs,
            |                             values between stages cross with cross-host device_put)
            v
    report.json (written by process 0)    plan and predicted cost, measured step times, losses,
                                          the collectives of the compiled multi-process program,
                                          and a numerical check against the unsharded step

The pieces: which devices each process holds (:mod:`~hulkjax.launch.layout`), the job record
(:mod:`~hulkjax.launch.job`), global inputs and the numerical check (:mod:`~hulkjax.launch.arrays`),
one process's run (:mod:`~hulkjax.launch.worker`) and the local launcher
(:mod:`~hulkjax.launch.launcher`).

>>> import hulkjax as hj
>>> from hulkjax.launch import process_layout
>>> process_layout(hj.Topology.preset("hetero"), 2).level
'node'
"""

from hulkjax.launch.arrays import SAFETY as SAFETY
from hulkjax.launch.arrays import to_global as to_global
from hulkjax.launch.arrays import tree_error as tree_error
from hulkjax.launch.arrays import tree_spread as tree_spread
from hulkjax.launch.job import REPORT_FORMAT as REPORT_FORMAT
from hulkjax.launch.job import Job as Job
from hulkjax.launch.launcher import launch as launch
from hulkjax.launch.layout import ProcessLayout as ProcessLayout
from hulkjax.launch.layout import ordered_devices as ordered_devices
from hulkjax.launch.layout import process_layout as process_layout
from hulkjax.launch.worker import check_against_unsharded as check_against_unsharded
from hulkjax.launch.worker import run_worker as run_worker
