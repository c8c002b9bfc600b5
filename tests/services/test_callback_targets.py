"""The callback address policy on tables of addresses and URLs, with no connection made: literal
addresses never reach a resolver, names are answered by a fake one (getaddrinfo only for localhost,
which /etc/hosts answers)."""

from __future__ import annotations

import ipaddress
import threading

import pytest

from embeddings.services.jobs import callback_targets
from embeddings.services.jobs.callback_targets import (
    CallbackAddressRefused,
    CallbackHostUnresolved,
    CallbackUrlInvalid,
    address_refusal,
    callback_target_resolve,
    parse_networks,
    resolve_host,
)

pytestmark = pytest.mark.unit

REFUSED_ADDRESSES = [
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "'this network'"),
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("10.1.2.3", "private, RFC 1918"),
    ("172.16.0.1", "private, RFC 1918"),
    ("172.31.255.255", "private, RFC 1918"),
    ("192.168.1.1", "private, RFC 1918"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("100.127.255.254", "carrier-grade NAT"),
    ("169.254.169.254", "link-local"),
    ("192.0.0.1", "IETF protocol assignments"),
    ("192.0.2.10", "documentation"),
    ("198.51.100.10", "documentation"),
    ("203.0.113.10", "documentation"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.1", "benchmarking"),
    ("192.88.99.1", "6to4 relay anycast"),  # `is_global` says True on 3.11
    ("224.0.0.1", "multicast"),  # `is_global` says True
    ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"),
    ("255.255.255.255", "broadcast"),
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("fe80::1", "link-local"),
    ("fe80::1%2", "link-local"),
    ("fc00::1", "unique local"),
    ("fd12:3456::1", "unique local"),
    ("fec0::1", "site-local"),  # `is_global` says True
    ("ff02::1", "multicast"),
    ("ff0e::1", "multicast"),  # global scope, still not unicast
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation, RFC 9637"),  # `is_global` says True on 3.11
    ("2001:2::1", "benchmarking"),
    ("2001::1", "Teredo"),
    ("100::1", "discard-only"),
    ("64:ff9b:1::1", "local-use NAT64"),
    ("::ffff:0:7f00:1", "IPv4-translated"),
    # IPv6 forms of refused IPv4 addresses.
    ("::ffff:127.0.0.1", "IPv4-mapped form of 127.0.0.1: loopback"),
    ("::ffff:10.0.0.1", "IPv4-mapped form of 10.0.0.1: private"),
    ("::ffff:169.254.169.254", "IPv4-mapped form of 169.254.169.254: link-local"),
    ("::ffff:0.0.0.0", "IPv4-mapped form of 0.0.0.0: unspecified"),
    ("64:ff9b::127.0.0.1", "NAT64 64:ff9b::/96 form of 127.0.0.1: loopback"),
    ("64:ff9b::a9fe:a9fe", "NAT64 64:ff9b::/96 form of 169.254.169.254: link-local"),
    ("2002:7f00:1::1", "6to4 form of 127.0.0.1: loopback"),
    ("2002:c0a8:101::1", "6to4 form of 192.168.1.1: private"),
    ("::127.0.0.1", "IPv4-compatible (deprecated by RFC 4291) form of 127.0.0.1"),
    ("::8.8.8.8", "IPv4-compatible (deprecated by RFC 4291) form of 8.8.8.8"),
]
PUBLIC_ADDRESSES = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.215.14",
    "2606:4700:4700::1111",
    "2a00:1450:4001:80b::200e",
    "::ffff:8.8.8.8",  # judged as the IPv4 address it is
    "64:ff9b::808:808",  # NAT64 of a public address
    "2002:808:808::1",  # 6to4 of a public address
]


@pytest.mark.parametrize(("address", "expected_class"), REFUSED_ADDRESSES)
def test_non_public_addresses_are_refused_and_named(address, expected_class):
    refusal = address_refusal(ipaddress.ip_address(address))
    assert refusal is not None and expected_class in refusal


@pytest.mark.parametrize("address", PUBLIC_ADDRESSES)
def test_public_unicast_addresses_are_allowed(address):
    assert address_refusal(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    ("address", "allowed", "refused"),
    [
        ("127.0.0.1", "127.0.0.1/32", False),
        ("127.0.0.2", "127.0.0.1/32", True),
        ("10.20.30.40", "10.0.0.0/8", False),
        ("10.20.30.40", "10.20.0.0/16,192.168.0.0/16", False),
        ("192.168.1.1", "10.0.0.0/8", True),
        ("::ffff:127.0.0.1", "127.0.0.1/32", False),  # the same host as 127.0.0.1
        ("::1", "127.0.0.1/32", True),  # loopback allowed for IPv4 only
        ("::1", "::1/128", False),
        ("fd00::5", "fd00::/8", False),
        # Never unicast destinations, whatever is allowed: 0.0.0.0 reaches this host.
        ("0.0.0.0", "0.0.0.0/0", True),
        ("::", "::/0", True),
        ("224.0.0.1", "224.0.0.0/4", True),
        ("255.255.255.255", "0.0.0.0/0", True),
    ],
)
def test_allowed_networks(address, allowed, refused):
    networks = parse_networks(allowed.split(","))
    assert (address_refusal(ipaddress.ip_address(address), networks) is not None) is refused


def test_allowed_networks_with_host_bits_set_are_an_error():
    with pytest.raises(ValueError, match="host bits set"):
        parse_networks(["127.0.0.1/8"])


# --- URLs: literal addresses (no resolver) ----------------------------------------------------------


def refuse_every_lookup(host: str, port: int, timeout_s: float) -> list[str]:
    pytest.fail(f"the resolver was asked for {host!r}: a literal address needs no lookup")


@pytest.mark.parametrize(
    ("url", "error", "reason"),
    [
        ("http://127.0.0.1:6390/", CallbackAddressRefused, "127.0.0.1 is not a public address (loopback)"),
        ("http://127.0.0.1:8080/admin/", CallbackAddressRefused, "loopback"),
        ("http://[::1]:8080/", CallbackAddressRefused, "::1 is not a public address (loopback)"),
        ("http://169.254.169.254/latest/meta-data/", CallbackAddressRefused, "link-local"),
        ("http://[fd00:ec2::254]/latest/meta-data/", CallbackAddressRefused, "unique local"),
        ("http://[::ffff:169.254.169.254]/", CallbackAddressRefused, "IPv4-mapped form of 169.254.169.254"),
        ("http://[::ffff:7f00:1]/", CallbackAddressRefused, "IPv4-mapped form of 127.0.0.1"),
        ("http://[64:ff9b::7f00:1]/", CallbackAddressRefused, "NAT64"),
        ("http://0.0.0.0:8080/", CallbackAddressRefused, "unspecified"),
        ("http://[::]:8080/", CallbackAddressRefused, "unspecified"),
        ("https://10.0.0.1/hook", CallbackAddressRefused, "private"),
        ("http://100.64.0.1/", CallbackAddressRefused, "carrier-grade NAT"),
        ("http://224.0.0.251:5353/", CallbackAddressRefused, "multicast"),
        # Odd spellings of 127.0.0.1 that inet_aton (and so getaddrinfo) or browsers accept.
        ("http://2130706433/", CallbackUrlInvalid, "ambiguous spelling of an IPv4 address"),
        ("http://0177.0.0.1/", CallbackUrlInvalid, "ambiguous spelling"),
        ("http://0x7f.1/", CallbackUrlInvalid, "ambiguous spelling"),
        ("http://0x7f000001/", CallbackUrlInvalid, "ambiguous spelling"),
        ("http://127.1/", CallbackUrlInvalid, "ambiguous spelling"),
        ("http://127.0.1/", CallbackUrlInvalid, "ambiguous spelling"),
        ("http://127.000.000.001/", CallbackUrlInvalid, "ambiguous spelling"),
        ("http://1.2.3.4.5/", CallbackUrlInvalid, "ambiguous spelling"),
        ("http://example.0x7f/", CallbackUrlInvalid, "ambiguous spelling"),
        # Full-width digits and dots: IDNA maps them to 127.0.0.1, which is then judged.
        (
            "http://\uff11\uff12\uff17\uff0e\uff10\uff0e\uff10\uff0e\uff11/",
            CallbackAddressRefused,
            "loopback",
        ),
        ("http://127.0.0.1./", CallbackUrlInvalid, "ends with a dot"),
        # Userinfo: the host is what follows the last "@" for some parsers and the first for others.
        ("http://good.example@127.0.0.1/", CallbackUrlInvalid, "credentials"),
        ("http://user:password@good.example/", CallbackUrlInvalid, "credentials"),
        ("http://127.0.0.1\\@good.example/", CallbackUrlInvalid, "credentials"),
        ("http://127.0.0.1%2f@good.example/", CallbackUrlInvalid, "credentials"),
        ("http://127%2e0%2e0%2e1/", CallbackUrlInvalid, "'%'"),
        ("http://[fe80::1%25eth0]/", CallbackUrlInvalid, "'%'"),
        ("http://[1::2::3]/", CallbackUrlInvalid, "cannot be parsed"),
        ("http://[127.0.0.1]/", CallbackUrlInvalid, ""),  # urlsplit refuses it, or we do (by version)
        ("http://8.8.8.8:0/", CallbackUrlInvalid, "port must be from 1 to 65535"),
        ("http://8.8.8.8:65536/", CallbackUrlInvalid, "port must be from 1 to 65535"),
        ("http://8.8.8.8:99999999/", CallbackUrlInvalid, "cannot read a host and port"),
        ("http://8.8.8.8:-1/", CallbackUrlInvalid, "cannot read a host and port"),
        ("http://8.8.8.8:/", CallbackUrlInvalid, "cannot read a host and port"),
        ("ftp://8.8.8.8/", CallbackUrlInvalid, "scheme must be http or https"),
        ("file:///etc/passwd", CallbackUrlInvalid, "scheme must be http or https"),
        ("gopher://127.0.0.1:6390/_INFO", CallbackUrlInvalid, "scheme"),
        ("//8.8.8.8/", CallbackUrlInvalid, "scheme"),
        ("http:///path", CallbackUrlInvalid, "no host"),
        ("http://8.8.8.8/a b", CallbackUrlInvalid, "spaces or control characters"),
        ("http://8.8.8.8/\r\nX-Injected: 1", CallbackUrlInvalid, "control characters"),
        ("http://8.8.8.8/caf\u00e9", CallbackUrlInvalid, "percent-encode"),
        ("http://-bad-.example/", CallbackUrlInvalid, "not a valid host name"),
        ("http://a..b/", CallbackUrlInvalid, "not a valid host name"),
        ("http://under_score.example/", CallbackUrlInvalid, "not a valid host name"),
        ("http://" + "a" * 64 + ".example/", CallbackUrlInvalid, "not a valid host name"),
        ("http://8.8.8.8/" + "x" * 2000, CallbackUrlInvalid, "longer than 2000"),
    ],
)
def test_refused_urls(url, error, reason):
    with pytest.raises(error) as refused:
        callback_target_resolve(url, resolver=refuse_every_lookup)
    assert reason in refused.value.reason


def test_a_public_literal_is_its_own_only_address():
    target = callback_target_resolve("https://8.8.8.8:8443/hooks/job?x=1#frag", resolver=refuse_every_lookup)
    assert target.addresses == (ipaddress.ip_address("8.8.8.8"),)
    assert (target.scheme, target.hostname, target.port) == ("https", "8.8.8.8", 8443)
    assert target.host_header == "8.8.8.8:8443"
    assert target.request_target == "/hooks/job?x=1"  # the fragment is never sent


def test_an_allowed_loopback_literal():
    target = callback_target_resolve(
        "http://127.0.0.1:9000/hook", allowed_networks=["127.0.0.1/32"], resolver=refuse_every_lookup
    )
    assert target.addresses == (ipaddress.ip_address("127.0.0.1"),)
    assert target.host_header == "127.0.0.1:9000"


# --- URLs: names (a fake resolver) ------------------------------------------------------------------


class TableResolver:
    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table
        self.asked: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int, timeout_s: float) -> list[str]:
        self.asked.append((host, port))
        if host not in self.table:
            raise CallbackHostUnresolved(f"{host} does not resolve")
        return self.table[host]


RESOLVER = TableResolver(
    {
        "hooks.example": ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"],
        "internal.example": ["10.0.0.7"],
        "mixed.example": ["93.184.215.14", "169.254.169.254"],  # one bad answer is enough
        "mapped.example": ["::ffff:127.0.0.1"],
        "xn--bcher-kva.example": ["93.184.215.15"],
        "rebind.example": ["127.0.0.1"],
        "garbage.example": ["not-an-address"],
        "empty.example": [],
    }
)


@pytest.mark.parametrize(
    ("url", "error", "reason"),
    [
        (
            "https://internal.example/hook",
            CallbackAddressRefused,
            "internal.example resolves to 10.0.0.7, which is not a public address (private, RFC 1918)",
        ),
        ("https://mixed.example/hook", CallbackAddressRefused, "169.254.169.254"),
        ("https://mapped.example/hook", CallbackAddressRefused, "IPv4-mapped form of 127.0.0.1"),
        ("https://rebind.example/hook", CallbackAddressRefused, "loopback"),
        ("https://HOOKS.example./hook", CallbackUrlInvalid, "ends with a dot"),
        ("https://nowhere.example/hook", CallbackHostUnresolved, "does not resolve"),
        ("https://garbage.example/hook", CallbackHostUnresolved, "not an address"),
        ("https://empty.example/hook", CallbackHostUnresolved, "no address"),
    ],
)
def test_refused_names(url, error, reason):
    with pytest.raises(error) as refused:
        callback_target_resolve(url, resolver=RESOLVER)
    assert reason in refused.value.reason


def test_a_public_name_keeps_every_address_and_its_own_host_header():
    target = callback_target_resolve("https://Hooks.Example/job-done", resolver=RESOLVER)
    assert [str(address) for address in target.addresses] == RESOLVER.table["hooks.example"]
    assert (target.hostname, target.host_header, target.port) == ("hooks.example", "hooks.example", 443)
    assert RESOLVER.asked[-1] == ("hooks.example", 443)


def test_international_names_are_looked_up_in_their_ascii_form():
    target = callback_target_resolve("http://b\u00fccher.example:8080/", resolver=RESOLVER)
    assert target.hostname == "xn--bcher-kva.example"
    assert target.host_header == "xn--bcher-kva.example:8080"


def test_an_internal_name_is_allowed_when_its_network_is():
    target = callback_target_resolve(
        "https://internal.example/hook", allowed_networks=["10.0.0.0/8"], resolver=RESOLVER
    )
    assert [str(address) for address in target.addresses] == ["10.0.0.7"]


# --- The system resolver (localhost only: /etc/hosts answers it) -----------------------------------


def test_the_system_resolver_answers_localhost_with_loopback_only():
    addresses = {ipaddress.ip_address(address) for address in resolve_host("localhost", 80, 5.0)}
    assert addresses and all(address.is_loopback for address in addresses)
    with pytest.raises(CallbackAddressRefused, match=r"localhost resolves to .* \(loopback\)"):
        callback_target_resolve("http://localhost:8080/", resolver=resolve_host)


def test_a_lookup_that_hangs_is_abandoned_at_its_timeout(monkeypatch):
    release = threading.Event()

    def hanging_getaddrinfo(*args, **kwargs):
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(callback_targets.socket, "getaddrinfo", hanging_getaddrinfo)
    try:
        with pytest.raises(CallbackHostUnresolved, match=r"did not resolve within 0\.2 s"):
            resolve_host("slow.example", 80, 0.2)
    finally:
        release.set()
