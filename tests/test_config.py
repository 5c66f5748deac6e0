"""The agent's configuration: defaults for every key, errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_process import modules_loaded_by
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.config import ConfigError, from_dict, load_config
from agent.config.sections import GuardConfig, TrustedKey
from agent.control.envelope import public_key_text
from agent.control.schemas import COMMANDS
from agent.discovery import discover
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.kernel.fsroot import Root
from agent.service.commands import ServiceCommands
from agent.telemetry.collectors import COLLECTOR_GROUPS, build_collectors

FIXTURES = Path(__file__).parent / "fixtures"
KEY = public_key_text(Ed25519PrivateKey.generate().public_key())


def test_an_empty_file_runs_the_built_in_demo(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("")
    config = load_config(str(path))
    assert config.inference.model == str(DEMO_MODEL_PATH)
    assert (config.mqtt.host, config.mqtt.port, config.mqtt.protocol) == ("localhost", 1883, "5")
    assert config.telemetry.interval_s == 1.0
    assert config.telemetry.outbox_max_bytes == 64 * 1024 * 1024
    assert config.telemetry.outbox_max_age_s == 168 * 3600
    assert config.tuning.profile == "auto" and config.tuning.apply is False
    assert config.topic_root == f"edge/v1/default/{config.node_id}"
    assert config.prometheus_listen is None and config.home_assistant_enabled is False


def test_values_merge_over_the_defaults() -> None:
    config = from_dict({"fleet": "plant-7", "mqtt": {"port": 8883, "tls": {"ca": "/ca.pem"}},
                        "telemetry": {"metrics": ["cpu", "thermal"]}})
    assert config.mqtt.port == 8883 and config.mqtt.host == "localhost"
    assert config.mqtt.tls is not None and config.mqtt.tls.ca == "/ca.pem"
    assert config.telemetry.metrics == ("cpu", "thermal")
    assert config.telemetry.interval_s == 1.0


@pytest.mark.parametrize(("document", "key", "allowed"), [
    ({"mqtt": {"prot": 1}}, "mqtt.prot", "unknown key (allowed: host, port"),
    ({"mqtt": {"port": "1883"}}, "mqtt.port", "expected an integer 1..65535"),
    ({"node_id": "a/b"}, "node_id", "no MQTT wildcards or '/'"),
    ({"mqtt": {"protocol": 3}}, "mqtt.protocol", "one of 5, 3.1.1"),
    ({"telemetry": {"interval_s": 0}}, "telemetry.interval_s", "a number 0.05"),
    ({"inference": {"sha256": "abc"}}, "inference.sha256", "64 lower-case hex digits"),
    ({"control": {"allow": ["reboot"]}}, "control.allow", "command names from ping"),
    ({"mqtt": {"tls": {"cert": "/c.pem"}}}, "mqtt.tls", "cert and key go together"),
    ({"mqtt": {"tls": {"ca": "/a", "pem": "/b"}}}, "mqtt.tls.pem", "unknown key"),
    ({"mqtt": {"password_file": "/p"}}, "mqtt.password_file", "needs mqtt.username"),
    ({"mqtt": {"reconnect": {"min_s": 10, "max_s": 1}}}, "mqtt.reconnect.min_s", "above max_s"),
    ({"prometheus": {"listen": "9101"}}, "prometheus.listen", "host:port"),
    ({"mqtt": {True: 1}}, "mqtt.true", "unknown key (allowed: host, port"),
    ({"telemetry": {"metrics": ["cpu", "thermals"]}}, "telemetry.metrics",
     "expected all, or a list of cpu, load, memory, swap, psi, cgroup, thermal, power, fans, "
     "gpus, npus, block, net, thp, inference, tuning, outbox, link, control, qos ('thermals' is "
     "not a metric group)"),
    ({"qos": {"mode": "on"}}, "qos.mode", "expected one of off, advise, control"),
    ({"qos": {"window_s": 0}}, "qos.window_s", "a number 0.1"),
    ({"telemetry": {"interval_s": float("nan")}}, "telemetry.interval_s", "a number 0.05"),
    ({"control": {"max_skew_s": float("inf")}}, "control.max_skew_s", "a number 0"),
    ({"control": {"guard": {"window_s": float("nan")}}}, "control.guard.window_s", "a number"),
    ({"control": {"desired_max_ttl_s": 0}}, "control.desired_max_ttl_s", "a number 1"),
    ({"control": {"accept_unbound_envelopes": "yes"}}, "control.accept_unbound_envelopes",
     "true or false"),
    ({"telemetry": {"metrics": "cpu"}}, "telemetry.metrics", "expected all, or a list of cpu,"),
    ({"telemetry": {"metrics": [["cpu"]]}}, "telemetry.metrics", "(['cpu'] is not a metric"),
    ({"serve": {"max_inflight_mb": 32}}, "serve.max_inflight_mb",
     "32 is below serve.max_request_mb 64"),
    ({"serve": {"max_inflight_mb": 0}}, "serve.max_inflight_mb", "a number 1"),
    ({"serve": {"privileged_priority": -1}}, "serve.privileged_priority", "0"),
    ({"serve": {"http_max_connections": 0}}, "serve.http_max_connections", "1"),
    ({"serve": {"http_header_timeout_s": 0}}, "serve.http_header_timeout_s", "0.1"),
])
def test_bad_values_name_the_file_and_key(tmp_path: Path, document: dict[str, object],
                                          key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_dict(document, "/etc/edge-agent/agent.yaml")
    assert caught.value.key == key
    assert str(caught.value).startswith(f"/etc/edge-agent/agent.yaml: {key}: ")
    assert allowed in caught.value.message


def test_unreadable_and_invalid_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("mqtt: [\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(str(broken))
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n")
    with pytest.raises(ConfigError, match="a YAML mapping of sections"):
        load_config(str(listed))


@pytest.mark.parametrize(("document", "message"), [
    ({"tuning": {"apply": "yes"}}, "'yes' is not allowed: expected true or false"),
    ({"inference": {"enabled": 1}}, "1 is not allowed: expected true or false"),
    ({"mqtt": {"port": True}}, "true is not allowed: expected an integer 1..65535"),
    ({"mqtt": {"host": None}}, "null is not allowed: expected a host name or address"),
    ({"inference": {"providers": ["CPUExecutionProvider", None]}},
     "['CPUExecutionProvider', null] is not allowed: expected auto, or a list"),
])
def test_values_are_described_in_yaml_words_not_python_reprs(
        document: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_dict(document, "agent.yaml")
    assert caught.value.message.startswith(message)
    assert "True" not in caught.value.message and "None" not in caught.value.message


def test_mqtt_protocol_5_may_be_written_unquoted(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("mqtt: {protocol: 5}\n")
    assert load_config(str(path)).mqtt.protocol == "5"
    assert from_dict({"mqtt": {"protocol": "3.1.1"}}).mqtt.protocol == "3.1.1"
    for wrong in (3, 5.0, True):
        with pytest.raises(ConfigError, match=r"mqtt\.protocol: .* expected one of 5, 3\.1\.1"):
            from_dict({"mqtt": {"protocol": wrong}})


def test_the_collector_groups_are_the_registry_s_collectors() -> None:
    """The names telemetry.metrics accepts are those of the collectors that run (the
    service's own groups are checked against a real agent's record in test_service)."""
    root = Root(FIXTURES / "jetson-agx-orin-jp6")
    keys = tuple(c.key for c in build_collectors(root, discover(root)))
    assert keys == COLLECTOR_GROUPS


def test_control_is_typed_and_its_guard_merges_over_the_defaults() -> None:
    control = from_dict({"control": {
        "trusted_keys": [{"id": "ops", "public_key": KEY}], "model_dirs": ["/models"],
        "guard": {"window_s": 3, "max_temp_c": 85}}}).control
    assert control.trusted_keys == (TrustedKey("ops", KEY),)
    assert control.model_dirs == ("/models",)
    assert control.guard == GuardConfig(window_s=3, max_p99_ratio=1.5, max_error_rate=0.003,
                                        max_temp_c=85, canary_s=5)
    assert (control.enabled, control.max_payload_kb, control.max_skew_s) == (True, 16, 30)


def test_a_trusted_key_without_its_public_key_is_named() -> None:
    with pytest.raises(ConfigError) as caught:
        from_dict({"control": {"trusted_keys": [{"id": "ops"}]}}, "agent.yaml")
    assert str(caught.value) == "agent.yaml: control.trusted_keys[0]: missing public_key"


def test_the_commands_are_listed_once() -> None:
    """control.allow (its check and its default), the argument schemas and the service's
    handler table name the same commands."""
    assert from_dict({}).control.allow == COMMANDS
    # The table only binds methods: built without a running service.
    assert sorted(ServiceCommands.__new__(ServiceCommands).handlers()) == sorted(COMMANDS)
    with pytest.raises(ConfigError) as caught:
        from_dict({"control": {"allow": ["ping", "reboot"]}})
    assert caught.value.message.endswith("command names from " + ", ".join(COMMANDS))
    # The registry is plain data: checking control.allow compiles no JSON Schema.
    assert modules_loaded_by("from agent.config import from_dict; "
                             "from_dict({'control': {'allow': ['ping']}})",
                             "fastjsonschema") == []


def test_yaml_nan_and_infinity_are_refused_where_a_number_is_expected(tmp_path: Path) -> None:
    """YAML spells them .nan and .inf; a NaN health window would keep any change."""
    for text in ("telemetry: {interval_s: .nan}", "control: {guard: {window_s: .inf}}",
                 "control: {guard: {max_p99_ratio: -.inf}}"):
        path = tmp_path / "agent.yaml"
        path.write_text(text + "\n")
        with pytest.raises(ConfigError, match="is not allowed: expected a number"):
            load_config(str(path))


def test_a_bare_off_is_qos_mode_off_and_an_exponent_without_a_dot_says_how_to_write_it(
        tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML) reads a bare off as false and 2e1 as text: the README spells the
    mode ``off`` unquoted, and 2e1 was refused as "expected a number" with no word why."""
    path = tmp_path / "agent.yaml"
    path.write_text("qos:\n  mode: off\n")
    assert load_config(str(path)).qos.mode == "off"
    path.write_text("qos:\n  mode: on\n")  # true: no mode is spelled so
    with pytest.raises(ConfigError, match=r"qos\.mode: true is not allowed: expected one of off"):
        load_config(str(path))
    path.write_text("qos:\n  window_s: 2e1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    assert caught.value.message.endswith(
        "(YAML reads 2e1 as text: write 20, or 2.0e+1)"), caught.value.message
    path.write_text("qos:\n  window_s: 2.0e+1\n")
    assert load_config(str(path)).qos.window_s == 20.0


def test_the_fleet_binding_keys_have_safe_defaults() -> None:
    control = from_dict({}).control
    assert control.accept_unbound_envelopes is False
    assert control.desired_max_ttl_s == 365 * 86400.0
    assert from_dict({"control": {"desired_max_ttl_s": 86400}}).control.desired_max_ttl_s \
        == 86400.0
