"""Callers: what a lock group does when the callers of a waiter or a hold leave.

Owned by `LockGroup` (one per group). An Acquire's caller leaves by a timeout, a
CancelAcquire, or a lost connection (the server's keep-alive pings went unanswered,
`grpc_server.SERVER_OPTIONS`). A waiter whose last caller left is never granted; a grant
whose last caller left in the same instant ends at once. One exception keeps a frozen
job from being stranded: on a backend that stops or locks processes (`STOPPING_BACKENDS`), a
waiter of a job this group checkpointed or froze keeps its place when its connection is lost
(its processes are stopped and cannot answer). Under `app` and `cooperative` a checkpointed
job's client runs on: its lost connection is a caller gone (app schedules seed 5: a killed
client's waiter was kept, granted, joined by the job's next process, and its hold, which the
dead caller never released, kept every other engine asleep).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from timeslice.controller.orchestrator.group_model import Hold
from timeslice.controller.orchestrator.lock_queue import Waiter
from timeslice.driver.names import STOPPING_BACKENDS

if TYPE_CHECKING:
    from timeslice.controller.orchestrator.group import LockGroup

log = logging.getLogger("timeslice.orchestrator")


class Callers:
    def __init__(self, group: LockGroup) -> None:
        self._g = group

    def left(self, w: Waiter) -> None:
        """A caller of `w` left. Once none is left, `w` is never (or no longer) granted."""
        g = self._g
        w.callers -= 1
        if w.callers > 0:
            return
        if g.queue.remove(w):
            g.preemption.forget(w)
            g.preemption.disarm_when_unwaited()
            log.info("withdrawn group=%s job=%s request=%s", g.id, w.job_id, w.request_id)
            g.dispatch()
            return
        h = g.holder
        if h is not None and w.request_id in h.request_ids:
            if self._left_hold(h, w.request_id, "caller left before receiving the grant"):
                g.dispatch()

    def lost(self, w: Waiter) -> None:
        """The last call waiting on `w` was cancelled (its connection was lost). When `w`'s
        job is checkpointed here by a backend that stops or locks processes, they are frozen
        or checkpointed by this group and cannot answer: `w` keeps its place with no caller,
        is granted in its turn (restoring the job), and its client, running again, asks with
        the same request id and receives that grant (or gives it up with CancelAcquire; a
        grant nobody takes lapses with its lease). Any other waiter leaves like a caller that
        gave up."""
        g = self._g
        if w.callers > 1 or w.job_id not in g.residency.checkpointed or g.spec.backend not in STOPPING_BACKENDS \
                or g.queue.by_request(w.job_id, w.request_id) is not w:
            self.left(w)
            return
        w.callers = 0
        log.info("waiter kept group=%s job=%s request=%s: its connection was lost while its job is checkpointed "
                 "(frozen processes cannot answer); it keeps its place", g.id, w.job_id, w.request_id)

    def gave_up(self, job_id: str, request_id: str) -> str:
        """CancelAcquire: "queued" (the entry left the queue: the request is given up,
        whatever calls of it still wait), "granted" (its part of the hold ended, the hold
        with its last caller) or "unknown"."""
        g = self._g
        w = g.queue.by_request(job_id, request_id)
        if w is not None:
            w.callers = 1  # every call of this request gave up
            self.left(w)
            return "queued"
        h = g.holder
        if h is not None and h.job_id == job_id and request_id in h.request_ids:
            if self._left_hold(h, request_id, "its caller gave up on the grant"):
                g.notify("released", job_id, h.epoch)
                g.dispatch()
            return "granted"
        return "unknown"

    def released_part(self, h: Hold, request_id: str) -> None:
        """A Release by the caller of `request_id` while other callers share `h` (it goes on:
        `lease_calls.Lease.shared_beyond` says when): its part ends."""
        h.request_ids.discard(request_id)
        log.info("caller released its part group=%s job=%s request=%s callers_left=%d", self._g.id, h.job_id,
                 request_id, len(h.request_ids))

    def prune_parts(self, h: Hold) -> None:
        """As a caller joins `h`: end the parts whose callers kept them alive (a KeepAlive naming
        their request) and then not for the lease's length: killed while the job's next process
        shared the hold, whose joins renewed the job's lease for ever (a helper's attack on a
        standalone node: the other jobs waited until the new process ended). Only at a join: a
        part whose caller's keep-alives are merely starved (a process pinning tens of GB) while
        another caller of its job keeps the hold alive is not ended under it. A part that never
        named itself in a KeepAlive (an older client, a phase shorter than the keep-alive
        interval) is never ended here. The hold ends with its last part."""
        g = self._g
        if h is not g.holder:  # (a parked hold's parts wait with it)
            return
        now = g.clock()
        for request_id in [r for r, t in h.kept_alive.items() if now - t > g.spec.lease_seconds]:
            del h.kept_alive[request_id]
            if request_id not in h.request_ids or h.ended:
                continue
            log.warning("caller part lapsed group=%s job=%s request=%s: no keep-alive for %.1f s", g.id, h.job_id,
                        request_id, g.spec.lease_seconds)
            if self._left_hold(h, request_id, "its callers stopped keeping it alive"):
                g.notify("released", h.job_id, h.epoch)
                g.dispatch()
                return

    def _left_hold(self, h: Hold, request_id: str, why: str) -> bool:
        """The caller of `request_id` left the hold `h`; the hold ends with its last caller
        (never one whose callers are unknown: adopted). True when it ended."""
        h.request_ids.discard(request_id)
        if h.request_ids or h.callers_unknown:
            return False
        self._g.end_hold(h, why)
        return True
