"""The wire vocabulary both ends share: topics parse back to what built them, and a reply
split into chunks is put back together exactly."""

from __future__ import annotations

from agent import protocol
from agent.telemetry.records import encode


def test_topics_parse_back_into_their_parts() -> None:
    root = protocol.node_root("lab", "orin-1")
    assert root == "edge/v1/lab/orin-1"
    assert protocol.node_topic("lab", protocol.topic(root, protocol.STATE)) == ("orin-1",
                                                                              "state")
    assert protocol.node_topic("lab", protocol.topic(root, protocol.reply_suffix("ping"))) \
        == ("orin-1", "cmd/ping/res")
    assert protocol.node_topic("lab", "edge/v1/lab/all/cmd/ping") is None
    assert protocol.node_topic("lab", "edge/v1/lab/group/a/desired") is None
    assert protocol.node_topic("lab", "edge/v1/other/orin-1/state") is None
    group = protocol.scope_root("lab", protocol.group_scope("line-a"))
    assert protocol.command_of(protocol.topic(group, protocol.command_suffix("ping"))) == (
        "edge/v1/lab/group/line-a", "ping")
    assert protocol.command_of(protocol.topic(root, protocol.reply_suffix("ping"))) is None
    assert protocol.desired_of(protocol.topic(group, protocol.DESIRED)) == group
    assert protocol.desired_of(protocol.topic(root, protocol.REPORTED)) is None
    assert protocol.each_node("lab", protocol.TELEMETRY) == "edge/v1/lab/+/telemetry"
    assert protocol.target_of("group:line-a") == ("group:line-a", "group/line-a")
    assert protocol.target_of("orin-1") == ("node:orin-1", "orin-1")
    assert protocol.target_of("all") == ("all", "all")


def test_a_large_result_goes_in_chunks_that_fit_and_reassemble() -> None:
    result = {"rows": [{"cpu": i, "text": "x" * 50} for i in range(400)]}
    body = {"schema": protocol.REPLY_SCHEMA, "id": "c1", "status": protocol.SUCCEEDED,
            "result": result}
    limit = 4096
    parts = protocol.chunked(body, limit)
    assert len(parts) > 1
    assert all(len(encode(part)) <= limit and "result" not in part for part in parts)
    assert [p["chunk"]["index"] for p in parts] == list(range(len(parts)))
    chunks: dict[int, str] = {}
    assembled = [protocol.reassembled(chunks, part) for part in reversed(parts)]
    assert assembled[:-1] == [None] * (len(parts) - 1)  # in any order, whole at the last
    whole = assembled[-1]
    assert whole is not None and whole["result"] == result and whole["id"] == "c1"


def test_a_reply_that_fits_goes_as_it_is() -> None:
    body = {"id": "c2", "status": protocol.ACCEPTED}
    assert protocol.chunked(body, 1024) == [body]
    assert protocol.reassembled({}, body) is body
