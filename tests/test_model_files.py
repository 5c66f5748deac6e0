"""Model files are data, not paths: external data resolves only inside the version directory
(never against the working directory), model files do not follow links out of the repository,
the optimised-graph cache is private, and a pin covers every file the model reads."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_models
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from serving_helpers import cpu_factory

from agent.discovery import discover
from agent.inference.demo_model import DEMO_MODEL_PATH
from agent.inference.errors import SessionError
from agent.inference.provider_options import RuntimeVersions
from agent.inference.session import build_session
from agent.kernel.fsroot import Root
from agent.serving.core import InferRequest, Tensor
from agent.serving.errors import ServeError
from agent.serving.registry import ModelRegistry
from agent.serving.server import ServerSettings, session_factory
from agent.serving.threads import InferenceThreads

FIXTURES = Path(__file__).parent / "fixtures"

N = 20_000  # 80 kB of weights: above INLINE_BYTES, so ORT takes them from memory
WEIGHTS = np.arange(N, dtype=np.float32).reshape(1, N) / 8
DECOY = np.full((1, N), -7.0, np.float32)
X = np.linspace(-1, 1, N, dtype=np.float32).reshape(1, N)


def external(location: str, name: str = "w", size: int | None = None,
             offset: str = "0") -> onnx.TensorProto:
    """``WEIGHTS`` as a tensor whose data lives at ``location``."""
    tensor = numpy_helper.from_array(WEIGHTS, name)
    length = len(tensor.raw_data) if size is None else size
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def add_model(path: Path, weight: onnx.TensorProto | None = None,
              nodes: list[onnx.NodeProto] | None = None) -> Path:
    """``y = x + w`` [1, N], ``w`` an initializer (or what ``nodes`` make of it)."""
    graph = helper.make_graph(
        [*(nodes or []), helper.make_node("Add", ["x", "w"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
        [weight] if weight is not None else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def version_dir(repo: Path, number: int = 1, model: str = "ext") -> Path:
    directory = repo / model / str(number)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def sha256sum(*files: Path) -> str:
    """The digest as the README defines it: sha256 of ``sha256sum``'s lines."""
    lines = "".join(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repository"
    path.mkdir()
    return path


@pytest.fixture()
def decoy_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding a ``weights.bin`` of other values."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "weights.bin").write_bytes(DECOY.tobytes())
    monkeypatch.chdir(cwd)
    return cwd


def start(repo: Path) -> Iterator[ModelRegistry]:
    registry = ModelRegistry(repo, {"demo": DEMO_MODEL_PATH}, cpu_factory,
                             probe_interval_s=3600)
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture()
def registry(repo: Path) -> Iterator[ModelRegistry]:
    yield from start(repo)


def reason(registry: ModelRegistry, model: str = "ext") -> str:
    with pytest.raises(ServeError) as raised:
        registry.load(model, {})
    assert raised.value.code == "INVALID_ARGUMENT"
    return raised.value.message


def answer(registry: ModelRegistry, model: str = "ext") -> np.ndarray:
    result = registry.infer(InferRequest(model, "", (Tensor("x", X),), ()))
    return np.asarray(result.outputs[0].array)


# -- locations -----------------------------------------------------------------------------

def test_external_data_inside_the_version_directory_serves_and_ignores_the_cwd(
        registry: ModelRegistry, repo: Path, decoy_cwd: Path) -> None:
    directory = version_dir(repo)
    add_model(directory / "model.onnx", external("weights.bin"))
    (directory / "weights.bin").write_bytes(WEIGHTS.tobytes())
    registry.load("ext", {})
    np.testing.assert_array_equal(answer(registry), X + WEIGHTS)  # never the cwd's DECOY
    digest = registry.model_config("ext").parameters["sha256.1"]
    assert digest == sha256sum(directory / "model.onnx", directory / "weights.bin")


def test_every_tensor_external_in_one_file_as_onnx_saves_it(
        registry: ModelRegistry, repo: Path, decoy_cwd: Path) -> None:
    """``onnx.save_model(..., size_threshold=0)``: a Reshape's shape is external data too,
    which ORT's shape inference reads from the graph, and the weights follow it in the file."""
    shape = numpy_helper.from_array(np.array([N // 2, 2], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["sum"]),
         helper.make_node("Reshape", ["sum", "shape"], ["y"])], "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N // 2, 2])],
        [shape, numpy_helper.from_array(WEIGHTS, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    directory = version_dir(repo)
    onnx.save_model(model, str(directory / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data",
                    size_threshold=0)
    # (onnx refuses to save over a file of that name in the working directory)
    (decoy_cwd / "model.onnx.data").write_bytes((directory / "model.onnx.data").read_bytes()
                                                [::-1])
    registry.load("ext", {})
    np.testing.assert_array_equal(answer(registry), (X + WEIGHTS).reshape(N // 2, 2))
    assert registry.model_config("ext").parameters["sha256.1"] == sha256sum(
        directory / "model.onnx", directory / "model.onnx.data")


def test_a_data_file_only_the_cwd_holds_is_not_read(registry: ModelRegistry, repo: Path,
                                                    decoy_cwd: Path) -> None:
    directory = version_dir(repo)
    add_model(directory / "model.onnx", external("weights.bin"))
    message = reason(registry)
    assert message.startswith(f"model ext version 1: {directory / 'model.onnx'}: "
                              "initializer w: external data location 'weights.bin': ")
    assert "cannot read it: No such file or directory" in message


@pytest.mark.parametrize("location", ["../secret", "sub/../../secret", "..", "."])
def test_a_location_leaving_the_version_directory_is_refused(
        registry: ModelRegistry, repo: Path, location: str) -> None:
    directory = version_dir(repo)
    (directory / "sub").mkdir()
    (directory.parent / "secret").write_bytes(WEIGHTS.tobytes())
    add_model(directory / "model.onnx", external(location))
    assert reason(registry) == (
        f"model ext version 1: {directory / 'model.onnx'}: initializer w: external data "
        f"location {location!r} is not a file inside {directory}; refused")


def test_an_absolute_location_is_refused(registry: ModelRegistry, repo: Path,
                                         tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(WEIGHTS.tobytes())
    directory = version_dir(repo)
    add_model(directory / "model.onnx", external(str(secret)))
    assert f"initializer w: external data location '{secret}' is not a file inside " \
           f"{directory}; refused" in reason(registry)


def test_a_data_file_linked_out_of_the_version_directory_is_refused(
        registry: ModelRegistry, repo: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(WEIGHTS.tobytes())
    directory = version_dir(repo)
    add_model(directory / "model.onnx", external("weights.bin"))
    (directory / "weights.bin").symlink_to(outside)
    message = reason(registry)
    assert "initializer w: external data location 'weights.bin': " in message
    assert f"is {outside}, outside {directory}; refused" in message
    # a link that stays inside the directory is a file of the model like any other
    (directory / "weights.bin").unlink()
    (directory / "data").mkdir()
    (directory / "data" / "w.bin").write_bytes(WEIGHTS.tobytes())
    (directory / "weights.bin").symlink_to("data/w.bin")
    registry.load("ext", {})
    np.testing.assert_array_equal(answer(registry), X + WEIGHTS)


def test_a_fifo_as_data_file_is_refused_without_hanging(registry: ModelRegistry,
                                                        repo: Path) -> None:
    directory = version_dir(repo)
    add_model(directory / "model.onnx", external("weights.bin"))
    os.mkfifo(directory / "weights.bin")
    message = reason(registry)
    assert "initializer w: external data location 'weights.bin': " in message
    assert message.endswith("is not a regular file; refused")


@pytest.mark.parametrize(("offset", "size", "why"), [
    ("-1", None, "external data offset '-1' is not a non-negative integer"),
    ("1e3", None, "external data offset '1e3' is not a non-negative integer"),
    ("4", None, f"external data 'weights.bin' offset 4 length {4 * N} goes past the file's "
                f"{4 * N} bytes"),
    ("0", 4 * N + 1, f"external data 'weights.bin' offset 0 length {4 * N + 1} goes past the "
                     f"file's {4 * N} bytes"),
])
def test_an_offset_or_length_outside_the_file_is_refused(
        tmp_path: Path, offset: str, size: int | None, why: str) -> None:
    model = add_model(tmp_path / "model.onnx", external("weights.bin", size=size,
                                                         offset=offset))
    (tmp_path / "weights.bin").write_bytes(WEIGHTS.tobytes())
    with pytest.raises(SessionError) as raised:
        build_session(model, providers=["CPUExecutionProvider"], intra_op=1, inter_op=1,
                      cache_dir=None)
    assert str(raised.value) == f"{model}: initializer w: {why}; refused"


def test_a_constant_in_a_subgraph_is_checked_too(tmp_path: Path) -> None:
    """Not only initializers carry external data: a Constant's value, here in an If branch."""
    (tmp_path.parent / "secret").write_bytes(WEIGHTS.tobytes())
    branch = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], name="leak", value=external("../secret",
                                                                             name=""))],
        "branch", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, N])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    nodes = [helper.make_node("Constant", [], ["cond"], value=cond),
             helper.make_node("If", ["cond"], ["w"], then_branch=branch, else_branch=branch)]
    model = add_model(tmp_path / "model.onnx", nodes=nodes)
    with pytest.raises(SessionError) as raised:
        build_session(model, providers=["CPUExecutionProvider"], intra_op=1, inter_op=1,
                      cache_dir=None)
    assert str(raised.value) == (f"{model}: node leak's tensor: external data location "
                                 f"'../secret' is not a file inside {tmp_path}; refused")


# -- model files and the repository --------------------------------------------------------

def test_a_model_file_linked_out_of_the_repository_is_refused(
        registry: ModelRegistry, repo: Path, tmp_path: Path) -> None:
    outside = onnx_models.mlp(tmp_path / "elsewhere.onnx")
    (version_dir(repo, model="linked") / "model.onnx").symlink_to(outside)
    message = reason(registry, "linked")
    assert message == (f"model linked version 1: {repo / 'linked' / '1' / 'model.onnx'}: "
                       f"is {outside}, outside {repo}; refused")
    # a link inside the repository, and a built-in outside it by design, both serve
    onnx_models.mlp(version_dir(repo, 1, "shared") / "model.onnx")
    (version_dir(repo, model="linked") / "model.onnx").unlink()
    (version_dir(repo, model="linked") / "model.onnx").symlink_to(
        repo / "shared" / "1" / "model.onnx")
    registry.load("linked", {})
    assert registry.model_ready("linked", "") and registry.model_ready("demo", "")
    # without external data the digest is the file's own, as pins written before expect
    assert registry.model_config("linked").parameters["sha256.1"] == hashlib.sha256(
        (repo / "shared" / "1" / "model.onnx").read_bytes()).hexdigest()


# -- the pin -------------------------------------------------------------------------------

def test_a_pin_covers_the_external_data(registry: ModelRegistry, repo: Path) -> None:
    directory = version_dir(repo)
    model = add_model(directory / "model.onnx", external("weights.bin"))
    data = directory / "weights.bin"
    data.write_bytes(WEIGHTS.tobytes())
    pin = sha256sum(model, data)
    (repo / "ext" / "config.yaml").write_text(f"sha256: {{1: '{pin}'}}\n")
    registry.load("ext", {})
    np.testing.assert_array_equal(answer(registry), X + WEIGHTS)
    data.write_bytes(DECOY.tobytes())  # the same size; model.onnx unchanged
    changed = sha256sum(model, data)
    message = reason(registry)
    assert message == (f"model ext version 1: {model} has sha256 {changed}, but it is pinned "
                       f"to {pin}; refused")
    np.testing.assert_array_equal(answer(registry), X + WEIGHTS)  # the pinned one serves on


# -- the server's factory ------------------------------------------------------------------

def test_the_servers_sessions_serve_external_data_and_cache_it_privately(
        repo: Path, tmp_path: Path, decoy_cwd: Path) -> None:
    """As ``serve`` builds them: the board's plan (keyed by the digest), the state
    directory's graph cache, a pin; the cwd's decoy is never read."""
    directory = version_dir(repo)
    model = add_model(directory / "model.onnx", external("weights.bin"))
    (directory / "weights.bin").write_bytes(WEIGHTS.tobytes())
    (repo / "ext" / "config.yaml").write_text(
        f"sha256: {{1: '{sha256sum(model, directory / 'weights.bin')}'}}\n")
    escaping = add_model(version_dir(repo, model="escaping") / "model.onnx",
                         external("../../../secret"))
    (tmp_path / "secret").write_bytes(WEIGHTS.tobytes())
    cache = tmp_path / "state" / "model-cache"
    settings = ServerSettings(
        http="127.0.0.1:0", grpc="127.0.0.1:0", repository=repo, builtins={}, pins={},
        token_files=[], max_request_bytes=1 << 20, providers=["CPUExecutionProvider"],
        threads=(1, 1), cache_dir=cache, topology=discover(Root(FIXTURES / "bare-vm")),
        state_dir=tmp_path / "state", available=["CPUExecutionProvider"],
        versions=RuntimeVersions(ort.__version__))
    registry = ModelRegistry(repo, {}, session_factory(settings, InferenceThreads(None)),
                             probe_interval_s=3600)
    registry.start()
    try:
        np.testing.assert_array_equal(answer(registry), X + WEIGHTS)
        assert "initializer w: external data location '../../../secret' is not a file " \
               f"inside {escaping.parent}; refused" in reason(registry, "escaping")
    finally:
        registry.stop()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    stored = list(cache.iterdir())
    assert len(stored) == 1 and stat.S_IMODE(stored[0].stat().st_mode) == 0o600
    assert DECOY.tobytes() not in stored[0].read_bytes()


# -- the cache -----------------------------------------------------------------------------

def test_cache_files_are_private(tmp_path: Path) -> None:
    """An optimised graph holds the model's weights: 0600 in a 0700 directory, also where an
    older agent left the directory 0755."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o755)
    plain = onnx_models.mlp(tmp_path / "plain.onnx")
    assert build_session(plain, providers=["CPUExecutionProvider"], intra_op=1, inter_op=1,
                         cache_dir=cache).cache == "miss"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert [stat.S_IMODE(f.stat().st_mode) for f in cache.iterdir()] == [0o600]
    # a model with external data is cached whole: its hit needs no data file
    directory = tmp_path / "model"
    model = add_model(directory / "model.onnx", external("weights.bin"))
    (directory / "weights.bin").write_bytes(WEIGHTS.tobytes())
    for expected in ("miss", "hit"):
        built = build_session(model, providers=["CPUExecutionProvider"], intra_op=1,
                              inter_op=1, cache_dir=cache)
        assert built.cache == expected
        np.testing.assert_array_equal(built.session.run(None, {"x": X})[0], X + WEIGHTS)
    assert sorted(stat.S_IMODE(f.stat().st_mode) for f in cache.iterdir()) == [0o600, 0o600]


def test_a_model_whose_protobuf_does_not_parse_is_refused_unchecked(tmp_path: Path) -> None:
    """A file naming a ``location`` that cannot be parsed is not handed to ORT unchecked."""
    model = tmp_path / "model.onnx"
    model.write_bytes(b"\xff\xfflocation")
    with pytest.raises(SessionError) as raised:
        build_session(model, providers=["CPUExecutionProvider"], intra_op=1, inter_op=1,
                      cache_dir=None)
    assert str(raised.value).startswith(f"{model}: not an ONNX model (its external data "
                                        "cannot be checked: ")
