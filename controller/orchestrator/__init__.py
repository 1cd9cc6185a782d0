"""The orchestrator: one lock per group, handed between holders with checkpoint/restore.

Terms. A *holder id* (`job_id` on the wire and in these modules) names what holds a
group's lock: in a cluster a *claim set*, `<namespace>/<job>:<pod-level claim name>`
(`MemberSpec.claim_set`; one job may hold several claim sets, in several groups); in
static mode a job name from the node agents' job tables.

    config.py           GroupSpec / MemberSpec (a claim set) / OrchestratorConfig (static groups, YAML)
    lock_queue.py       LockQueue: waiters in grant order
    group.py            LockGroup: holder, fencing epoch, grants; owns the collaborators below
    decisions.py        the decision core of a dispatch (pure): DispatchFacts -> grant, switch, stage, wait
    moves.py            MemoryMoves: gathers the facts and runs the decision; the jobs that must leave
    acquire_calls.py    the decision core of an Acquire (pure): AcquireFacts -> join the hold, queue, refuse
    holds.py            a hold's life: an Acquire admitted (joins the hold, or queues), a grant once persisted, its end
    departures.py       a job leaving the group: dropped, found gone at a restart, done with it (`Leave`)
    switch_run.py       SwitchRunner: the switch in progress (a staging, a confirmation before a grant), its outcome
    switch_outcome.py   the decision core of a switch's end (pure): OutcomeFacts + SwitchResult -> effects
    memory_plan.py      memory reports and plans: which residents leave for a job to fit (over placement.py)
    deferral.py         Deferral: a grant that would move memory waits while residents are between phases
    move_cost.py        the cost model (pure): switch speeds, a move's seconds, how long residents pass a waiter
    holder_watch.py     HolderWatch: the holder's growth; idle residents leave where it outgrew its reservation
    gone_holders.py     a holder none of whose processes is left on its node agents is dropped (every 0.5 s)
    leases.py           Leases: the lease timer, and performing a release or keep-alive
    lease_calls.py      the decision core of a release or keep-alive (pure)
    hold_limits.py      the decision core of maxHoldSeconds (pure)
    callers.py          Callers: withdrawn waiters, a frozen job's waiter kept
    exits.py            a caller that joins its job's hold waits for ended processes' memory to be freed
    in_flight.py        Settling: steps the orchestrator gave up on, unread records: settled before a grant
    preemption.py       Preemption: maxHoldSeconds, parked (preempted) holders
    idle_restores.py    IdleRestores: restores while the group is idle
    takeover.py         adopting the agents' records after a restart or a leader change, and
                        claim sets carried when groups re-form (pure cores: adoption, carrying)
    group_model.py      the group's types (Hold, SwitchRecord, GroupView, ...) and its status view
    residency.py        Residency: what the group learned of its jobs' memory (peaks, declared, settled)
    memory_snapshot.py  MemorySnapshot / DeviceMemory: the group's memory as its node agents reported it
    placement.py        plan_room / place: which residents must leave for a job to fit (pure)
    switch.py           SwitchCoordinator: checkpoint out / restore in over node agents, rollback
    switch_steps.py     SwitchSteps: one step on every target of a job, resent by operation id when its reply is lost
    memory_reports.py   MemoryReports: the memory report, and a switch's waits for memory freed or room
    cooperative.py      CooperativeJobs: the `cooperative` backend's command streams, over the three below
    cooperative_processes.py  Process / Processes / Commands: each job's processes, commands awaiting answers
    cooperative_steps.py      CooperativeSteps: checkpoint and restore commands, late answers rolled back
    cooperative_records.py    CheckpointRecords: pool ranges in the state file, adoption after a restart
    pinned_pool.py      PinnedPool: a node's shared pinned host memory
    state_file.py       StateFile: epochs and placements a standalone restart must not forget
    state_format.py     its records, schema and reading: a snapshot and a journal of per-group changes
    state_journal.py    Journal: writes the two files (O_DSYNC appends, compactions), holds the file's lock
    state_writer.py     StateWriter: the thread that performs the writes, off the event loop
    agents.py           AgentClient: gRPC calls to a node agent (TLS pinning its certificate)
    agent_pool.py       AgentPool: the agent clients by target, stand-ins for agents not to call (MissingAgent, ...)
    metrics.py          Prometheus metrics
    orchestrator.py     Orchestrator: the groups, their switcher and observers
    service.py          gRPC servicer for `timeslice.v1.Orchestrator`
    server.py           create_server / serve
"""
