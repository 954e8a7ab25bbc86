"""Python's cyclic garbage collector, paused while hulkjax traces and plans.

A leaf module (it imports nothing from hulkjax). Tracing and planning allocate millions of small
objects that live as long as the graph and its cost model (values, nodes, candidate tables, memo
entries) and make few reference cycles. The cyclic collector does not know that: every full
collection walks every object of the process, and planning GPT-2 small allocates enough to set off
about ten of them, about 20% of ``auto``'s CPU time (and of a trace's). Reference counting still
frees everything that is not in a cycle; the cycles made meanwhile (a JAX trace's tracers) are
collected by one young collection when the outermost pause ends, as the collector would have
found them. A process that has disabled the collector itself keeps it disabled.

>>> import gc
>>> with collector_paused():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # pauses open (nested, or in several threads); the collector resumes when none is
_resume = False  # whether the outermost pause found the collector enabled


@contextlib.contextmanager
def collector_paused():
    """Pause automatic cyclic garbage collection for the ``with`` block (reentrant, thread-safe:
    the collector resumes when the last open pause ends, if it was enabled at the first)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            resume = _depth == 0 and _resume
            if resume:
                gc.enable()
        if resume:
            gc.collect(0)  # the cycles made while paused, at the cost of one young collection
