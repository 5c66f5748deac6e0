"""Signed envelopes: canonical bytes, key rotation, and what a signature covers."""

from __future__ import annotations

import pytest
from control_helpers import sign
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.config.sections import TrustedKey
from agent.control.controller import Controller, Identity, Incoming
from agent.control.envelope import (
    EnvelopeError,
    TrustedKeys,
    canonical,
    key_id,
    public_key_text,
)
from agent.control.store import CommandStore


def entry(key: Ed25519PrivateKey) -> TrustedKey:
    return TrustedKey(key_id(key.public_key()), public_key_text(key.public_key()))


def test_canonical_json_is_sorted_compact_utf8() -> None:
    assert canonical({"b": 1, "a": {"z": "é", "y": [1, 2]}}) == \
        '{"a":{"y":[1,2],"z":"é"},"b":1}'.encode()


def test_two_trusted_keys_at_once_for_rotation() -> None:
    old, new = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    keys = TrustedKeys.from_config([entry(old), entry(new)])
    assert keys.verify(sign(old, "ping", "all", {})) == key_id(old.public_key())
    assert keys.verify(sign(new, "ping", "all", {})) == key_id(new.public_key())
    retired = TrustedKeys.from_config([entry(new)])
    with pytest.raises(EnvelopeError) as caught:
        retired.verify(sign(old, "ping", "all", {}))
    assert caught.value.code == "unknown_key"


@pytest.mark.parametrize("field", ["id", "fleet", "command", "issued_at", "expires_at",
                                   "target", "args"])
def test_every_field_is_covered_by_the_signature(field: str) -> None:
    key = Ed25519PrivateKey.generate()
    envelope = sign(key, "apply-profile", "node:a", {"profile": "x"})
    envelope[field] = {"args": {"profile": "y"}}.get(field, 12345 if "at" in field else "z")
    with pytest.raises(EnvelopeError) as caught:
        TrustedKeys.from_config([entry(key)]).verify(envelope)
    assert caught.value.code == "bad_signature"


def test_replies_go_to_response_topics_only_under_the_operator_tree(tmp_path: object) -> None:
    from pathlib import Path

    key = Ed25519PrivateKey.generate()
    sent: list[tuple[str, str | None]] = []
    controller = Controller(
        Identity("lab", "n1"), TrustedKeys.from_config([entry(key)]), {"ping"},
        CommandStore(Path(str(tmp_path)) / "c.sqlite"),
        {"ping": lambda args, progress: {}},
        lambda t, body, rt, c, droppable=False: sent.append((t, rt)))
    import json

    for response in ("edge/v1/lab/operator/me/res", "edge/v1/lab/n2/cmd/ping",
                     "edge/v1/lab/operator/+/res"):  # a wildcard: paho cannot publish to it
        controller.on_message(Incoming(
            "edge/v1/lab/n1/cmd/ping", json.dumps(sign(key, "ping", "node:n1", {})).encode(),
            response_topic=response))
    assert sent == [("edge/v1/lab/n1/cmd/ping/res", "edge/v1/lab/operator/me/res"),
                    ("edge/v1/lab/n1/cmd/ping/res", None), ("edge/v1/lab/n1/cmd/ping/res", None)]


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path: object) -> None:
    import os
    import stat
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from agent.config import from_dict
    from agent.control.envelope import load_private_key

    out = Path(str(tmp_path)) / "operator.key"
    result = subprocess.run([sys.executable, "-m", "agent", "fleet", "keygen", "--out",
                             str(out)], capture_output=True, text=True, timeout=60,
                            check=True)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    snippet = yaml.safe_load(result.stdout[result.stdout.index("control:"):])
    config = from_dict(snippet)  # the printed entry is a valid config as it stands
    trusted = TrustedKeys.from_config(config.control.trusted_keys)
    assert trusted.verify(sign(load_private_key(out.read_bytes()), "ping", "all", {}))
    again = subprocess.run([sys.executable, "-m", "agent", "fleet", "keygen", "--out",
                            str(out)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists; --force replaces it" in again.stderr


def test_set_telemetry_takes_only_metric_groups_that_exist() -> None:
    from agent.control.schemas import check
    from agent.telemetry.groups import METRIC_GROUPS

    assert check("set-telemetry", {"metrics": ["cpu", "inference"]}) is None
    assert check("set-telemetry", {"metrics": "all"}) is None
    assert check("set-telemetry", {"metrics": list(METRIC_GROUPS)}) is None
    assert check("set-telemetry", {"metrics": ["cpu", "nosuch"]}) is not None


# -- issue 15: the canonical form, parsing, what junk can do ---------------------------------

VECTOR_SEED = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
VECTOR_BYTES = (
    b'{"args":{"guard":{"max_temp_c":85.5,"window_s":30},"profile":"jetson-orin-latency"},'
    b'"command":"apply-profile","expires_at":1767225660000,"fleet":"plant-7",'
    b'"id":"6f1c9e2a-vector-1","issued_at":1767225600000,"key_id":"56475aa75463474c",'
    b'"target":"group:line-a"}')
VECTOR_SIG = ("b/Rv6m8uEAMo0pCPOhFD6w+WMeRLlJ9Oz27P7jcXm19y34ID7fB9XAIaZyBl0U852W4fv5ZesBTpYIG"
              "MZRjDAg==")


def test_the_readme_test_vector_is_what_the_code_signs() -> None:
    """Other tools sign from the README: the vector there must stay the code's output."""
    from pathlib import Path

    from agent.control import envelope as product

    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(VECTOR_SEED))
    signed = product.sign(key, "apply-profile", "group:line-a",
                          {"profile": "jetson-orin-latency",
                           "guard": {"window_s": 30, "max_temp_c": 85.5}},
                          fleet="plant-7", now=1767225600.0, ttl_s=60,
                          command_id="6f1c9e2a-vector-1")
    assert product.signed_part(signed) == VECTOR_BYTES
    assert signed["sig"] == VECTOR_SIG
    assert TrustedKeys.from_config([entry(key)]).verify(signed) == "56475aa75463474c"
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for text in (VECTOR_SEED, VECTOR_BYTES.decode(), VECTOR_SIG, "56475aa75463474c",
                 public_key_text(key.public_key())):
        assert text in readme, text


def test_the_fleet_is_covered_by_the_signature() -> None:
    key = Ed25519PrivateKey.generate()
    envelope = sign(key, "ping", "all", {}, fleet="plant-7")
    assert envelope["fleet"] == "plant-7"
    with pytest.raises(EnvelopeError) as caught:
        TrustedKeys.from_config([entry(key)]).verify({**envelope, "fleet": "plant-8"})
    assert caught.value.code == "bad_signature"


@pytest.mark.parametrize(("payload", "why"), [
    (b"[" * 5000 + b"]" * 5000, "nested too deeply"),  # RecursionError inside json.loads
    (b'{"a":' * 40 + b"1" + b"}" * 40, "nested deeper than 32"),
    (b'{"interval_s": NaN}', "NaN is not a JSON number"),
    (b'{"interval_s": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"interval_s": 1e999}', "beyond a float's range"),
    (b'"\xc3"', "can't decode"),  # not UTF-8
])
def test_parse_refuses_what_would_raise_later_with_a_value_error(payload: bytes,
                                                                 why: str) -> None:
    from agent.control.envelope import parse

    with pytest.raises(ValueError, match=why):
        parse(payload)


def test_a_lone_surrogate_has_no_canonical_form_and_is_malformed() -> None:
    from agent.control.envelope import parse

    document = parse(b'{"id": "\\ud800", "args": {}}')  # valid JSON, no UTF-8 for it
    with pytest.raises(EnvelopeError) as caught:
        canonical(document)
    assert caught.value.code == "malformed"
    with pytest.raises(EnvelopeError):
        canonical({"x": float("nan")})


def test_integer_fields_refuse_floats_and_numbers_are_finite() -> None:
    from agent.control.schemas import check

    base = {"id": "a", "fleet": "lab", "command": "ping", "issued_at": 1, "expires_at": 2,
            "target": "all", "args": {}, "sig": "x"}
    assert check("envelope", base) is None
    for value in (1e300, 2.0, -1, 2 ** 53, True):
        assert check("envelope", {**base, "issued_at": value}) is not None, value
    assert check("set-telemetry", {"interval_s": float("nan")}) == \
        "data.interval_s must be a finite number"
    assert check("set-telemetry", {"interval_s": float("inf")}) is not None
    assert check("apply-profile", {"profile": "p", "guard": {"window_s": float("nan")}}) \
        is not None
    assert check("desired-envelope", {**base, "command": "desired", "clear": True}) is None
    assert check("envelope", {**base, "clear": True}) is not None  # only desired state


def test_publishable_topic_refuses_what_paho_would_raise_on() -> None:
    from agent.protocol import publishable_topic

    assert publishable_topic("edge/v1/lab/operator/me/res")
    for topic in ("", "edge/v1/lab/operator/+/res", "edge/v1/lab/operator/#",
                  "a\0b", "a\ud800", "x" * 65536, None, b"edge/v1"):
        assert not publishable_topic(topic), topic


def test_the_token_bucket_lets_bursts_through_and_cuts_floods_to_its_rate() -> None:
    from agent.control.audit import TokenBucket

    now = [0.0]
    bucket = TokenBucket(5.0, 20, clock=lambda: now[0])
    assert sum(bucket.take() for _ in range(1000)) == 20  # the burst, then nothing
    now[0] += 1.0
    assert sum(bucket.take() for _ in range(1000)) == 5  # a second's refill
    now[0] += 3600
    assert sum(bucket.take() for _ in range(1000)) == 20  # never more than the burst


def test_audit_records_are_one_json_line_whatever_the_values(
        caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    from agent.control.audit import record

    forged = "x\nWARNING agent.audit: accepted apply-profile id y from key k"
    with caplog.at_level(logging.INFO, logger="agent.audit"):
        record("rejected", logging.WARNING, id=forged, reason="\ud800", code=None)
    [line] = [r.getMessage() for r in caplog.records if r.name == "agent.audit"]
    assert "\n" not in line and json.loads(line) == {"event": "rejected", "id": forged,
                                                     "reason": "\ud800"}
