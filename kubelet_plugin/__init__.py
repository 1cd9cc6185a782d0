"""timeslice.kubelet_plugin: the node component (DaemonSet on GPU nodes).

    plugin.py         ClaimPlugin: the seam behind the kubelet's DRA calls (plain domain objects)
    dra_service.py    gRPC adapter for DRAPlugin v1 and v1beta1 over one ClaimPlugin
    registration.py   pluginregistration.Registration (GetInfo, NotifyRegistrationStatus)
    health.py         v1alpha1.DRAResourceHealth stream and its sources (static, NVML)
    sockets.py        socket paths under the kubelet directories, stale-socket clean-up
    plugin_server.py  create_servers: the DRA server, then the registration server
    agent/            the node agent: checkpoints and restores a job's processes
    agent_certificate.py  CertificatePublisher: the agent's TLS certificate on the plugin's own pod

Imports `timeslice.driver`, never `timeslice.controller`.
"""
