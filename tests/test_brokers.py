"""The broker list: ``mqtt.brokers`` in the config, each node's order, each member's
backoff, and which redirects are followed (``agent.link.brokers``)."""

from __future__ import annotations

from collections import Counter

import pytest
from test_telemetry_collectors import Clock

from agent.config.loader import ConfigError, from_dict
from agent.link.brokers import Brokers, Member, parse_member


@pytest.mark.parametrize(("text", "parsed"), [
    ("mqtt-a.example:1883", ("mqtt-a.example", 1883)),
    ("10.0.0.7:8883", ("10.0.0.7", 8883)),
    ("[2001:db8::1]:8883", ("2001:db8::1", 8883)),
    ("[::1]:1", ("::1", 1)),
    ("broker_1:65535", ("broker_1", 65535)),
    ("mqtt-a.example", None),  # no port
    ("mqtt-a.example:0", None),
    ("mqtt-a.example:65536", None),
    ("mqtt-a.example:-1", None),
    ("mqtt-a.example:\uff11\uff18\uff18\uff13", None),  # digits, but not ASCII ones
    ("2001:db8::1:8883", None),  # IPv6 without brackets is ambiguous
    ("[mqtt-a]:1883", None),
    ("[2001:db8::1]", None),
    (":1883", None),
    ("a..b:1883", None),
    ("-a:1883", None),
    ("a b:1883", None),
    ("a/b:1883", None),
    (1883, None),
])
def test_a_member_is_host_colon_port(text: object, parsed: tuple[str, int] | None) -> None:
    assert parse_member(text) == parsed


def test_the_config_takes_a_list_of_members_and_never_both_forms() -> None:
    config = from_dict({"mqtt": {"brokers": ["a.example:1883", "[::1]:1884"]}})
    assert config.mqtt.brokers == ("a.example:1883", "[::1]:1884")
    assert config.mqtt.members == ("a.example:1883", "[::1]:1884")
    assert from_dict({"mqtt": {"host": "b.example", "port": 8883}}).mqtt.members == (
        "b.example:8883",)
    with pytest.raises(ConfigError) as both:
        from_dict({"mqtt": {"brokers": ["a.example:1883"], "host": "b.example"}}, "agent.yaml")
    assert str(both.value) == ("agent.yaml: mqtt.brokers: give either mqtt.brokers or "
                               "mqtt.host/mqtt.port, not both (mqtt.host 'b.example' given too)")
    with pytest.raises(ConfigError, match=r"mqtt.port 1884 given too"):
        from_dict({"mqtt": {"brokers": ["a.example:1883"], "port": 1884}})
    for bad, named in [([], "a list of 1 to 16"), (["a.example"], "'a.example' is not"),
                       (["a:1", "A:1"], "'A:1' is listed twice"),
                       (["[::1]:1", "[0::1]:1"], "'[0::1]:1' is listed twice"),
                       ([f"b{n}:1883" for n in range(17)], "a list of 1 to 16"),
                       ("a.example:1883", "a list of")]:
        with pytest.raises(ConfigError, match=r"^agent.yaml: mqtt.brokers: .*") as error:
            from_dict({"mqtt": {"brokers": bad}}, "agent.yaml")
        assert named in str(error.value)


def members(count: int) -> list[tuple[str, int]]:
    return [(f"b{index}.example", 1883) for index in range(count)]


def test_each_node_has_its_own_stable_order_and_a_fleet_spreads() -> None:
    listed = members(3)
    first = Brokers(listed, "node-1", 0.5, 30)
    again = Brokers(listed, "node-1", 0.5, 30)
    assert [str(m) for m in first.members] == [str(m) for m in again.members]
    orders = Counter(tuple(str(m) for m in Brokers(listed, f"node-{n}", 0.5, 30).members)
                     for n in range(1200))
    starts = Counter(order[0] for order in orders.elements())
    # every member is first for about a third of the fleet, and the nodes of a dead member
    # continue on each of the others: all six orders occur, each about a sixth of the time
    assert len(starts) == 3 and all(300 <= count <= 500 for count in starts.values())
    assert len(orders) == 6 and all(130 <= count <= 270 for count in orders.values())


def test_a_failed_member_backs_off_while_the_next_is_tried_at_once() -> None:
    clock = Clock()
    brokers = Brokers(members(3), "node-1", 1.0, 8.0, clock)
    a, b, c = brokers.members
    assert brokers.next() == (a, 0.0)
    brokers.ended(a, healthy=False)  # a connect failure: the next member at once
    assert brokers.next() == (b, 0.0)
    brokers.ended(b, healthy=False)
    assert brokers.next() == (c, 0.0)
    brokers.ended(c, healthy=False)
    member, wait = brokers.next()  # every member backs off: the one that ends first
    assert member is min((a, b, c), key=lambda m: m.retry_at) and 0 < wait <= 1.0
    for _ in range(6):  # a keeps failing: its backoff doubles up to the ceiling
        brokers.ended(a, healthy=False)
    assert a.failures == 7 and 4.0 <= a.retry_at - clock.now <= 8.0
    clock.now += 1.0
    assert brokers.next()[0] in (b, c)  # whose backoff is over, not the dead a


def test_after_a_lost_connection_the_next_member_waits_a_jitter_only() -> None:
    clock = Clock()
    brokers = Brokers(members(2), "node-1", 0.5, 30, clock)
    a, b = brokers.members
    a.failures = 5  # from before it was accepted
    brokers.next()
    brokers.ended(a, healthy=True)  # the connection worked, then was lost
    assert a.failures == 1 and a.retry_at - clock.now <= 0.5  # its backoff starts again
    member, wait = brokers.next()
    assert member is b and 0 <= wait <= 0.5


def test_one_broker_reconnects_as_before() -> None:
    clock = Clock()
    brokers = Brokers([("localhost", 1883)], "node-1", 0.5, 30, clock)
    (only,) = brokers.members
    brokers.ended(only, healthy=True)
    member, wait = brokers.next()
    assert member is only and 0.25 <= wait <= 0.5


def test_a_redirect_is_followed_once_and_only_to_a_listed_member() -> None:
    brokers = Brokers(members(3), "node-1", 0.5, 30, Clock())
    a, b, c = brokers.members
    assert brokers.next()[0] is a
    refused = brokers.redirect(a, "evil.example:1883")
    assert refused == "'evil.example:1883' is not another member of mqtt.brokers"
    assert brokers.redirect(a, None) == "it names no server (no Server Reference)"
    assert isinstance(brokers.redirect(a, str(a)), str)  # itself
    # the first listed reference wins; no port: the redirecting member's
    assert brokers.redirect(a, f"evil.example:1 {c.host.upper()} {b}") is c
    brokers.ended(a, healthy=False)
    assert brokers.next() == (c, 0.0)  # at once, although a failed
    # c was reached by a redirect: its own redirect is not followed (no loops, no chains)
    assert brokers.redirect(c, str(b)) == (f"{c} was reached by a redirect, and a redirect "
                                           "is followed once")
    brokers.ended(c, healthy=False)
    assert brokers.next()[0] is b  # the order goes on from c
    assert brokers.redirect(b, "[2001:db8::1]:1883 " + "x" * 70_000).startswith("'[2001")


def test_a_member_is_written_as_the_config_writes_it() -> None:
    assert str(Member("2001:db8::1", 8883)) == "[2001:db8::1]:8883"
    assert str(Member("a.example", 1883)) == "a.example:1883"
