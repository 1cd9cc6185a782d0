"""timeslice.driver: what the orchestrator, the kubelet plugin and the node agent share.

Names and constants (`names`), the server-side exception tree (`errors`) and the
translation of Kubernetes API errors into it (`kubeapi`), bearer tokens on calls
(`bearer`) and their TokenReview with a cache (`tokenreview`), the node agent's pinned
certificate's fingerprint (`certificates`), logging setup (`logs`), the
node-agent API stubs (`agentapi.v1`) and the kubelet-facing API stubs (`kubeletapi`:
DRA v1/v1beta1, plugin registration, DRA health). Imports no component.
"""
