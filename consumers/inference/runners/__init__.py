"""What steps a model's engine for the worker: a thread beside the event loop
(`thread.py`) or a child process forked from a fork server (`process.py`, `forks.py`),
with the step figures the runners measure (`figures.py`, `probes.py`) and the threads
sized to the machine's load (`cores.py`)."""
