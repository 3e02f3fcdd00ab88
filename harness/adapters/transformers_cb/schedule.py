"""The manager entry point's schedule: arrivals and cancellations by step, not by wall clock.

The engine runs in its own thread, so adding or cancelling from the caller's thread would land at
whatever step the engine happens to be in, and a shrunk workload would not replay. `Schedule`
applies them from the observer's after-forward hook instead (in the engine's thread, between a
step's forward and its update), so step k's additions and cancellations take effect at step
k + 1 on every run.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from specaudit.adapters.transformers_cb.observer import CbObserver
from specaudit.adapters.transformers_cb.workload import CbWorkload


class Schedule:
    """Arrivals and cancellations by step, applied in the engine's thread after a step's forward;
    the caller's thread adds what is due when the engine has nothing left to run."""

    def __init__(self, manager: Any, observer: CbObserver, workload: CbWorkload) -> None:
        self.manager, self.observer, self.workload = manager, observer, workload
        self.due = sorted(workload.requests, key=lambda r: r.arrival)
        self.cancels = {r.id: r.abort for r in workload.requests if r.abort is not None}
        self.added: set[str] = set()
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()
        self.error: BaseException | None = None

    def add(self, steps: int, everything_due: bool = False) -> None:
        with self.lock:
            while self.due and (self.due[0].arrival <= steps or everything_due):
                r = self.due.pop(0)
                self.observer.submitted(r.id, r.prompt)
                self.manager.add_request(
                    list(r.prompt), request_id=r.id, max_new_tokens=r.max_new_tokens, eos_token_id=self._eos()
                )
                self.added.add(r.id)
                everything_due = everything_due and bool(self.due) and self.due[0].arrival == r.arrival

    def _eos(self) -> int:
        return -1 if self.workload.eos_token_id is None else self.workload.eos_token_id

    def after_step(self, steps: int) -> None:
        try:
            self.add(steps)
            for request_id, step in self.cancels.items():
                if step <= steps and request_id in self.added and request_id not in self.cancelled:
                    self.cancelled.add(request_id)
                    self.observer.cancelled[request_id] = steps
                    self.manager.cancel_request(request_id)
        except Exception as exc:
            self.error = self.error or exc

    def collect(self, timeout: float) -> dict[str, Any]:
        """Every result, until each request finished or was cancelled and nothing is due."""
        results: dict[str, Any] = {}
        self.add(0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.manager.get_result(timeout=0.02)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            if not self.manager.is_running() and result is None:
                return results  # the engine's thread is gone (its failure is in the failed results)
            with self.lock:
                waiting = self.added - set(results) - self.cancelled
                due = bool(self.due)
            if not waiting and self._idle():
                if not due:
                    return results
                self.add(len(self.observer.calls), everything_due=True)
        raise TimeoutError(f"transformers CB did not finish within {timeout} s ({len(results)} results)")

    def _idle(self) -> bool:
        processor = self.manager.batch_processor
        return (
            processor is not None
            and not processor.scheduler.has_pending_requests()
            and self.manager.input_queue.empty()
        )
