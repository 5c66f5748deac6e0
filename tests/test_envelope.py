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


@pytest.mark.parametrize("field", ["id", "command", "issued_at", "expires_at", "target",
                                   "args"])
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
        {"ping": lambda args, progress: {}}, lambda t, body, rt, c: sent.append((t, rt)))
    import json

    for response in ("edge/v1/lab/operator/me/res", "edge/v1/lab/n2/cmd/ping"):
        controller.on_message(Incoming(
            "edge/v1/lab/n1/cmd/ping", json.dumps(sign(key, "ping", "node:n1", {})).encode(),
            response_topic=response))
    assert sent == [("edge/v1/lab/n1/cmd/ping/res", "edge/v1/lab/operator/me/res"),
                    ("edge/v1/lab/n1/cmd/ping/res", None)]


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
