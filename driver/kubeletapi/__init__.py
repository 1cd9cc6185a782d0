"""Generated stubs of the kubelet-facing gRPC APIs the kubelet plugin serves.

    dra_v1/           k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin       (NodePrepareResources, NodeUnprepareResources)
    dra_v1beta1/      k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin  (same, without Device.share_id)
    registration/     pluginregistration.Registration                (GetInfo, NotifyRegistrationStatus)
    health_v1alpha1/  v1alpha1.DRAResourceHealth                     (NodeWatchResources, server-streaming)

Sources: `proto/timeslice/driver/kubeletapi/`, written for this project from
reference/dra-protocol.md; `hack/gen_protos.py` regenerates these folders. Used by
`timeslice.kubelet_plugin` (servers) and the tests (clients, as kubelet calls them).
"""
