"""timeslice.driver: what the orchestrator, the kubelet plugin and the node agent share.

Names and constants (`names`), the server-side exception tree (`errors`), logging
setup (`logs`) and the node-agent API stubs (`agentapi.v1`). Imports no component.
"""
