"""The node agent: checkpoint/restore of a job's processes on one node.

    backends/    one module per backend (cuda, cuda_checkpoint, freeze, none) behind base.Backend
    processes.py ProcessResolver: job -> host PIDs on this node
    records.py   JobRecords: which PIDs this agent checkpointed (persisted)
    steps.py     StepRequest / StepOutcome: a switch step as NodeAgent runs it
    service.py   gRPC servicer for `timeslice.agent.v1.NodeAgent`
    auth.py      AllowedCallers: only the orchestrator's ServiceAccount (TokenReview)
    tls.py       AgentIdentity: the self-signed certificate of --agent-tls (key in memory)
    server.py    create_server / serve
"""
