"""Async scheduling: the engine's steps with up to two in flight (`--async-scheduling`).

```
engine thread:  schedule N+1, submit | wait N | commit N, outputs N | schedule N+2, submit | wait N+1 ...
worker thread:  ....... forward N ..........| forward N+1 ..........................| forward N+2
```

Step N+1 is scheduled while step N's forward runs, as if each request's step-N token were
known (`Request.num_output_placeholders`); the runner feeds that token from its own input
batch, so it never makes a round trip through the scheduler. Step N's commit, its output
processing (detokenization, stop strings) and the scheduling of step N+2 then run while
step N+1's forward does. The worker runs the steps in order (worker/step_thread.py), which
is what keeps the scheduler's block accounting, one step ahead of the forward, exact (see
core/scheduler.py). A request that stops at step N (eos, stop string, abort) was already
given step N+1: that token is dropped at N+1's commit and the request's blocks are freed
at N's (never registered in the prefix cache: registration waits for the step that wrote
a block).

Chosen over a runner that overlaps its own input preparation: the host work between two
forwards on the engine side (schedule, commit, detokenize) is the larger part, and it is
all overlapped here without a second copy of the scheduler's state. Not combined with
speculative decoding (refused at start): step N+1's drafts come from step N's tokens.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from pagoda.core.scheduler import Scheduler
from pagoda.core.scheduler_output import SchedulerOutput
from pagoda.engine.sigint import sigint_deferred
from pagoda.worker.executor import Executor
from pagoda.worker.model_runner import ModelRunnerOutput

# NOTE: two: one step runs while the next is scheduled and waits; a deeper queue would
# only schedule further on guesses (more dropped tokens) for no more overlap.
MAX_STEPS_IN_FLIGHT = 2


class StepPipeline:
    """The steps submitted and not yet committed, oldest first."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.in_flight: deque[tuple[SchedulerOutput, Future]] = deque()

    def next_result(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Schedule and submit steps until two are in flight (at least one; a second only
        while the scheduler has requests), then wait for the oldest one's result, for the
        caller to commit, taking it out with `pop_oldest()` in the same Ctrl-C hold (an
        interrupt between the two leaves the step to the next call). Raises what that step
        raised (then call `roll_back`)."""
        with sigint_deferred():
            while len(self.in_flight) < MAX_STEPS_IN_FLIGHT and (
                not self.in_flight or self.scheduler.has_unfinished_requests()
            ):
                sched_out = self.scheduler.schedule()
                self.in_flight.append((sched_out, self.executor.submit_model(sched_out)))
        sched_out, future = self.in_flight[0]
        return sched_out, future.result()

    def pop_oldest(self) -> None:
        """The oldest step is being committed: it is no longer in flight."""
        self.in_flight.popleft()

    def roll_back(self) -> list[str]:
        """After a failure: drop the steps that have not started and roll back every step
        in flight, newest first (`Scheduler.rollback_step`); returns their request ids."""
        self.executor.cancel_pending()
        failed: list[str] = []
        while self.in_flight:
            sched_out, _ = self.in_flight.pop()
            failed += self.scheduler.rollback_step(sched_out)
        return list(dict.fromkeys(failed))
