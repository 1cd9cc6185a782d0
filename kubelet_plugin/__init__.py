"""timeslice.kubelet_plugin: the node component (DaemonSet on GPU nodes).

Holds the node agent (`agent/`) that checkpoints and restores a job's processes
through pluggable backends. Imports `timeslice.driver`, never `timeslice.controller`.
"""
