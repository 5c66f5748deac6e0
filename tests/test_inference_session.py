"""Session building against the real ONNX Runtime, with models made here by onnx.helper."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort  # type: ignore[import-untyped]
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.discovery import Topology, discover
from agent.inference import options as opts
from agent.inference import session as sess
from agent.inference.errors import SessionError
from agent.inference.graph_cache import cache_key
from agent.inference.options import thread_plan
from agent.inference.providers import CPU, CUDA, OPENVINO, TENSORRT, choose_providers
from agent.inference.session import build_session, load_model
from agent.kernel.fsroot import Root

FIXTURES = Path(__file__).parent / "fixtures"
AZURE = "AzureExecutionProvider"
EVERY_EP = [TENSORRT, CUDA, OPENVINO, AZURE, CPU]
NVIDIA_EPS = [TENSORRT, CUDA, CPU]


def topology(board: str) -> Topology:
    return discover(Root(FIXTURES / board))


# -- models ------------------------------------------------------------------------------------

def _save(tmp_path: Path, name: str, graph: onnx.GraphProto) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9  # what ORT 1.16, the oldest we support, can read
    onnx.checker.check_model(model)
    path = tmp_path / name
    path.write_bytes(model.SerializeToString())
    return path


def _init(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return numpy_helper.from_array(values, name)


def mlp(tmp_path: Path, seed: int = 0, name: str = "mlp.onnx") -> Path:
    """16 → 32 → 4: MatMul+Add pairs that level "all" fuses."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["y"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [_init("w1", (16, 32), seed), _init("b1", (32,), seed + 1),
         _init("w2", (32, 4), seed + 2), _init("b2", (4,), seed + 3)])
    return _save(tmp_path, name, graph)


def convnet(tmp_path: Path, channels: int = 8, size: int = 32) -> Path:
    """Conv+Relu twice, pooled to a Gemm: level "all" rewrites it to NCHWc kernels."""
    nodes = [helper.make_node("Conv", ["x", "k1", "c1"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["ra"]),
             helper.make_node("Conv", ["ra", "k2", "c2"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["b"], ["rb"]),
             helper.make_node("GlobalAveragePool", ["rb"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fb"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [_init("k1", (channels, 3, 3, 3), 10), _init("c1", (channels,), 11),
         _init("k2", (channels, channels, 3, 3), 12), _init("c2", (channels,), 13),
         _init("fc", (10, channels), 14), _init("fb", (10,), 15)])
    return _save(tmp_path, "convnet.onnx", graph)


def feed(built: sess.BuiltSession) -> dict[str, np.ndarray]:
    """One fixed input per model input, so runs can be compared bit for bit."""
    rng = np.random.default_rng(42)
    return {i.name: rng.standard_normal(i.shape).astype(np.float32)
            for i in built.session.get_inputs()}


def run(built: sess.BuiltSession) -> np.ndarray:
    return np.asarray(built.session.run(None, feed(built))[0])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(path: Path, cache_dir: Path | None, providers: list[str] | None = None,
          **kwargs: Any) -> sess.BuiltSession:
    return build_session(path, providers=providers or [CPU], intra_op=2, inter_op=1,
                         cache_dir=cache_dir, **kwargs)


def files(directory: Path) -> list[str]:
    """Every name, hidden temporaries included."""
    return sorted(p.name for p in directory.iterdir())


# -- providers ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("board", "available", "expected"), [
    ("x86-server-nvidia", NVIDIA_EPS, NVIDIA_EPS),
    ("jetson-agx-orin-jp6", NVIDIA_EPS, NVIDIA_EPS),
    ("jetson-orin-nano-jp6", EVERY_EP, NVIDIA_EPS),
    ("x86-edge-npu", [OPENVINO, AZURE, CPU], [OPENVINO, CPU]),
    ("x86-edge-npu", EVERY_EP, [OPENVINO, CPU]),
    ("rk3588-vendor", EVERY_EP, [CPU]),
    ("rk3588-mainline", EVERY_EP, [CPU]),
    ("bare-vm", EVERY_EP, [CPU]),  # the bochs VGA is no accelerator
    ("x86-server-nvidia", [AZURE, CPU], [CPU]),  # the CPU-only wheel on a GPU box
    ("jetson-agx-orin-jp6", [CUDA, CPU], [CUDA, CPU]),  # a build without TensorRT
])
def test_providers_follow_the_hardware(board: str, available: list[str],
                                       expected: list[str]) -> None:
    assert choose_providers(available, topology(board)) == expected


def test_azure_is_never_chosen_automatically() -> None:
    for board in ("x86-server-nvidia", "x86-edge-npu", "bare-vm", "jetson-agx-orin-jp6"):
        assert AZURE not in choose_providers(EVERY_EP, topology(board))


def test_this_build_gives_cpu_only() -> None:
    assert choose_providers(ort.get_available_providers(), topology("bare-vm")) == [CPU]


def test_override_order_is_honoured() -> None:
    chosen = choose_providers(NVIDIA_EPS, topology("x86-server-nvidia"), [CUDA, CPU, TENSORRT])
    assert chosen == [CUDA, CPU, TENSORRT]


def test_override_is_filtered_to_available(caplog: pytest.LogCaptureFixture) -> None:
    chosen = choose_providers([CUDA, CPU], topology("rk3588-vendor"), [OPENVINO, CUDA, CPU])
    assert chosen == [CUDA, CPU]
    assert OPENVINO in caplog.text


def test_override_may_name_azure() -> None:
    assert choose_providers(EVERY_EP, topology("bare-vm"), [AZURE, CPU]) == [AZURE, CPU]


def test_override_with_nothing_available_names_both() -> None:
    with pytest.raises(SessionError) as raised:
        choose_providers([AZURE, CPU], topology("x86-server-nvidia"), ["BogusExecutionProvider"])
    assert "BogusExecutionProvider" in str(raised.value)
    assert CPU in str(raised.value) and AZURE in str(raised.value)


# -- threads -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("board", "cpus", "expected"), [
    ("rk3588-vendor", None, 4),  # the A76 cores 4-7
    ("rk3588-mainline", None, 4),
    ("jetson-agx-orin-jp6", None, 8),  # MODE_30W: cpu8-11 offline
    ("jetson-agx-orin-jp6", [4, 5], 2),
    ("jetson-agx-orin-jp6", [6, 7, 8, 9], 2),  # offline CPUs get no thread
    ("jetson-orin-nano-jp6", None, 6),
    ("x86-edge-npu", None, 12),  # P-core threads, not the E-cores
    ("x86-server-nvidia", None, 16),
    ("bare-vm", None, 2),
    ("bare-vm", [], 2),
])
def test_thread_plan(board: str, cpus: list[int] | None, expected: int) -> None:
    assert thread_plan(topology(board), cpus) == (expected, 1)


def test_thread_plan_with_only_offline_cpus_fails() -> None:
    with pytest.raises(SessionError, match=r"\[8, 9\].*online"):
        thread_plan(topology("jetson-agx-orin-jp6"), [8, 9])


def test_session_uses_the_planned_threads(tmp_path: Path) -> None:
    intra, inter = thread_plan(topology("rk3588-vendor"), None)
    built = build_session(mlp(tmp_path), providers=[CPU], intra_op=intra, inter_op=inter,
                          cache_dir=None)
    options = built.session.get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (4, 1)
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert (built.intra_op, built.inter_op) == (4, 1)


_COUNT_THREADS = """
import os, sys
from pathlib import Path
from agent.inference.session import build_session
def tasks(): return set(os.listdir("/proc/self/task"))
before = tasks()
built = build_session(Path(sys.argv[1]), providers=["CPUExecutionProvider"],
                      intra_op=3, inter_op=1, cache_dir=None)
print(len(tasks() - before))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_session_starts_that_many_os_threads(tmp_path: Path) -> None:
    """The calling thread is the first of the intra-op pool: N threads means N-1 workers.

    Counted in a fresh interpreter: in the suite's own process, threads other tests left
    behind start and stop while the session builds.
    """
    model = mlp(tmp_path)
    counted = subprocess.run([sys.executable, "-c", _COUNT_THREADS, str(model)], check=True,
                             capture_output=True, text=True, timeout=120)
    assert int(counted.stdout) == 2


def test_a_python_thread_started_during_a_build_is_not_taken_for_a_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A front end's handler thread that starts while a session builds is no ORT worker:
    taken for one, it would get the inference threads' scheduling and the model's CPUs."""
    model, go, started = mlp(tmp_path), threading.Event(), []
    create = sess.create_session

    def with_a_thread(*args: Any) -> Any:
        other = threading.Thread(target=go.wait, daemon=True)
        other.start()
        started.append(other)
        return create(*args)

    monkeypatch.setattr(sess, "create_session", with_a_thread)
    try:
        built = build_session(model, providers=[CPU], intra_op=3, inter_op=1, cache_dir=None)
        assert started[0].native_id not in built.worker_tids
        assert len(built.worker_tids) == 2
        assert all(Path(f"/proc/self/task/{tid}").is_dir() for tid in built.worker_tids)
    finally:
        go.set()


def test_the_workers_of_a_build_beside_it_are_not_taken_for_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another model's session built (on another thread) while this one builds starts ORT
    workers too, which are no Python threads: taken for this one's, they would be pinned to
    this model's CPUs.  Only the two this build started are its workers, and they and the
    building thread keep the building thread's name."""
    model, others, go = mlp(tmp_path), [], threading.Event()
    create = sess.create_session
    options = ort.SessionOptions()
    options.intra_op_num_threads = 3

    def another_build() -> None:
        go.wait(60)
        others.append(ort.InferenceSession(str(model), options, providers=[CPU]))

    beside = threading.Thread(target=another_build, daemon=True)
    beside.start()  # before the build: not a thread the build started

    def with_another_build(*args: Any) -> Any:
        go.set()
        beside.join(60)
        return create(*args)

    monkeypatch.setattr(sess, "create_session", with_another_build)
    own = Path("/proc/thread-self/comm").read_text()
    built = build_session(model, providers=[CPU], intra_op=3, inter_op=1, cache_dir=None)
    assert others, "the other session was not built"
    assert len(built.worker_tids) == 2, built.worker_tids
    assert Path("/proc/thread-self/comm").read_text() == own
    assert {Path(f"/proc/self/task/{tid}/comm").read_text() for tid in built.worker_tids} == {
        own}


def test_spinning_defaults_to_ort_and_can_be_turned_off(tmp_path: Path) -> None:
    model = mlp(tmp_path)
    default = build(model, None).session.get_session_options()
    with pytest.raises(RuntimeError):  # unset: ORT's own default applies
        default.get_session_config_entry("session.intra_op.allow_spinning")
    quiet = build(model, None, allow_spinning=False).session.get_session_options()
    assert quiet.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_unknown_optimisation_level_fails_before_reading(tmp_path: Path) -> None:
    with pytest.raises(SessionError, match="'max'"):
        build(tmp_path / "absent.onnx", None, graph_optimization="max")


@pytest.mark.parametrize("level", ["disabled", "basic", "extended", "all"])
def test_levels_map_to_ort(tmp_path: Path, level: opts.GraphOptimization) -> None:
    built = build(mlp(tmp_path), None, graph_optimization=level)
    assert built.session.get_session_options().graph_optimization_level == opts._LEVELS[level]


# -- model pinning -----------------------------------------------------------------------------

def test_pinned_digest_loads(tmp_path: Path) -> None:
    model = mlp(tmp_path)
    assert load_model(model, digest(model)) == model.read_bytes()
    built = build(model, None, expected_sha256=digest(model).upper())
    assert built.model_sha256 == digest(model)
    assert run(built).shape == (2, 4)


def test_wrong_digest_builds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp(tmp_path)
    wrong = "0" * 64
    calls: list[object] = []
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: calls.append(a))
    with pytest.raises(SessionError) as raised:
        build(model, tmp_path / "cache", expected_sha256=wrong)
    message = str(raised.value)
    assert str(model) in message and wrong in message and digest(model) in message
    assert calls == []
    assert not (tmp_path / "cache").exists()


def test_unreadable_model_is_a_session_error(tmp_path: Path) -> None:
    absent = tmp_path / "absent.onnx"
    with pytest.raises(SessionError) as raised:
        load_model(absent, None)
    assert str(raised.value) == f"{absent}: cannot read it: No such file or directory"
    assert raised.value.model == str(absent)


def _random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(7).bytes(4096))


def _half_of_a_real_model(path: Path) -> None:
    model = convnet(path.parent).read_bytes()
    path.write_bytes(model[: len(model) // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("make", [_random_bytes, _half_of_a_real_model, _empty])
def test_a_file_that_is_no_onnx_model_is_named_and_said_so(
        tmp_path: Path, make: Callable[[Path], None], cached: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "m.onnx"
    make(bad)
    with pytest.raises(SessionError) as raised:
        build(bad, tmp_path / "cache" if cached else None)
    message = str(raised.value)
    assert message.startswith(f"{bad}: not an ONNX model (onnxruntime: "), message
    assert message.endswith(")") and "\n" not in message and "[ONNXRuntimeError]" not in message
    assert raised.value.model == str(bad)
    assert "save" not in caplog.text  # it was never a cache problem
    if cached:
        assert files(tmp_path / "cache") == []


def test_a_model_onnxruntime_cannot_run_is_named(tmp_path: Path) -> None:
    """Valid ONNX, but an operator ORT does not have: not a parse error."""
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], domain="example.invalid")], "odd",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("example.invalid", 1)])
    model.ir_version = 9
    odd = tmp_path / "odd.onnx"
    odd.write_bytes(model.SerializeToString())
    with pytest.raises(SessionError) as raised:
        build(odd, tmp_path / "cache")
    message = str(raised.value)
    assert message.startswith(f"{odd}: onnxruntime cannot build a session for it: "), message
    assert "NoSuchOp" in message and "\n" not in message


# -- cache -------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [mlp, convnet])
def test_miss_then_hit_gives_identical_outputs(tmp_path: Path,
                                               make: Callable[[Path], Path]) -> None:
    model, cache = make(tmp_path), tmp_path / "cache"
    cold = build(model, cache)
    assert cold.cache == "miss"
    key = cache_key(digest(model), [CPU], "all")
    (stored,) = files(cache)
    assert stored.startswith(key + ".")
    warm = build(model, cache)
    assert warm.cache == "hit"
    assert files(cache) == [stored]
    assert np.array_equal(run(cold), run(warm))
    # The cached graph is already optimised: the hit must not optimise it again.
    assert (warm.session.get_session_options().graph_optimization_level
            == ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    np.testing.assert_allclose(run(warm), run(build(model, None, graph_optimization="disabled")),
                               rtol=1e-5, atol=1e-5)


def test_cache_file_is_named_by_its_content(tmp_path: Path) -> None:
    model, cache = mlp(tmp_path), tmp_path / "cache"
    build(model, cache)
    (stored,) = cache.iterdir()
    assert stored.name.split(".")[1] == digest(stored)


def test_different_model_is_a_different_key(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, second = mlp(tmp_path, 0, "a.onnx"), mlp(tmp_path, 100, "b.onnx")
    assert build(first, cache).cache == "miss"
    assert build(second, cache).cache == "miss"
    assert len(files(cache)) == 2
    assert not np.array_equal(run(build(first, cache)), run(build(second, cache)))


def test_different_providers_or_level_is_a_different_key(tmp_path: Path) -> None:
    model, cache = mlp(tmp_path), tmp_path / "cache"
    assert build(model, cache, [CPU]).cache == "miss"
    assert build(model, cache, [AZURE, CPU]).cache == "miss"  # Azure claims no node here
    assert build(model, cache, [CPU], graph_optimization="basic").cache == "miss"
    assert len(files(cache)) == 3
    assert build(model, cache, [AZURE, CPU]).cache == "hit"
    sha = digest(model)
    keys = {cache_key(sha, [CPU], "all"), cache_key(sha, [AZURE, CPU], "all"),
            cache_key(sha, [CPU, AZURE], "all"), cache_key(sha, [CPU], "basic")}
    assert len(keys) == 4


def key_files(cache: Path, model: Path) -> list[Path]:
    return sorted(cache.glob(f"{cache_key(digest(model), [CPU], 'all')}.*.onnx"))


def the_verified_file(cache: Path, model: Path) -> Path:
    """What the cache guarantees whatever bytes ORT writes: one file for the key, named by
    the digest of its content, and no temporary left beside it."""
    (stored,) = key_files(cache, model)
    assert stored.name.split(".")[1] == digest(stored)
    assert files(cache) == [stored.name]
    return stored


def ort_inputs(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every model handed to ORT from now on, recorded on its way to the real ORT."""
    real, seen = ort.InferenceSession, []

    def recording(model: bytes, *args: Any, **kwargs: Any) -> Any:
        seen.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    return seen


@pytest.fixture()
def varying_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ORT that writes the same optimised graph with other bytes on every build (ORT
    1.32 does so on some machines): the graph is re-serialised with a fresh nonce."""
    real = ort.InferenceSession

    def writing_other_bytes(model: bytes, options: Any, **kwargs: Any) -> Any:
        session = real(model, options, **kwargs)
        if options.optimized_model_filepath:
            target = Path(options.optimized_model_filepath)
            graph = onnx.load_from_string(target.read_bytes())
            graph.doc_string = os.urandom(int.from_bytes(os.urandom(1)) + 1).hex()
            target.write_bytes(graph.SerializeToString())
        return session

    monkeypatch.setattr(ort, "InferenceSession", writing_other_bytes)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _negate_a_weight(path: Path) -> None:
    """Flip the sign of every value of the largest weight, found by parsing the file (not
    by guessing an offset: ORT's layout varies): the protobuf still parses and ORT loads it."""
    data = bytearray(path.read_bytes())
    weight = max(onnx.load_from_string(bytes(data)).graph.initializer,
                 key=lambda t: len(t.raw_data))
    assert weight.data_type == TensorProto.FLOAT and len(weight.raw_data) >= 64
    offset = bytes(data).find(weight.raw_data)
    assert offset >= 0 and bytes(data).count(weight.raw_data) == 1
    for high_byte in range(offset + 3, offset + len(weight.raw_data), 4):  # little-endian
        data[high_byte] ^= 0x80
    path.write_bytes(bytes(data))


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def test_a_damaged_weight_fools_ort(tmp_path: Path) -> None:
    """Why the cache checks digests: loading alone does not catch this damage."""
    model, cache = convnet(tmp_path), tmp_path / "cache"
    expected = run(build(model, cache))
    stored = the_verified_file(cache, model)
    _negate_a_weight(stored)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    fooled = ort.InferenceSession(stored.read_bytes(), options, providers=[CPU])
    assert not np.allclose(fooled.run(None, feed(build(model, None)))[0], expected)


@pytest.mark.parametrize("writer", ["ort", "varying"])
@pytest.mark.parametrize("damage", [_truncate, _negate_a_weight, _garbage])
def test_corrupt_cache_file_is_never_loaded_and_is_replaced(
        tmp_path: Path, damage: Callable[[Path], None], writer: str,
        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
        caplog: pytest.LogCaptureFixture) -> None:
    if writer == "varying":
        request.getfixturevalue("varying_writer")
    model, cache = convnet(tmp_path), tmp_path / "cache"
    expected = run(build(model, cache))
    stored = the_verified_file(cache, model)
    damage(stored)
    damaged = stored.read_bytes()
    handed_to_ort = ort_inputs(monkeypatch)
    rebuilt = build(model, cache)
    assert rebuilt.cache == "miss"
    assert "corrupt" in caplog.text
    # The digest caught it before ORT saw it: ORT was given the source model, only.
    assert handed_to_ort == [model.read_bytes()]
    assert damaged not in handed_to_ort
    the_verified_file(cache, model)
    np.testing.assert_allclose(run(rebuilt), expected, rtol=1e-5, atol=1e-6)
    assert build(model, cache).cache == "hit"


def test_rebuilds_writing_other_bytes_keep_one_file_per_key(tmp_path: Path,
                                                            varying_writer: None) -> None:
    model, cache = mlp(tmp_path), tmp_path / "cache"
    first = build(model, cache)
    stored = the_verified_file(cache, model)
    stored.unlink()  # a lost file: the next build writes other bytes under another name
    assert build(model, cache).cache == "miss"
    again = the_verified_file(cache, model)
    assert again.name != stored.name
    hit = build(model, cache)
    assert hit.cache == "hit"
    assert np.array_equal(run(hit), run(first))


def test_a_file_that_verifies_but_does_not_load_is_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A name that matches its content is still no proof that ORT can use it."""
    model, cache = mlp(tmp_path), tmp_path / "cache"
    build(model, cache)
    the_verified_file(cache, model).unlink()
    junk = b"not an optimised graph"
    key = cache_key(digest(model), [CPU], "all")
    planted = cache / f"{key}.{hashlib.sha256(junk).hexdigest()}.onnx"
    planted.write_bytes(junk)
    assert build(model, cache).cache == "miss"
    assert "does not load" in caplog.text
    assert the_verified_file(cache, model) != planted


def test_empty_cache_file_is_replaced(tmp_path: Path) -> None:
    model, cache = mlp(tmp_path), tmp_path / "cache"
    build(model, cache)
    (stored,) = cache.iterdir()
    stored.write_bytes(b"")
    assert build(model, cache).cache == "miss"
    assert build(model, cache).cache == "hit"


def test_half_written_temporary_is_never_loaded_and_is_swept(tmp_path: Path) -> None:
    """A crash while ORT writes leaves only a dot-file: the next start misses and cleans it."""
    model, cache = mlp(tmp_path), tmp_path / "cache"
    build(model, cache)
    (stored,) = cache.iterdir()
    stored.unlink()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    key = cache_key(digest(model), [CPU], "all")
    leftover = cache / f".{key}.{dead}.{'0' * 32}.tmp.onnx"
    leftover.write_bytes(b"\x08\x09half")
    assert build(model, cache).cache == "miss"
    assert files(cache) == [stored.name]


def test_no_cache_dir_is_off(tmp_path: Path) -> None:
    built = build(mlp(tmp_path), None)
    assert built.cache == "off"
    assert files(tmp_path) == ["mlp.onnx"]


def test_compiling_provider_is_never_cached(tmp_path: Path) -> None:
    """TensorRT is absent from this build, so ORT warns and runs on CPU, uncached all the same."""
    model, cache = mlp(tmp_path), tmp_path / "cache"
    with pytest.warns(UserWarning, match=TENSORRT):
        built = build(model, cache, [TENSORRT, CPU])
    assert built.cache == "off"
    assert not cache.exists()


def test_refused_save_falls_back_to_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """What ORT does for an EP that compiles nodes and is not on the list."""
    real = ort.InferenceSession

    def refuse_to_save(model: bytes, options: Any, **kwargs: Any) -> Any:
        if options.optimized_model_filepath:
            Path(options.optimized_model_filepath).write_bytes(b"partial")
            raise RuntimeError("Unable to serialize model as it contains compiled nodes")
        return real(model, options, **kwargs)

    model, cache = mlp(tmp_path), tmp_path / "cache"
    monkeypatch.setattr(ort, "InferenceSession", refuse_to_save)
    built = build(model, cache)
    assert built.cache == "off"
    assert "compiled nodes" in caplog.text
    assert files(cache) == []
    assert run(built).shape == (2, 4)


def test_unusable_cache_dir_is_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, not_a_dir = mlp(tmp_path), tmp_path / "cache"
    not_a_dir.write_text("a file")
    built = build(model, not_a_dir)
    assert built.cache == "off"
    assert "unusable" in caplog.text
    assert run(built).shape == (2, 4)


def test_built_session_reports_what_ort_used(tmp_path: Path) -> None:
    model = mlp(tmp_path)
    built = build(model, tmp_path / "cache", [AZURE, CPU])
    assert built.providers == [AZURE, CPU]
    assert built.model_sha256 == digest(model)
    assert built.load_ms > 0


def test_another_cpu_misses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ORT lays graphs out for the CPU's ISA: a copied state directory must not be reused."""
    from agent.inference import graph_cache as session_module

    identity = session_module.cpu_identity()
    assert len(identity) == 16 and int(identity, 16) >= 0  # a digest of this CPU's ISA
    model, cache = mlp(tmp_path), tmp_path / "cache"
    assert build(model, cache, [CPU]).cache == "miss"
    assert build(model, cache, [CPU]).cache == "hit"
    monkeypatch.setattr(session_module, "cpu_identity", lambda: "another-cpu")
    assert build(model, cache, [CPU]).cache == "miss"


def test_data_plane_sessions_spin_only_within_a_run_and_never_under_a_realtime_policy(
        tmp_path: Path) -> None:
    from agent.inference.options import session_spins
    from agent.kernel.sched import ThreadSched
    from agent.serving.server import ServerSettings, session_factory
    from agent.serving.threads import InferenceThreads

    settings = ServerSettings(http="127.0.0.1:0", grpc="127.0.0.1:0", repository=tmp_path,
                              builtins={}, pins={}, token_files=[], max_request_bytes=1 << 20,
                              providers=[CPU], threads=(1, 1), cache_dir=None)
    model = mlp(tmp_path)
    for wanted, spinning in ((None, True), (ThreadSched("other", 0, []), True),
                             (ThreadSched("fifo", 50, []), False)):
        built = session_factory(settings, InferenceThreads(wanted))(
            model, sha256=None, providers=None, threads=1)
        assert session_spins(built.session) is spinning
        options = built.session.get_session_options()
        assert options.get_session_config_entry("session.force_spinning_stop") == "1"
        assert options.enable_cpu_mem_arena is False
        assert options.enable_mem_pattern is False
