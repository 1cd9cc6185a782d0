"""timeslice.controller: the cluster-side component (Deployment, leader-elected).

Holds the orchestrator (`orchestrator/`): lock queues, leases and the switch
transaction over node agents. Imports `timeslice.driver` and the API stubs, never
`timeslice.kubelet_plugin`.
"""
