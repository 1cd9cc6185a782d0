"""Callers of one-box mode: local processes identified by their socket's peer credentials.

Owned by `timeslice serve` (`cli/serve.py`); used by the orchestrator servicer in place of
the cluster's TokenReview authenticator (`auth.py`). A call must arrive through the
`UnixFront` (its `SO_PEERCRED`); the caller acts for the job it names, or, naming none,
for the job its process group or cgroup is bound to, else that scope's own (`pgid-<N>`,
`cgroup-<name>`); a caller that names none in a process group led by a shell (a script,
whose `&` jobs all share it), or in cgroup scope in the root cgroup or serve's own (every
program started beside it shares it), is refused with the way out. Binding the job
makes the caller's scope part of it, so the node agent moves those processes with it
(`PeerJobs`): nobody types PIDs, and nobody acts for another user's processes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from timeslice.driver.errors import PermissionDenied, ProcessGone, Unauthenticated
from timeslice.driver.peercred import (
    SCOPE_JOB_PREFIXES,
    PeerCredentials,
    PeerJobs,
    Scope,
    ScopeKind,
    UnixFront,
    cgroup2_root,
    led_by_a_shell,
    scope_of,
    session_leader,
)

_USER_JOB = re.compile(r"uid\d+/")


@dataclass(frozen=True)
class PeerCaller:
    """A local caller: its credentials and its scope; `pod_uid` is always "" (no pods here).
    `unnamed_job`: the job a call that names none acts for, or, when that is ambiguous,
    `refusal` says why (read `job_id`)."""

    credentials: PeerCredentials
    scope: Scope
    unnamed_job: str
    refusal: str = ""
    pod_uid: str = ""
    serving_uid: int = 0  # the uid `timeslice serve` runs as

    def job_for(self, named: str) -> str:
        """The job a call naming `named` acts for: `named` for serve's own user and root, and
        for the names serve gives (`pgid-<N>`, `cgroup-<name>`: `PeerAuthenticator._squatted`
        guards them); `uid<U>/<named>` for another user U (a shared socket, `--socket-mode
        660`), so that one user's job names never meet another's: nobody takes a name before
        its user does."""
        uid = self.credentials.uid
        if uid in (0, self.serving_uid) or named.startswith((f"uid{uid}/", *SCOPE_JOB_PREFIXES)):
            return named
        return f"uid{uid}/{named}"

    @property
    def job_id(self) -> str:
        """Raises PermissionDenied when a call from here must name its job."""
        if self.refusal:
            raise PermissionDenied(self.refusal)
        return self.unnamed_job


class PeerAuthenticator:
    """`scope`: what a job is made of, "process-group" (default) or "cgroup". Raises OSError
    for "cgroup" where no cgroup v2 hierarchy is mounted (a job's cgroup could be neither
    told apart nor watched)."""

    def __init__(self, front: UnixFront, jobs: PeerJobs, scope: ScopeKind = "process-group") -> None:
        self._front = front
        self._jobs = jobs
        self._scope = scope
        self._serving_uid = os.geteuid()
        # a job never shares the server's own cgroup (the unnamed programs started beside it would be one job)
        self._own_cgroup = ""
        if scope == "cgroup":
            if cgroup2_root() is None:
                raise OSError("--job-scope cgroup: no cgroup v2 hierarchy is mounted here (/proc/self/mountinfo "
                              "has no cgroup2 mount): use --job-scope process-group")
            try:
                self._own_cgroup = scope_of(os.getpid(), "cgroup").key
            except ProcessGone:  # no cgroup v2 entry: every caller's lookup says so in its turn
                pass

    async def identify(self, context: Any) -> PeerCaller:
        """Raises Unauthenticated: the call did not come through the unix socket, or its
        process is gone."""
        creds = self._front.credentials(context.peer())
        if creds is None:
            raise Unauthenticated(f"call over {context.peer()}: in one-box mode, call through the unix socket "
                                  f"{self._front.path}")
        try:
            scope = scope_of(creds.pid, self._scope)
        except ProcessGone:
            raise Unauthenticated(f"the calling process {creds.pid} is gone") from None
        bound = self._jobs.job_of(scope)
        shared = self._shared(scope, creds.pid)
        if shared:
            return PeerCaller(creds, scope, "", refusal=shared, serving_uid=self._serving_uid)
        if bound is None and led_by_a_shell(scope, creds.pid):
            one_job = (" This script has a session of its own (started with `setsid`): if the script is one job, "
                       "name it (`export TIMESLICE_JOB=<name>` at its top, or `timeslice run --job <name>`); "
                       "jobs it starts with `&` each need their own `setsid CMD &`." if session_leader(int(scope.key))
                       else " Start each job in its own process group (`setsid CMD &`), or name it (TIMESLICE_JOB, "
                            "--job).")
            return PeerCaller(creds, scope, "", refusal=(
                f"process {creds.pid} names no job and is in {scope}, whose leader is a shell: a script, whose "
                "commands (jobs started with `&` among them) all share that group, so it cannot tell one job from "
                f"another.{one_job}"), serving_uid=self._serving_uid)
        return PeerCaller(creds, scope, bound or scope.job_name, serving_uid=self._serving_uid)

    async def authenticate(self, context: Any) -> str:
        """Status calls: any local caller that could connect (the socket's mode decides)."""
        return f"uid {(await self.identify(context)).credentials.uid}"

    def admit(self, caller: PeerCaller, group: Any, job: str) -> None:
        """The caller's scope joins `job`. Raises PermissionDenied (`PeerJobs.bind`; a scope
        that is no job's to have, `_shared`; two jobs in one process group, `_one_job`; a
        name serve gives, taken by a caller it would not give it to, `_squatted`)."""
        why = self._shared(caller.scope, caller.credentials.pid) or self._one_job(caller, job) or \
            self._squatted(caller, job)
        if why:
            raise PermissionDenied(why)
        self._jobs.bind(job, caller.credentials, caller.scope)

    def _one_job(self, caller: PeerCaller, job: str) -> str:
        """Why `caller` cannot be its process group's job `job` ("" when it can): another live
        process of the group acted for it, and neither started the other (issue 23: two jobs
        that a Python launcher, `make -j` or `timeout` started in its group were one job and
        held at once). A job's own workers stay one job (`peercred.one_job`)."""
        if job != caller.scope.job_name:
            return ""
        other = self._jobs.unrelated_caller(caller.scope, caller.credentials)
        if other is None:
            return ""
        return (f"process {caller.credentials.pid} names no job, and process {other} of its {caller.scope}, "
                "which is of another lineage (neither started the other, and they are no ranks of one torchrun or "
                "multiprocessing parent), acts for the group's job already: two jobs "
                "started by one program (a launcher, `make -j`, `timeout`) share its process group, so serve cannot "
                "tell them apart. Name each job (TIMESLICE_JOB=<name>, inherited by its processes), or start each "
                "in its own session (`setsid`, `subprocess.Popen(..., start_new_session=True)`)")

    def _squatted(self, caller: PeerCaller, job: str) -> str:
        """Why `caller` may not name `job` ("" when it may): `pgid-<N>` and `cgroup-<name>`
        are the names serve gives the callers in that scope, `uid<U>/<name>` user U's
        (`PeerCaller.job_for`); another takes one only while the job is live and its uid's
        (a job's process that left its group with TIMESLICE_JOB inherited) or it is root,
        so nobody, root included, takes a name before its scope or user does."""
        uid = caller.credentials.uid
        if job == caller.scope.job_name or job.startswith(f"uid{uid}/") or \
                not (job.startswith(SCOPE_JOB_PREFIXES) or _USER_JOB.match(job)):
            return ""
        if self._jobs.owned_by(job, uid) or (uid == 0 and self._jobs.scopes(job)):
            return ""
        return (f"process {caller.credentials.pid} (uid {uid}, in {caller.scope}) cannot name job {job!r}: serve "
                "gives that name to the processes of one scope or one user, and it has no live job of yours. Name "
                "your job otherwise (TIMESLICE_JOB=<name>)")

    def _shared(self, scope: Scope, pid: int) -> str:
        """Why `scope` can be no job's ("" when it can): the root cgroup, which every process
        of the machine shares, or serve's own (a new user's trial: two unnamed programs in
        cgroup / became one job, `cgroup-root`, and held at once; a job's checkpoint would
        stop every process there)."""
        if scope.kind != "cgroup" or scope.key not in ("/", self._own_cgroup):
            return ""
        where = "every process of this machine shares" if scope.key == "/" else "timeslice serve itself is in"
        return (f"process {pid} is in cgroup {scope.key}, which {where}: it cannot be a job's (the job's "
                "checkpoint would stop all of them). Run each job in its own cgroup (`systemd-run --user --scope "
                "CMD`), or serve with --job-scope process-group")
