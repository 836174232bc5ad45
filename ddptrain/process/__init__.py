"""How ranks start, stop and report hangs.

- started: how this process was started (torchrun, a scheduler, self-launch): rank facts and where to meet
- self_launch: what a self-launch sets up around elastic's agent (store socket, workers' environment, launch config)
- signals: SIGTERM / Ctrl-C stop at the next step boundary and save; the exit codes that say so
- hangs: the hang watchdog: each rank's phase, stacks of a stuck rank, the report of a timed-out collective
- forkserver: each rank (and each restart) a fork of one process that imported the libraries once
- cpus: the cores this process may use (threads per rank, CPU pinning)
- memory: what the C library does with freed memory (back to the system on request: plan.cpu_returns_freed_memory)
"""
