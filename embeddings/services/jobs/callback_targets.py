"""Where a job callback may go: a strict parse of its URL, every address its host resolves to, and
the address policy (globally reachable unicast only, unless an operator allows a network by name).

Nothing here knows Django: callers pass the allowed networks, the resolver and its timeout.

CallbackTargetError (.reason: a sentence for the client and the log)
├── CallbackUrlInvalid       the URL itself: scheme, credentials, odd host spelling, port
├── CallbackHostUnresolved   the name does not resolve, or not in time (may be transient)
└── CallbackAddressRefused   an address the policy refuses (.address, .address_class)

Python's `ipaddress` decides most of it (`is_global`, `is_loopback`, ...) but not all: on the 3.11
we ship, `is_global` is True for multicast, site-local fec0::/10, 3fff::/20 (documentation since
RFC 9637) and 192.88.99.0/24 (the deprecated 6to4 relay), and it judges ::ffff:a.b.c.d, NAT64
64:ff9b::/96 and 6to4 2002::/16 by their IPv6 range instead of the IPv4 address they reach. Those
cases are handled here explicitly. The tables below name special-purpose ranges in refusals (and
refuse those `is_global` misjudges); `ipaddress` decides the rest.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import idna

from embeddings.errors import EmbedsiteError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port, timeout_s) -> the address strings it resolves to; raises CallbackHostUnresolved.
Resolver = Callable[[str, int, float], Sequence[str]]

MAX_URL_LENGTH = 2000
DEFAULT_PORTS = {"http": 80, "https": 443}
# getaddrinfo has no timeout of its own (glibc waits resolv.conf's timeout times attempts per server):
# lookups run in threads we stop waiting for, at most this many at once per process.
MAX_CONCURRENT_LOOKUPS = 8


class CallbackTargetError(EmbedsiteError):
    """A callback URL that cannot be used; `reason` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class CallbackUrlInvalid(CallbackTargetError):
    pass


class CallbackHostUnresolved(CallbackTargetError):
    pass


class CallbackAddressRefused(CallbackTargetError):
    def __init__(self, reason: str, *, address: IPAddress, address_class: str) -> None:
        self.address = address
        self.address_class = address_class
        super().__init__(reason)


@dataclass(frozen=True)
class CallbackTarget:
    """A vetted callback URL: what to connect to (`addresses`) and what to tell the receiver."""

    url: str
    scheme: str
    hostname: str  # ASCII (IDNA), lower case; the address itself for a literal
    port: int
    host_header: str  # hostname[:port], IPv6 in brackets, port only when not the scheme's default
    request_target: str  # path and query, as sent on the request line
    addresses: tuple[IPAddress, ...]  # every address the host resolved to, each one allowed


# --- Addresses -------------------------------------------------------------------------------------

_IPV4_NAMED = [
    (ipaddress.ip_network(network), name)
    for network, name in (
        ("0.0.0.0/8", "'this network', 0.0.0.0/8"),
        ("10.0.0.0/8", "private, RFC 1918"),
        ("172.16.0.0/12", "private, RFC 1918"),
        ("192.168.0.0/16", "private, RFC 1918"),
        ("100.64.0.0/10", "shared address space for carrier-grade NAT, RFC 6598"),
        ("192.0.0.0/24", "IETF protocol assignments, 192.0.0.0/24"),
        ("192.0.2.0/24", "documentation, RFC 5737"),
        ("198.51.100.0/24", "documentation, RFC 5737"),
        ("203.0.113.0/24", "documentation, RFC 5737"),
        ("198.18.0.0/15", "benchmarking, RFC 2544"),
        ("192.88.99.0/24", "6to4 relay anycast, deprecated by RFC 7526"),
        ("240.0.0.0/4", "reserved, 240.0.0.0/4"),
    )
]
_IPV6_NAMED = [
    (ipaddress.ip_network(network), name)
    for network, name in (
        ("fc00::/7", "unique local, RFC 4193"),
        ("fec0::/10", "site-local, deprecated by RFC 3879"),
        ("2001:db8::/32", "documentation, RFC 3849"),
        ("3fff::/20", "documentation, RFC 9637"),
        ("2001:2::/48", "benchmarking, RFC 5180"),
        ("2001::/32", "Teredo, RFC 4380"),
        ("100::/64", "discard-only, RFC 6666"),
        ("64:ff9b:1::/48", "local-use NAT64, RFC 8215"),
        ("2001:10::/28", "ORCHID, RFC 4843"),
        ("2001:20::/28", "ORCHIDv2, RFC 7343"),
        ("::ffff:0:0:0/96", "IPv4-translated, RFC 2765"),
    )
]
_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def parse_networks(networks: Iterable[str | IPNetwork]) -> tuple[IPNetwork, ...]:
    """CIDRs as networks; a network with host bits set ("10.0.0.1/8") is a ValueError, not a guess."""
    return tuple(ipaddress.ip_network(network, strict=True) for network in networks)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> tuple[str, ipaddress.IPv4Address] | None:
    """The IPv4 address an IPv6 address stands for, with the name of the form."""
    if address.ipv4_mapped is not None:
        return "IPv4-mapped", address.ipv4_mapped
    if address in _NAT64_WELL_KNOWN:
        return "NAT64 64:ff9b::/96", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return "6to4", address.sixtofour
    if address in _IPV4_COMPATIBLE and not (address.is_unspecified or address.is_loopback):
        return "IPv4-compatible (deprecated by RFC 4291)", ipaddress.IPv4Address(int(address))
    return None


def address_refusal(address: IPAddress, allowed_networks: Sequence[IPNetwork] = ()) -> str | None:
    """Why a callback may not go to `address` (its class, e.g. "loopback"), or None if it may.

    Unspecified, multicast and broadcast addresses are never allowed (0.0.0.0 reaches this host);
    anything else inside an allowed network is.
    """
    if address.is_unspecified:
        return "unspecified"
    if address.is_multicast:
        return "multicast"
    if address == _BROADCAST:
        return "broadcast"
    if any(address in network for network in allowed_networks):
        return None
    if isinstance(address, ipaddress.IPv6Address) and (embedded := _embedded_ipv4(address)):
        form, ipv4 = embedded
        refusal = address_refusal(ipv4, allowed_networks)
        if form.startswith("IPv4-compatible"):
            return f"{form} form of {ipv4}"
        return f"{form} form of {ipv4}: {refusal}" if refusal else None
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link-local"
    for network, name in _IPV4_NAMED if address.version == 4 else _IPV6_NAMED:
        if address in network:
            return name
    if address.is_reserved:
        return "reserved"
    if address.is_private:
        return "private-use"
    if not address.is_global:
        return "not globally reachable"
    return None


# --- URLs ------------------------------------------------------------------------------------------

_IPV6_NETLOC = re.compile(r"\[(?P<host>[0-9A-Fa-f:.]+)\](?::(?P<port>[0-9]{1,5}))?")
_NAME_NETLOC = re.compile(r"(?P<host>[^:\[\]]+)(?::(?P<port>[0-9]{1,5}))?")
_DECIMAL_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_CANONICAL_IPV4 = re.compile(rf"{_DECIMAL_OCTET}(?:\.{_DECIMAL_OCTET}){{3}}")
# A last label of digits, or 0x and hex digits, makes the whole name an IPv4 address to inet_aton
# and to browsers (WHATWG URL): 2130706433, 0177.0.0.1, 0x7f.1 and 127.1 all mean 127.0.0.1.
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_LDH_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def _ascii_hostname(host: str) -> str:
    if host.endswith("."):
        raise CallbackUrlInvalid(f"the host {host!r} ends with a dot; write it without")
    try:
        # UTS #46 maps what browsers map (full-width digits and dots too), so what is checked below
        # is the name that would be looked up.
        ascii_host = idna.encode(host, uts46=True, std3_rules=True).decode("ascii")
    except (idna.IDNAError, UnicodeError) as error:
        raise CallbackUrlInvalid(f"the host {host!r} is not a valid host name ({error})") from None
    labels = ascii_host.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]) and not _CANONICAL_IPV4.fullmatch(ascii_host):
        raise CallbackUrlInvalid(
            f"the host {host!r} is an ambiguous spelling of an IPv4 address (decimal, octal, hex or "
            "shortened); write an address as four decimal numbers, a.b.c.d"
        )
    if len(ascii_host) > 253 or not all(_LDH_LABEL.fullmatch(label) for label in labels):
        raise CallbackUrlInvalid(f"the host {host!r} is not a valid host name")
    return ascii_host


def callback_url_parse(url: str) -> tuple[CallbackTarget, IPAddress | None]:
    """The target of `url`, not yet resolved (addresses empty), and its address if the host is one.

    Refuses what could mean two things to two parsers: credentials (`http://good.com@127.0.0.1/`),
    backslashes, percent-encoded or numeric-but-not-dotted-quad hosts, trailing dots, zone ids.
    """
    if not isinstance(url, str) or not url:
        raise CallbackUrlInvalid("callback_url must be a non-empty string")
    if len(url) > MAX_URL_LENGTH:
        raise CallbackUrlInvalid(f"callback_url is longer than {MAX_URL_LENGTH} characters")
    if any(ord(character) <= 0x20 or ord(character) == 0x7F for character in url):
        raise CallbackUrlInvalid("callback_url contains spaces or control characters")
    try:
        parts = urlsplit(url)
    except ValueError as error:  # e.g. brackets around something that is not an address
        raise CallbackUrlInvalid(f"callback_url cannot be parsed ({error})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise CallbackUrlInvalid(f"the scheme must be http or https, not {parts.scheme!r}")
    netloc = parts.netloc
    if not netloc:
        raise CallbackUrlInvalid("callback_url has no host")
    if "@" in netloc:
        raise CallbackUrlInvalid(
            "credentials (user:password@) are not allowed in callback_url: callbacks are signed instead"
        )
    if "\\" in netloc or "%" in netloc:
        raise CallbackUrlInvalid("the host part of callback_url contains '\\' or '%'")
    rest = url[len(parts.scheme) + len("://") + len(netloc) :]
    if not rest.isascii():
        raise CallbackUrlInvalid("percent-encode non-ASCII characters in callback_url's path and query")

    match = _IPV6_NETLOC.fullmatch(netloc) if netloc.startswith("[") else _NAME_NETLOC.fullmatch(netloc)
    if match is None:
        raise CallbackUrlInvalid(f"cannot read a host and port from {netloc!r}")
    port = DEFAULT_PORTS[scheme] if match["port"] is None else int(match["port"])
    if not 1 <= port <= 65535:
        raise CallbackUrlInvalid(f"the port must be from 1 to 65535, not {match['port']}")

    address: IPAddress | None
    if netloc.startswith("["):
        try:
            address = ipaddress.IPv6Address(match["host"])
        except ValueError:
            raise CallbackUrlInvalid(f"{match['host']!r} is not an IPv6 address") from None
        hostname = str(address)
        host_for_header = f"[{hostname}]"
    else:
        hostname = _ascii_hostname(match["host"])
        address = ipaddress.IPv4Address(hostname) if _CANONICAL_IPV4.fullmatch(hostname) else None
        host_for_header = hostname
    host_header = host_for_header if port == DEFAULT_PORTS[scheme] else f"{host_for_header}:{port}"
    request_target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    target = CallbackTarget(
        url=url,
        scheme=scheme,
        hostname=hostname,
        port=port,
        host_header=host_header,
        request_target=request_target,
        addresses=(),
    )
    return target, address


# --- Resolution ------------------------------------------------------------------------------------

_lookup_slots = threading.BoundedSemaphore(MAX_CONCURRENT_LOOKUPS)


def _reset_lookup_slots() -> None:
    # A forked child has none of its parent's lookup threads, so none of their slots are taken.
    global _lookup_slots
    _lookup_slots = threading.BoundedSemaphore(MAX_CONCURRENT_LOOKUPS)


os.register_at_fork(after_in_child=_reset_lookup_slots)


def resolve_host(host: str, port: int, timeout_s: float) -> list[str]:
    """Every address getaddrinfo gives for `host` (A and AAAA, as the OS resolves: /etc/hosts,
    then DNS), or CallbackHostUnresolved after timeout_s.

    The lookup runs in a daemon thread that is abandoned at the deadline (getaddrinfo cannot be
    interrupted); a semaphore keeps such threads to MAX_CONCURRENT_LOOKUPS per process.
    """
    deadline = time.monotonic() + timeout_s
    slots = _lookup_slots
    if not slots.acquire(timeout=timeout_s):
        raise CallbackHostUnresolved(f"{host} could not be looked up now (too many lookups in progress)")
    outcome: dict[str, object] = {}
    done = threading.Event()

    def lookup() -> None:
        try:
            outcome["answers"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as error:
            outcome["error"] = error
        finally:
            slots.release()
            done.set()

    threading.Thread(target=lookup, name="callback-dns", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise CallbackHostUnresolved(f"{host} did not resolve within {timeout_s:g} s")
    if "error" in outcome:
        error = outcome["error"]
        detail = getattr(error, "strerror", None) or str(error)
        raise CallbackHostUnresolved(f"{host} does not resolve ({detail})")
    addresses = list(dict.fromkeys(answer[4][0] for answer in outcome["answers"]))  # type: ignore[union-attr]
    if not addresses:
        raise CallbackHostUnresolved(f"{host} resolves to no address")
    return addresses


def callback_target_resolve(
    url: str,
    *,
    allowed_networks: Iterable[str | IPNetwork] = (),
    resolver: Resolver = resolve_host,
    timeout_s: float = 3.0,
) -> CallbackTarget:
    """The vetted target of `url`: parsed strictly, its host resolved, and every address allowed.

    One refused address refuses the URL (a name with a public and a private answer could be
    connected to either). A literal address is never handed to the resolver.
    """
    target, literal = callback_url_parse(url)
    networks = parse_networks(allowed_networks)
    if literal is not None:
        answers: Sequence[IPAddress] = [literal]
    else:
        answers = []
        for text in resolver(target.hostname, target.port, timeout_s):
            try:
                answers.append(ipaddress.ip_address(text))
            except ValueError:
                raise CallbackHostUnresolved(
                    f"{target.hostname} resolved to {text!r}, not an address"
                ) from None
    if not answers:
        raise CallbackHostUnresolved(f"{target.hostname} resolves to no address")
    for address in answers:
        refusal = address_refusal(address, networks)
        if refusal is None:
            continue
        shown = str(address).split("%", 1)[0]
        where = f"{shown} is" if literal is not None else f"{target.hostname} resolves to {shown}, which is"
        reason = f"{where} not a public address ({refusal}); callbacks go only to public addresses"
        raise CallbackAddressRefused(reason, address=address, address_class=refusal)
    return CallbackTarget(
        url=target.url,
        scheme=target.scheme,
        hostname=target.hostname,
        port=target.port,
        host_header=target.host_header,
        request_target=target.request_target,
        addresses=tuple(dict.fromkeys(answers)),
    )
