"""Whether a joined Ray cluster runs without token authentication (issue 11, item 21).

Ray's client has no call that reports the cluster's auth mode: `get_authentication_mode()` is this
process's own setting. So the cluster is asked directly: one gRPC call to its GCS
(`NodeInfoGcsService.GetClusterId`, read-only) sent without a token. A cluster with `RAY_AUTH_MODE=token`
answers UNAUTHENTICATED; one that answers the call runs code for anyone who can reach its ports (and
TransferQueue's sockets there unpickle what they get). The answer also sets the mode a run joins in
(`ray_cluster.connect_ray`): a client in token mode can connect to an auth-disabled cluster, but the
actors it starts there die before they run (tried with Ray 2.60: TransferQueue's controller).
"""

from __future__ import annotations

PROBE_TIMEOUT_S = 10.0


def gcs_address_of(address: str) -> str | None:
    """`host:port` of the GCS that `ray_kwargs.ray_init.address` names ("auto": the cluster `ray start` last
    started on this machine); None for a Ray Client address (`ray://`) or when none is found."""
    if address.startswith("ray://"):
        return None
    from ray._private.services import canonicalize_bootstrap_address  # Ray's own resolution of "auto" / host:port

    try:
        return canonicalize_bootstrap_address(address)
    except Exception:  # ray.init reports a bad address with Ray's own message
        return None


def accepts_unauthenticated_requests(gcs_address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """True when the GCS at `host:port` answers a request that carries no token, False when it refuses it for
    lack of one, None when the probe could not tell (unreachable, another error)."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return True


def token_auth_warning(gcs_address: str) -> str:
    """The run-log line for a joined cluster that accepts requests without a token."""
    return (
        f"Ray token authentication is OFF on the joined cluster {gcs_address}: anyone who can reach its ports can "
        "run code on it, and TransferQueue's sockets there accept pickled data. Start its nodes with "
        "RAY_AUTH_MODE=token (docs/security.md)."
    )
