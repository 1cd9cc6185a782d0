"""Our kubelet-facing protos match the upstream wire facts (reference/dra-protocol.md §1, §2).

Checked on the generated descriptors: full method names (what goes on the wire),
streaming, and the field numbers and types of every message kubelet sends or reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2 as v1
from timeslice.driver.kubeletapi.dra_v1 import dra_pb2_grpc as v1_grpc
from timeslice.driver.kubeletapi.dra_v1beta1 import dra_pb2 as v1beta1
from timeslice.driver.kubeletapi.health_v1alpha1 import dra_health_pb2 as hpb
from timeslice.driver.kubeletapi.registration import registration_pb2 as rpb

METHODS = {
    v1: ["/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
         "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"],
    v1beta1: ["/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
              "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources"],
    rpb: ["/pluginregistration.Registration/GetInfo", "/pluginregistration.Registration/NotifyRegistrationStatus"],
    hpb: ["/v1alpha1.DRAResourceHealth/NodeWatchResources"],
}

S, B, I64, MSG, ENUM = FD.TYPE_STRING, FD.TYPE_BOOL, FD.TYPE_INT64, FD.TYPE_MESSAGE, FD.TYPE_ENUM
DRA_FIELDS = {
    "NodePrepareResourcesRequest": {"claims": (1, MSG, True)},
    "NodePrepareResourcesResponse": {"claims": (1, MSG, True)},  # map<string, NodePrepareResourceResponse>
    "NodePrepareResourceResponse": {"devices": (1, MSG, True), "error": (2, S, False)},
    "Device": {"request_names": (1, S, True), "pool_name": (2, S, False), "device_name": (3, S, False),
               "cdi_device_ids": (4, S, True)},
    "NodeUnprepareResourcesRequest": {"claims": (1, MSG, True)},
    "NodeUnprepareResourcesResponse": {"claims": (1, MSG, True)},
    "NodeUnprepareResourceResponse": {"error": (1, S, False)},
    "Claim": {"namespace": (1, S, False), "uid": (2, S, False), "name": (3, S, False)},
}
OTHER_FIELDS = {
    rpb: {"InfoRequest": {}, "RegistrationStatusResponse": {},
          "PluginInfo": {"type": (1, S, False), "name": (2, S, False), "endpoint": (3, S, False),
                         "supported_versions": (4, S, True)},
          "RegistrationStatus": {"plugin_registered": (1, B, False), "error": (2, S, False)}},
    hpb: {"NodeWatchResourcesRequest": {},
          "DeviceIdentifier": {"pool_name": (1, S, False), "device_name": (2, S, False)},
          "DeviceHealth": {"device": (1, MSG, False), "health": (2, ENUM, False), "last_updated_time": (3, I64, False),
                           "health_check_timeout_seconds": (4, I64, False), "message": (5, S, False)},
          "NodeWatchResourcesResponse": {"devices": (1, MSG, True)}},
}


def shape(module, message: str) -> dict[str, tuple[int, int, bool]]:
    return {f.name: (f.number, f.type, f.is_repeated)
            for f in module.DESCRIPTOR.message_types_by_name[message].fields}


@pytest.mark.parametrize("module", list(METHODS), ids=lambda m: m.DESCRIPTOR.package)
def test_full_method_names_are_the_upstream_ones(module) -> None:
    names = [f"/{s.full_name}/{m.name}" for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods]
    assert names == METHODS[module]
    streaming = [m.name for s in module.DESCRIPTOR.services_by_name.values() for m in s.methods if m.server_streaming]
    assert streaming == (["NodeWatchResources"] if module is hpb else [])


def test_generated_client_stub_calls_the_upstream_path() -> None:
    source = Path(v1_grpc.__file__).read_text()
    assert "'/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources'" in source


@pytest.mark.parametrize("module", [v1, v1beta1], ids=["v1", "v1beta1"])
def test_dra_messages_have_the_upstream_field_numbers(module) -> None:
    for message, fields in DRA_FIELDS.items():
        got = shape(module, message)
        if module is v1 and message == "Device":
            assert got.pop("share_id") == (5, S, False)
            assert module.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence  # proto3 `optional`
        assert got == fields, message
    claims = module.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"].message_type
    assert claims.GetOptions().map_entry and claims.fields_by_name["key"].type == S


@pytest.mark.parametrize("module", list(OTHER_FIELDS), ids=lambda m: m.DESCRIPTOR.package)
def test_registration_and_health_messages_have_the_upstream_field_numbers(module) -> None:
    for message, fields in OTHER_FIELDS[module].items():
        assert shape(module, message) == fields, message


def test_health_status_enum_values() -> None:
    assert dict(hpb.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
