"""Python's cyclic garbage collector, paused while hulkjax traces and plans.

A leaf module (it imports nothing from hulkjax). Tracing and planning allocate millions of small
objects that live as long as the graph and its cost model (values, nodes, candidate tables, memo
entries) and make few reference cycles. The cyclic collector does not know that: every full
collection walks every object of the process, and planning GPT-2 small allocates enough to set off
about ten of them, about 20% of ``auto``'s CPU time (and of a trace's). Reference counting still
frees everything that is not in a cycle.

The cycles come from JAX's tracing (tracers, flax's module scopes: 8,895 objects when the staged
search traces an 8B LLaMA at a microbatch); planning makes none (``tests/test_heap.py`` holds it
so). A block that traces says so (``sweep=True``): the objects older than it are set aside
(``gc.freeze``) while it runs, and when it ends one young collection walks what it allocated
alone and frees its cycles. When the outermost pause ends, what it allocated is moved to the
oldest generation unwalked (``gc.freeze`` then ``gc.unfreeze``), as the collector moves what
survives its young collections: the young collection of everything a plan allocated that this
replaced walked two million objects to free none (0.4 s of an 8B LLaMA's 11 s plan). A cycle
made there anyway (by a rule or strategy of the user's) is not lost: the next full collection
frees it. The caller's young objects are collected when the outermost pause starts (a
collection of at most a few thousand objects). A process that has disabled the collector itself
keeps it disabled; one that has frozen objects itself (``gc.freeze``, before forking) keeps them
frozen, and its pauses end with one young collection instead.

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
_promote = False  # whether it ends by moving what it allocated to the oldest generation unwalked
_sweeping = False  # whether a sweeping block is open (they do not nest: the outer one sweeps)


@contextlib.contextmanager
def collector_paused(*, sweep: bool = False):
    """Pause automatic cyclic garbage collection for the ``with`` block (reentrant, thread-safe:
    the collector resumes when the last open pause ends, if it was enabled at the first).

    ``sweep``: the block makes reference cycles (it traces with JAX); they are collected when it
    ends, by a young collection of what it allocated alone (see the module docstring)."""
    global _depth, _resume, _promote, _sweeping
    with _lock:
        first = _depth == 0
        if first:
            _resume = gc.isenabled()
            _promote = _resume and gc.get_freeze_count() == 0
            gc.disable()
        _depth += 1
    if first and _promote:
        # The caller's young objects, as its collector would have (outside the lock: a
        # finalizer the collection runs may pause the collector too).
        gc.collect(1)
    with _lock:
        swept = sweep and _promote and not _sweeping
        if swept:
            _sweeping = True
            gc.freeze()  # what is older than the block: left out of its young collection
    try:
        yield
    finally:
        if swept:
            gc.collect(0)  # the block's cycles, walking what it allocated alone
            with _lock:
                gc.unfreeze()  # the older objects, back: to the oldest generation
                _sweeping = False
        with _lock:
            _depth -= 1
            resume = _depth == 0 and _resume
            promote = resume and _promote
            if resume:
                gc.enable()
        if promote:
            gc.freeze()  # what the pause allocated, unwalked: to the oldest generation
            gc.unfreeze()
        elif resume:
            gc.collect(0)  # frozen objects of the caller's own: one young collection
