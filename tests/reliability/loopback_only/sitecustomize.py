"""Imported at startup by the Python processes of the fuzzed server (PYTHONPATH): they can reach
loopback only.

Any socket connection to a non-loopback address is refused, and so is resolving a name that is not
an address literal or `localhost` (a DNS query would leave the machine). Each refusal is logged on
stderr with GUARD_MARK, so the test can count them. Python-level sockets only: the gRPC client's
C core and uvloop's own sockets are not covered, and need not be: they reach Triton and Redis on
127.0.0.1 by address.
"""

import ipaddress
import socket
import sys

GUARD_MARK = "loopback-only guard refused"
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo


def _refuse(what: str) -> None:
    print(f"{GUARD_MARK} {what}", file=sys.stderr, flush=True)


def _is_loopback_address(address) -> bool:
    try:
        return ipaddress.ip_address(str(address[0]).split("%")[0]).is_loopback
    except ValueError:
        return False


def _checked(sock: socket.socket, address) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback_address(address):
        _refuse(f"a connection to {address!r}")
        raise ConnectionRefusedError(f"{GUARD_MARK} a connection to {address!r}")


def connect(self, address):
    _checked(self, address)
    return _connect(self, address)


def connect_ex(self, address):
    _checked(self, address)
    return _connect_ex(self, address)


def getaddrinfo(host, port, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name is None or name.lower().rstrip(".") in LOOPBACK_NAMES:
        return _getaddrinfo(host, port, *args, **kwargs)
    try:
        _getaddrinfo(host, port, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        _refuse(f"to resolve {name!r}")
        raise socket.gaierror(socket.EAI_NONAME, f"{GUARD_MARK} to resolve {name!r}") from None
    return _getaddrinfo(host, port, *args, **kwargs)


socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
socket.getaddrinfo = getaddrinfo
