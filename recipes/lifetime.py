"""A job's processes stop together: the launcher (the Hydra process), torch.distributed.run's
agent and the workers.

The preloaded agent runs in a session of its own (``agent.py``: a timeout ends it and its
forked workers with one ``killpg``), so the terminal's Ctrl-C, which goes to the foreground
process group, reaches only the launcher; and ``kill <pid>`` reaches only the process named.
So, as torchrun does for its workers:

- while a job runs, the launcher turns SIGINT and SIGTERM into a stop of the job
  (``stop_on_signals``): SIGTERM to the agent, whose own shutdown stops the workers; after
  ``GRACE_S`` whatever is left is killed; then the launcher stops the way the signal asks
  (KeyboardInterrupt for SIGINT, so a multirun ends there; SIGTERM's default action);
- the agent and every worker ask the kernel to signal them when their parent exits
  (``die_with_parent``, Linux's PR_SET_PDEATHSIG), so a launcher or agent killed outright
  (SIGKILL, the OOM killer) leaves nothing training;
- a worker ends at once on SIGTERM (``end_at_once_on_sigterm``), as an agent asking it to
  stop expects.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

GRACE_S = 15.0
"""Seconds the agent gets to stop its workers before everything left is killed: Lightning's
workers stop at the next batch boundary, the agent gives them 30 s by default."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits; if the parent
    (``parent``, when the caller knows it) is gone already, now. Linux only: elsewhere a no-op
    (there the launcher's signal forwarding still stops a job)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    orphaned = os.getppid() == 1 or (parent is not None and os.getppid() != parent)
    if orphaned:  # the parent died before the request was in place
        os.kill(os.getpid(), sig)


def leave_preemption_to_the_launcher() -> None:
    """Ignore SLURM's warning before a preemption or a time limit (``--signal=USR2@90``,
    which submitit asks for): it reaches every process of the job, and the job's launcher
    (submitit's handler, in the Hydra process) answers it by requeueing the job, which then
    resumes from its last checkpoint. By default the signal would kill the agent and the
    workers first, and an agent forked from the Hydra process would run the handler it
    inherited a second time. Ignored, it stays ignored across exec (the workers)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def end_at_once_on_sigterm() -> None:
    """Give SIGTERM back its default action (the process ends) in a worker.

    Lightning's handler (2.6) runs a ``broadcast`` inside the signal handler. The agent
    signals the workers one after another, so one rank can run that broadcast after its
    k-th collective and another after its (k+1)-th: the collectives pair wrongly and both
    ranks hang until the agent's 30 s kill (seen: stops of 18 and 30 s instead of 2). A
    recipe worker has nothing to finish on SIGTERM (checkpoints are written atomically and
    the agent asked it to stop), so it ends where it is. Call from the main thread after
    Lightning registered its handlers (each ``Trainer.fit``/``validate`` does)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def child_of(parent: int) -> None:
    """For ``preexec_fn``: die with ``parent``; leave preemption to the launcher."""
    die_with_parent(signal.SIGTERM, parent)
    leave_preemption_to_the_launcher()


class JobStop:
    """The signals received while a job runs, and when the first came."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.at: float | None = None

    def __bool__(self) -> bool:
        return bool(self.signals)

    def overdue(self) -> bool:
        return self.at is not None and time.monotonic() - self.at > GRACE_S

    def finish(self) -> None:
        """Stop this process as the first signal asks (after the job has stopped)."""
        if not self.signals:
            return
        print(f"stopped by {signal.Signals(self.signals[0]).name}: the job's agent and workers "
              "have ended", file=sys.stderr, flush=True)
        if self.signals[0] == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(self.signals[0], signal.SIG_DFL)
        os.kill(os.getpid(), self.signals[0])


@contextlib.contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[JobStop]:
    """Inside: SIGINT and SIGTERM call ``stop`` (at the first) instead of interrupting the
    wait for the job; the caller waits for the job to end (``JobStop.overdue``: kill it) and
    then calls ``JobStop.finish``. Outside the main thread (no signal handlers there): inert."""
    received = JobStop()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: object) -> None:
        if not received.signals:
            received.at = time.monotonic()
            stop()
        received.signals.append(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
