"""A stage worker: the loop of one stage, in a process of its own.

The local launcher starts it as ``python -c ... main(spec_path)``; other launchers (the
Ray backend) call :func:`serve` with the spec inside a process they started.

Two threads and what joins them; :mod:`~omni_core.worker.process` builds them and hands
each part only what it uses (none of them imports it):

* :mod:`~omni_core.worker.io_thread` -- the I/O thread. It owns the sockets: applies
  control messages at once (cancel, slot releases, shutdown) even while the stage
  computes, takes in upstream events, sends what the stage emitted, and heartbeats the
  stage thread's progress.
* :mod:`~omni_core.worker.work_queue` -- the bounded work queue between them: upstream
  messages become work items only while it has room, so a slow stage pushes back on its
  producers.
* :mod:`~omni_core.worker.stage_thread` -- the stage thread, the busy loop: take a batch, run
  the stage's generator, hand each output over; it checks cancellation between yields and
  is the only thread that calls into the stage.
* :mod:`~omni_core.worker.state` -- what the two threads share: the lock and the stage
  host it guards, the shutdown flags, the progress the heartbeats report.

The stage host (:mod:`~omni_core.worker.host`, :mod:`~omni_core.worker.stage_output`)
turns upstream events into the stage's inputs and its outputs into stamped events;
:mod:`~omni_core.worker.devices` says which GPUs a worker sees (where its models go is
:mod:`omni_core.placement`).
"""

from omni_core.worker.process import Worker, WorkerSpec, main, serve

__all__ = ["Worker", "WorkerSpec", "main", "serve"]
