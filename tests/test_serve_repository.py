"""The model repository on disk: Triton's layout, built-in entries, each config.yaml key's
checks (the message names the file and the key) and the version policies."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.serving.repository import scan, scan_model, valid_name
from agent.serving.settings import (
    Instance,
    ModelSettingsError,
    Qos,
    VersionPolicy,
    parse_settings,
    read_settings,
)

HEX = "ab" * 32


def version(repo: Path, model: str, number: str, content: bytes = b"onnx") -> Path:
    path = repo / model / number / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def config(repo: Path, model: str, text: str) -> Path:
    path = repo / model / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_versions_are_positive_integer_directories_holding_model_onnx(tmp_path: Path) -> None:
    v1 = version(tmp_path, "m", "1")
    v3 = version(tmp_path, "m", "3")
    version(tmp_path, "m", "0")
    version(tmp_path, "m", "01")  # not version 1 a second time
    version(tmp_path, "m", "latest")
    (tmp_path / "m" / "2").mkdir()  # no model file: not a version
    (tmp_path / "m" / "7").write_text("a file")
    entry = scan_model(tmp_path, {}, "m")
    assert entry is not None
    assert entry.error == ""
    assert dict(entry.versions) == {1: v1, 3: v3}
    assert entry.wanted() == {3: v3}  # default policy: latest 1


def test_scan_ignores_files_dotfiles_and_bad_names(tmp_path: Path) -> None:
    version(tmp_path, "good-1.a_b", "1")
    version(tmp_path, ".hidden", "1")
    version(tmp_path, "bad name", "1")
    version(tmp_path, "x" * 65, "1")
    (tmp_path / "README.md").write_text("not a model")
    assert list(scan(tmp_path, {})) == ["good-1.a_b"]
    assert scan_model(tmp_path, {}, ".hidden") is None
    assert scan_model(tmp_path, {}, "../etc") is None
    assert scan_model(tmp_path, {}, "absent") is None


def test_valid_names() -> None:
    assert valid_name("demo") and valid_name("a.b-c_9") and valid_name("x" * 64)
    for name in ("", ".x", "a/b", "x" * 65, "é", "a b"):
        assert not valid_name(name), name


def test_builtin_is_version_1_and_the_repository_adds_versions(tmp_path: Path) -> None:
    builtin = tmp_path / "demo.onnx"
    builtin.write_bytes(b"demo")
    repo = tmp_path / "repo"
    v2 = version(repo, "demo", "2")
    version(repo, "demo", "1")  # the built-in file stays version 1
    config(repo, "demo", "version_policy: all\n")
    entries = scan(repo, {"demo": builtin, "other": builtin})
    assert sorted(entries) == ["demo", "other"]
    assert dict(entries["demo"].versions) == {1: builtin, 2: v2}
    assert entries["demo"].wanted() == {1: builtin, 2: v2}
    assert dict(entries["other"].versions) == {1: builtin}


def test_a_missing_repository_still_lists_the_builtins(tmp_path: Path) -> None:
    builtin = tmp_path / "demo.onnx"
    builtin.write_bytes(b"demo")
    assert list(scan(tmp_path / "absent", {"demo": builtin})) == ["demo"]


def test_a_bad_model_is_listed_with_its_reason_and_never_raises(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    version(tmp_path, "badyaml", "1")
    config(tmp_path, "badyaml", "max_batch_size: [\n")
    version(tmp_path, "badkey", "1")
    config(tmp_path, "badkey", "colour: blue\n")
    version(tmp_path, "nopick", "1")
    config(tmp_path, "nopick", "version_policy: {specific: [4]}\n")
    entries = scan(tmp_path, {})
    assert "holds no version directory with model.onnx" in entries["empty"].error
    assert entries["badyaml"].error.startswith(f"{tmp_path / 'badyaml' / 'config.yaml'}: "
                                               "not valid YAML")
    assert entries["badkey"].error == (f"{tmp_path / 'badkey' / 'config.yaml'}: colour: "
                                       "unknown key (allowed: max_batch_size, version_policy, "
                                       "instances, dynamic_batching, providers, precision, "
                                       "sha256, max_run_ms, max_input_elements, qos)")
    assert entries["nopick"].error == "version_policy {specific: [4]} selects none of the " \
        "versions 1"


def test_settings_defaults(tmp_path: Path) -> None:
    settings = read_settings(tmp_path / "absent.yaml")
    assert settings.max_batch_size is None
    assert settings.version_policy == VersionPolicy("latest", 1)
    assert settings.instances == (Instance(1, "auto", None),)
    assert settings.dynamic_batching is None and settings.providers is None
    assert settings.precision == "fp32" and dict(settings.sha256) == {}
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert read_settings(empty) == settings


def test_every_key_accepts_its_values() -> None:
    settings = parse_settings({
        "max_batch_size": 8,
        "version_policy": {"specific": [3, 2, 3]},
        "instances": [{"count": 2, "device": "cpu", "threads": 2},
                      {"device": "gpu:0"}, {"device": "dla:1"}, {"device": "npu:2"}],
        "dynamic_batching": {"max_queue_delay_us": 500, "preferred_batch_size": [4, 8],
                             "priority_levels": 2, "default_priority_level": 2,
                             "queue": {"max_size": 64, "timeout_us": 100000,
                                       "allow_timeout_override": True}},
        "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
        "precision": "fp32",
        "sha256": {1: HEX, 2: HEX},
        "qos": {"class": "latency_critical", "p99_ms": 2.5, "min_rps": 40},
    }, "c.yaml")
    assert settings.max_batch_size == 8
    assert settings.version_policy == VersionPolicy("specific", specific=(2, 3))
    assert settings.instances == (Instance(2, "cpu", 2), Instance(1, "gpu:0"),
                                  Instance(1, "dla:1"), Instance(1, "npu:2"))
    assert settings.dynamic_batching is not None
    assert settings.dynamic_batching["preferred_batch_size"] == [4, 8]
    assert settings.providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert dict(settings.sha256) == {1: HEX, 2: HEX}
    assert settings.qos == Qos("latency_critical", 2.5, 40)
    assert settings.qos.to_yaml() == {"class": "latency_critical", "p99_ms": 2.5, "min_rps": 40}


def test_qos_needs_only_its_class() -> None:
    settings = parse_settings({"qos": {"class": "best_effort"}}, "c.yaml")
    assert settings.qos == Qos("best_effort", None, None)
    assert settings.qos.to_yaml() == {"class": "best_effort"}
    assert parse_settings({}, "c.yaml").qos is None


@pytest.mark.parametrize(("document", "key", "message"), [
    ({"max_batch_size": -1}, "max_batch_size", "-1 is not allowed: expected an integer 0"),
    ({"max_batch_size": True}, "max_batch_size", "true is not allowed"),
    ({"version_policy": "newest"}, "version_policy", "'newest' is not allowed: expected all, "
     "{latest: N} or {specific: [versions]}"),
    ({"version_policy": {"latest": 0}}, "version_policy.latest", "0 is not allowed"),
    ({"version_policy": {"specific": [0]}}, "version_policy.specific[0]",
     "0 is not allowed: expected a version number 1 or above"),
    ({"version_policy": {"specific": []}}, "version_policy.specific", "an empty list"),
    ({"version_policy": {"latest": 1, "specific": [1]}}, "version_policy", "is not allowed"),
    ({"version_policy": {"newest": 1}}, "version_policy.newest", "unknown key"),
    ({"instances": {"count": 1}}, "instances", "expected a list"),
    ({"instances": []}, "instances", "an empty list"),
    ({"instances": [{"count": 0}]}, "instances[0].count", "0 is not allowed"),
    ({"instances": [{"device": "tpu:0"}]}, "instances[0].device",
     "'tpu:0' is not allowed: expected auto, cpu, gpu:N, dla:N, npu:N or npu:A-B (cores "
     "0..2)"),
    ({"instances": [{"device": "npu:3"}]}, "instances[0].device", "'npu:3' is not allowed"),
    ({"instances": [{"threads": 0}]}, "instances[0].threads", "0 is not allowed"),
    ({"instances": [{"kind": "cpu"}]}, "instances[0].kind", "unknown key"),
    ({"dynamic_batching": {"max_queue_delay_us": -5}}, "dynamic_batching.max_queue_delay_us",
     "-5 is not allowed"),
    ({"dynamic_batching": {"preferred_batch_size": [0]}},
     "dynamic_batching.preferred_batch_size[0]", "0 is not allowed"),
    ({"max_batch_size": 4, "dynamic_batching": {"preferred_batch_size": [8]}},
     "dynamic_batching.preferred_batch_size[0]", "8 is above max_batch_size 4"),
    ({"max_batch_size": 0, "dynamic_batching": {}}, "dynamic_batching",
     "needs max_batch_size above 0"),
    ({"dynamic_batching": {"priority_levels": 2, "default_priority_level": 3}},
     "dynamic_batching.default_priority_level", "3 is not one of the priority_levels 1..2"),
    ({"dynamic_batching": {"queue": {"max_size": "big"}}}, "dynamic_batching.queue.max_size",
     "'big' is not allowed"),
    ({"dynamic_batching": {"queue": {"allow_timeout_override": "yes"}}},
     "dynamic_batching.queue.allow_timeout_override", "expected true or false"),
    ({"dynamic_batching": {"batch": 1}}, "dynamic_batching.batch", "unknown key"),
    ({"providers": "CPUExecutionProvider"}, "providers", "expected a list"),
    ({"providers": []}, "providers", "an empty list"),
    ({"providers": ["cuda"]}, "providers[0]", "'cuda' is not allowed: expected an ONNX "
     "Runtime provider name"),
    ({"precision": "bf16"}, "precision", "expected one of fp32, fp16, int8"),
    ({"sha256": {1: "abc"}}, "sha256.1", "'abc' is not allowed: expected 64 lower-case hex"),
    ({"sha256": {"v1": HEX}}, "sha256.v1", "bad key 'v1': expected a version number"),
    ({"sha256": {}}, "sha256", "expected a non-empty mapping"),
    ({"colour": 1}, "colour", "unknown key"),
    ({"qos": {"class": "gold"}}, "qos.class", "'gold' is not allowed: expected one of "
     "latency_critical, throughput, best_effort"),
    ({"qos": {"p99_ms": 20}}, "qos.class", "missing: one of latency_critical, throughput, "
     "best_effort"),
    ({"qos": {"class": "throughput", "p99_ms": 0}}, "qos.p99_ms",
     "0 is not allowed: expected a number 0.01..3600000"),
    ({"qos": {"class": "throughput", "p99_ms": "20ms"}}, "qos.p99_ms", "'20ms' is not allowed"),
    ({"qos": {"class": "throughput", "min_rps": -1}}, "qos.min_rps", "-1 is not allowed"),
    ({"qos": {"class": "throughput", "p99": 5}}, "qos.p99",
     "unknown key (allowed: class, p99_ms, min_rps)"),
    ({"qos": "latency_critical"}, "qos", "expected a mapping with keys class, p99_ms, min_rps"),
])
def test_a_bad_value_names_the_file_and_the_key(tmp_path: Path, document: object, key: str,
                                                message: str) -> None:
    import yaml

    path = tmp_path / "m" / "config.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ModelSettingsError) as caught:
        read_settings(path)
    assert caught.value.file == str(path)
    assert caught.value.key == key
    assert message in caught.value.message
    assert str(caught.value).startswith(f"{path}: {key}: ")


def test_a_document_that_is_no_mapping_is_refused(tmp_path: Path) -> None:
    path = config(tmp_path, "m", "- 1\n- 2\n")
    with pytest.raises(ModelSettingsError, match="expected a mapping with keys"):
        read_settings(path)


@pytest.mark.parametrize(("policy", "chosen"), [
    (VersionPolicy("latest", 1), [5]),
    (VersionPolicy("latest", 2), [3, 5]),
    (VersionPolicy("latest", 9), [1, 3, 5]),
    (VersionPolicy("specific", specific=(1, 5, 7)), [1, 5]),
    (VersionPolicy("all"), [1, 3, 5]),
])
def test_version_policies_choose(policy: VersionPolicy, chosen: list[int]) -> None:
    assert policy.select([5, 1, 3]) == chosen


def test_version_policy_from_the_file(tmp_path: Path) -> None:
    for number in ("1", "2", "3"):
        version(tmp_path, "m", number)
    for text, wanted in (("version_policy: {latest: 2}", [2, 3]), ("version_policy: all",
                                                                   [1, 2, 3]),
                         ("version_policy: {specific: [1, 3]}", [1, 3])):
        config(tmp_path, "m", text + "\n")
        entry = scan_model(tmp_path, {}, "m")
        assert entry is not None and sorted(entry.wanted()) == wanted, text


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("max_batch_size: 8\nmax_run_ms: 100\nmax_batch_size: 16\n", "max_batch_size", "1 and 3"),
    ("dynamic_batching:\n  queue:\n    max_size: 4\n    timeout_us: 10\n    max_size: 8\n",
     "dynamic_batching.queue.max_size", "3 and 5"),
    ("instances:\n- count: 1\n  threads: 2\n  count: 2\n", "instances[0].count", "2 and 4"),
], ids=["top-level", "nested", "in-a-list"])
def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path: Path, text: str, key: str,
                                                        lines: str) -> None:
    path = config(tmp_path, "m", text)
    with pytest.raises(ModelSettingsError) as caught:
        read_settings(path)
    assert str(caught.value) == f"{path}: {key}: given twice (lines {lines})"
