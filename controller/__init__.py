"""timeslice.controller: the cluster-side component (Deployment, leader-elected).

Holds the orchestrator (`orchestrator/`): lock queues, leases and the switch
transaction over node agents; and the controller's model of the cluster, from which
lock groups are derived:

    jobs.py           job identity of a pod
    grouping.py       claims + pods + slices -> claim sets and lock groups (pure)
    reflector.py      one kind of API object kept by list + watch (kubernetes.aio)
    cluster_state.py  ClusterState: three reflectors -> on_change(Snapshot)

Imports `timeslice.driver` and the API stubs, never `timeslice.kubelet_plugin`.
"""
