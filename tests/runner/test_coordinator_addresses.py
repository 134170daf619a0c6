"""``--server`` with one or several coordinator addresses: what :func:`parse_addresses` accepts, what it
refuses (naming the option and the entry), and which failures move a call to the next address."""

from __future__ import annotations

import grpc
import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.runner.transport.addresses import CoordinatorAddress, fails_over, parse_addresses


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8443", [("127.0.0.1:8443", "127.0.0.1", 8443)]),
        (
            "coord-a.example:8443, coord-b.example:9443",
            [
                ("coord-a.example:8443", "coord-a.example", 8443),
                ("coord-b.example:9443", "coord-b.example", 9443),
            ],
        ),
        ("[::1]:8443,", [("[::1]:8443", "::1", 8443)]),
        ("dns:///fedlink.internal:8443", [("dns:///fedlink.internal:8443", "fedlink.internal", 8443)]),
        (
            "dns://10.0.0.2:53/fedlink.internal:8443",
            [("dns://10.0.0.2:53/fedlink.internal:8443", "fedlink.internal", 8443)],
        ),
    ],
)
def test_addresses_are_read_in_order(text: str, expected: list[tuple[str, str, int]]) -> None:
    assert parse_addresses(text) == tuple(CoordinatorAddress(*item) for item in expected)


def test_a_sequence_of_lists_is_one_list() -> None:
    parsed = parse_addresses(["a:1,b:2", "c:3"])
    assert [address.text for address in parsed] == ["a:1", "b:2", "c:3"]


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("", "no coordinator address given"),
        (" , ", "no coordinator address given"),
        ("coord.example", "'coord.example' is not host:port"),
        ("a:1,b", "'b' is not host:port"),
        ("a:0", "'a:0' is not host:port"),
        ("a:70000", "'a:70000' is not host:port"),
        ("::1:8443", "put an IPv6 address in brackets"),
        ("a:1,a:1", "a:1 is listed twice"),
        ("http://a:1", "is not host:port"),
    ],
)
def test_bad_lists_are_refused_naming_the_option_and_entry(text: str, complaint: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        parse_addresses(text, what="--server")
    assert str(refused.value).startswith("--server: "), refused.value
    assert complaint in str(refused.value), refused.value


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda code: code.name)
def test_only_unreachable_and_unanswered_calls_fail_over(code: grpc.StatusCode) -> None:
    assert fails_over(code) is (code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))
