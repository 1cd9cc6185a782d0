"""The orchestrator: one lock per group, handed between jobs with checkpoint/restore.

    config.py      GroupSpec / OrchestratorConfig (static groups, YAML)
    lock_queue.py  LockQueue: waiters in grant order
    group.py       LockGroup: holder, lease, epoch, resident job; decides grants
    switch.py      SwitchCoordinator: checkpoint out / restore in over node agents, rollback
    agents.py      AgentClient / AgentPool: gRPC calls to node agents (TLS pinning their certificates)
    service.py     gRPC servicer for `timeslice.v1.Orchestrator`
    server.py      create_server / serve
"""
