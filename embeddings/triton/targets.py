"""Where Triton's replicas are: TRITON_SERVER_URL read into the target gRPC dials, and the replicas
listed one by one for readiness and statistics.

gRPC itself resolves and balances: the client's channels use the `round_robin` policy, so a name
that resolves to several addresses (a Kubernetes headless Service, `docker compose --scale`)
spreads calls over all of them and skips those that fail, re-resolving as replicas come and go;
a comma-separated list of IP addresses becomes gRPC's `ipv4:` (or `ipv6:`) target. gRPC has no
target for a list of names, so such a list is refused with the way to write it instead.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class TritonTarget:
    grpc_target: str  # what the channels dial
    endpoints: tuple[str, ...]  # "host:port" of each listed replica, or the one name to resolve

    @classmethod
    def of_grpc_target(cls, grpc_target: str) -> TritonTarget:
        """The target a client was given (what parse_triton_target made, or a plain "host:port")."""
        if grpc_target.startswith(("ipv4:", "ipv6:")):
            return cls(grpc_target, tuple(grpc_target[5:].split(",")))
        if grpc_target.startswith("dns:"):
            return cls(grpc_target, (grpc_target.removeprefix("dns:").lstrip("/"),))
        return cls(grpc_target, (grpc_target,))

    @property
    def listed(self) -> bool:
        """The replicas are listed addresses."""
        return self.grpc_target.startswith(("ipv4:", "ipv6:"))

    @property
    def replicated(self) -> bool:
        """Several replicas, listed or behind a `dns:///` name: readiness checks each one, and a
        call that one of them does not answer in time is tried on another."""
        return self.listed or self.grpc_target.startswith("dns:")


def _endpoint(text: str, default_port: int) -> tuple[str, int]:
    """`host`, `host:port`, `[v6]:port`, or a URL (`grpc://`, `http://`, as the seed proxy took)."""
    url = text if "://" in text else f"grpc://{text}"
    parts = urlsplit(url)
    if not parts.hostname:
        raise ValueError(f"no host in {text!r}")
    try:
        port = parts.port or default_port
    except ValueError:
        raise ValueError(f"a bad port in {text!r}") from None
    return parts.hostname, port


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _joined(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_triton_target(url: str, default_port: int) -> TritonTarget:
    """TRITON_SERVER_URL: one endpoint (a name may resolve to many replicas), `dns:///name:port`,
    or a comma-separated list of IP endpoints. Raises ValueError saying what is wrong."""
    url = url.strip()
    if url.startswith("dns:"):
        name = url.removeprefix("dns:").lstrip("/")
        host, port = _endpoint(name, default_port)
        return TritonTarget(f"dns:///{_joined(host, port)}", (_joined(host, port),))
    entries = [entry.strip() for entry in url.split(",") if entry.strip()]
    if not entries:
        raise ValueError("it is empty")
    endpoints = [_endpoint(entry, default_port) for entry in entries]
    if len(endpoints) == 1:
        host, port = endpoints[0]
        return TritonTarget(_joined(host, port), (_joined(host, port),))
    addresses = [_address(host) for host, _ in endpoints]
    if any(address is None for address in addresses):
        raise ValueError(
            "a list of replicas takes IP addresses; for names, give one DNS name that resolves to "
            "every replica (a Kubernetes headless Service, a `docker compose --scale` service), "
            "e.g. dns:///triton:8001"
        )
    versions = {address.version for address in addresses if address is not None}
    if len(versions) > 1:
        raise ValueError("a list of replicas is all IPv4 or all IPv6 addresses")
    joined = tuple(_joined(host, port) for host, port in endpoints)
    if len(set(joined)) != len(joined):
        raise ValueError("a replica is listed twice")
    return TritonTarget(f"ipv{versions.pop()}:{','.join(joined)}", joined)


def replica_endpoints(target: TritonTarget) -> list[str]:
    """Each replica's "address:port": the listed ones, every address a `dns:///` name resolves to
    now (blocking: call it off the event loop), or the one endpoint. A plain name is one endpoint
    here even when gRPC spreads calls over its addresses (`localhost` is ::1 and 127.0.0.1, one
    Triton): write `dns:///name:port` to have each address checked."""
    if not target.grpc_target.startswith("dns:"):
        return list(target.endpoints)
    host, _, port = target.endpoints[0].rpartition(":")
    host = host.strip("[]")
    if _address(host) is not None:
        return list(target.endpoints)
    found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return sorted({_joined(info[4][0], int(port)) for info in found})
