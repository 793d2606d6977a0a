"""A stage worker: the loop of one stage, in a process of its own.

The local launcher starts it as ``python -c ... main(spec_path)``; other launchers (the
Ray backend) call :func:`serve` with the spec inside a process they started.

Two threads, three parts:

* :mod:`~omni_core.worker.control_io` -- the I/O thread. It owns the sockets: applies
  control messages at once (cancel, slot releases, shutdown) even while the stage
  computes, takes in upstream events, sends what the stage emitted, and heartbeats the
  stage thread's progress.
* :mod:`~omni_core.worker.admission` -- the bounded work queue between them: upstream
  messages become work items only while it has room, so a slow stage pushes back on its
  producers.
* :mod:`~omni_core.worker.scheduler` -- the stage thread, the busy loop: take a batch, run
  the stage's generator, hand each output over; it checks cancellation between yields and
  is the only thread that calls into the stage.
"""

from omni_core.worker.process import Worker, WorkerSpec, main, serve

__all__ = ["Worker", "WorkerSpec", "main", "serve"]
