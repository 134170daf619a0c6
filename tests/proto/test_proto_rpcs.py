"""Every RPC has its own request and response message (Google AIP / buf STANDARD style)."""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter

from google.protobuf.descriptor import MethodDescriptor

import fedlink.v1


def all_methods() -> list[MethodDescriptor]:
    """Every RPC of every service in the generated fedlink.v1 modules."""
    methods: list[MethodDescriptor] = []
    for info in pkgutil.iter_modules(fedlink.v1.__path__, prefix="fedlink.v1."):
        if not info.name.endswith("_pb2"):
            continue
        module = importlib.import_module(info.name)
        for service in module.DESCRIPTOR.services_by_name.values():
            methods.extend(service.methods)
    return methods


def test_both_services_are_found() -> None:
    services = {method.containing_service.full_name for method in all_methods()}
    assert {"fedlink.v1.RunnerService", "fedlink.v1.ControlService"} <= services


def test_no_message_serves_two_rpcs() -> None:
    uses = Counter(
        name
        for method in all_methods()
        for name in (method.input_type.full_name, method.output_type.full_name)
    )
    shared = sorted(name for name, count in uses.items() if count > 1)
    assert not shared, f"messages used by more than one RPC (or as both request and response): {shared}"
