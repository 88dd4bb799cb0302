"""Imported last by the fork server (forks.PRELOAD), once it has imported the engine's
modules: the parent watch of `fork_guard` is stopped (no thread runs when it forks), and
everything alive then is frozen out of the cyclic garbage collector, so the engine
processes it forks never walk those objects. A walk writes to every object it visits,
and each page it writes to is copied into the child that wrote it (fork's copy-on-write):
the first collection in an engine process copied most of torch's and transformers'
Python objects. What the Python documentation advises for a parent that forks
(`gc.freeze`)."""

import gc

from consumers.inference.runners import fork_guard

fork_guard.done.set()
fork_guard.watcher.join()
gc.collect()
gc.freeze()
