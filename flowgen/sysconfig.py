"""`flow.sysconfig`: facts about how this flowgen runs ranks, under OneFlow's names.

OneFlow's ranks talk over gRPC (its control plane); flowgen's are started and connected by MPI
(flowgen/distributed/launch.py), so `has_rpc_backend_grpc()` is False. Code such as OneFlow's
tests uses it to skip multi-process paths that need gRPC.
"""
from __future__ import annotations

__all__ = ["has_rpc_backend_grpc"]


def has_rpc_backend_grpc() -> bool:
    """False: flowgen has no gRPC control plane (its ranks use MPI)."""
    return False
