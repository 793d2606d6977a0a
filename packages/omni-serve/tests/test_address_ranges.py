"""The remote-image address check at the edges of every range it refuses that Python's
``is_global`` does not (on some version): the first and last address inside, and the
neighbours outside, directly and as the IPv6 forms that embed an IPv4 address (6to4,
NAT64, IPv4-mapped)."""

from __future__ import annotations

import ipaddress

import pytest
from omni_serve.media import NOT_GLOBAL, address_allowed

# (network, the neighbour below, is it allowed?, the neighbour above, is it allowed?):
# a neighbour that is itself internal for another reason says so
EDGES = [
    ("100.64.0.0/10", "100.63.255.255", True, "100.128.0.0", True),
    ("192.88.99.0/24", "192.88.98.255", True, "192.88.100.0", True),
    ("::/96", None, None, "::1:0:0", False),  # above: ::/8, reserved
    ("::ffff:0:0:0/96", "::fffe:ffff:ffff:ffff", False, "::ffff:1:0:0", False),  # ::/8
    ("64:ff9b:1::/48", "64:ff9b:0:ffff:ffff:ffff:ffff:ffff", False, "64:ff9b:2::", False),
    ("2001::/32", "2000:ffff:ffff:ffff:ffff:ffff:ffff:ffff", True, "2001:1::", False),
    ("2001:db8::/32", "2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", True, "2001:db9::", True),
    ("3fff::/20", "3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff", True, "3fff:1000::", True),
    ("fec0::/10", "febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", False, "ff00::", False),
]
# internal neighbours: "2001:1::" (2001::/23, IETF protocol assignments), "febf:..."
# (fe80::/10, link-local), "ff00::" (multicast), the others (::/8, reserved)


def allowed(text: str) -> bool:
    return address_allowed(ipaddress.ip_address(text))


@pytest.mark.parametrize(("net", "below", "below_ok", "above", "above_ok"), EDGES)
def test_each_range_is_refused_from_its_first_to_its_last_address(
    net, below, below_ok, above, above_ok
):
    n = ipaddress.ip_network(net)
    assert n in NOT_GLOBAL
    assert not allowed(str(n[0])) and not allowed(str(n[-1])), net
    if below is not None:
        assert int(ipaddress.ip_address(below)) == int(n[0]) - 1
        assert allowed(below) is below_ok, below
    assert int(ipaddress.ip_address(above)) == int(n[-1]) + 1
    assert allowed(above) is above_ok, above
    # --remote-images-allow opens it
    assert address_allowed(n[-1], (n,))


def test_every_refused_range_is_tested():
    assert {ipaddress.ip_network(e[0]) for e in EDGES} == set(NOT_GLOBAL)


# embedded IPv4 networks (first, last, the neighbours outside, public)
PRIVATE_V4 = [
    ("10.0.0.0", "10.255.255.255", "9.255.255.255", "11.0.0.0"),
    ("172.16.0.0", "172.31.255.255", "172.15.255.255", "172.32.0.0"),
    ("192.168.0.0", "192.168.255.255", "192.167.255.255", "192.169.0.0"),
    ("127.0.0.0", "127.255.255.255", "126.255.255.255", "128.0.0.0"),
    ("169.254.0.0", "169.254.255.255", "169.253.255.255", "169.255.0.0"),
    ("100.64.0.0", "100.127.255.255", "100.63.255.255", "100.128.0.0"),
]


def six_to_four(v4: str) -> str:
    return str(ipaddress.IPv6Address((0x2002 << 112) | (int(ipaddress.IPv4Address(v4)) << 80)))


def nat64(v4: str) -> str:
    return str(ipaddress.ip_address(f"64:ff9b::{v4}"))


def mapped(v4: str) -> str:
    return str(ipaddress.ip_address(f"::ffff:{v4}"))


@pytest.mark.parametrize("form", [six_to_four, nat64, mapped, str])
@pytest.mark.parametrize(("first", "last", "below", "above"), PRIVATE_V4)
def test_an_ipv6_form_is_judged_by_the_ipv4_address_it_embeds(form, first, last, below, above):
    assert not allowed(form(first)) and not allowed(form(last)), form(first)
    assert allowed(form(below)) and allowed(form(above)), form(below)


def test_site_local_is_refused_although_python_calls_it_global():
    ip = ipaddress.ip_address("fec0::1")
    assert not address_allowed(ip)
    assert address_allowed(ip, (ipaddress.ip_network("fec0::/10"),))
