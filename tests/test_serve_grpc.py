"""The gRPC front end against Triton's own client (tritonclient.grpc, pinned): what that
client sends and reads is the acceptance test of wire compatibility.  The server runs on a
free loopback port over DemoModels (the real bundled model in ONNX Runtime)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton
from google.protobuf import descriptor_pool, json_format
from serving_helpers import DemoModels, RecordingModels
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from agent.serving import proto
from agent.serving.access import Access
from agent.serving.budget import MemoryBudget
from agent.serving.errors import ServeError
from agent.serving.grpc_api import build_grpc_server
from agent.serving.grpc_client import GrpcClient
from agent.serving.grpc_codec import infer_request
from agent.serving.shm import SharedMemoryRegions

TOKEN = "s3cret-token"
MAX_REQUEST = 1 << 20
AUTH = {"authorization": f"Bearer {TOKEN}"}
NO_REGIONS = SharedMemoryRegions("edge-agent-", max_bytes=0)  # nothing registers in it
BUDGET = MemoryBudget(1 << 30)


@dataclass
class Served:
    models: RecordingModels
    target: str
    triton: Any  # tritonclient.grpc.InferenceServerClient


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Start servers (``everything``: the token for every call); all stopped at the end."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    started: list[tuple[Any, Any, concurrent.futures.ThreadPoolExecutor]] = []

    def start(everything: bool = False, models: RecordingModels | None = None) -> Served:
        models = models or RecordingModels()
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=4)
        server = build_grpc_server(models, Access([token_file], everything=everything),
                                   max_request_bytes=MAX_REQUEST, executor=executor)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        client = triton.InferenceServerClient(url=f"127.0.0.1:{port}")
        started.append((server, client, executor))
        return Served(models, f"127.0.0.1:{port}", client)

    yield start
    for server, client, executor in started:
        client.close()
        server.stop(None)
        executor.shutdown(wait=True)


@pytest.fixture
def served(serve: Callable[..., Served]) -> Served:
    return serve()


def image(batch: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 64, 64), dtype=np.float32)


def expected(models: DemoModels, array: np.ndarray) -> np.ndarray:
    """What ONNX Runtime itself answers for the same input."""
    return np.asarray(models.session.run(["probabilities"], {"image": array})[0])


def triton_input(array: np.ndarray, name: str = "image", datatype: str = "FP32") -> Any:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def status_of(excinfo: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(excinfo.value.status()).removeprefix("StatusCode.")


# --- health, metadata, configuration -------------------------------------------------------


def test_health_and_server_metadata(served: Served) -> None:
    client = served.triton
    assert client.is_server_live() is True
    assert client.is_server_ready() is True
    meta = client.get_server_metadata()
    assert meta.name == "edge-agent"
    assert meta.version == "0.1.0"
    assert "model_repository" in meta.extensions
    assert client.is_model_ready("demo") is True
    assert client.is_model_ready("demo", "1") is True


def test_model_metadata(served: Served) -> None:
    meta = served.triton.get_model_metadata("demo")
    assert (meta.name, list(meta.versions), meta.platform) == ("demo", ["1"],
                                                               "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("image", "FP32", [-1, 3, 64, 64])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("probabilities", "FP32", [-1, 10])]


def test_model_config(served: Served) -> None:
    config = served.triton.get_model_config("demo").config
    assert (config.name, config.platform, config.backend) == ("demo", "onnxruntime_onnx",
                                                              "onnxruntime")
    assert config.max_batch_size == 4
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [
        ("image", model_config_pb2.TYPE_FP32, [3, 64, 64])]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("probabilities", model_config_pb2.TYPE_FP32, [10])]
    group = config.instance_group[0]
    assert (group.kind, group.count) == (model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)
    assert config.version_policy.latest.num_versions == 1
    assert config.parameters["providers"].string_value == "CPUExecutionProvider"


# --- inference -----------------------------------------------------------------------------


def test_infer_raw_matches_onnxruntime(served: Served) -> None:
    array = image(batch=3, seed=1)
    result = served.triton.infer("demo", [triton_input(array)], request_id="req-7",
                                 priority=1, timeout=5000,
                                 parameters={"mode": "fast", "level": 3, "flag": True,
                                             "ratio": 0.5})
    np.testing.assert_allclose(result.as_numpy("probabilities"),
                               expected(served.models, array), rtol=1e-6)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("req-7", "demo", "1")
    assert response.outputs[0].datatype == "FP32"
    assert list(response.outputs[0].shape) == [3, 10]
    assert dict(served.models.requests[-1].parameters) == {
        "priority": 1, "timeout": 5000, "mode": "fast", "level": 3, "flag": True,
        "ratio": 0.5}


def test_requested_output_subset(served: Served) -> None:
    array = image(seed=2)
    result = served.triton.infer("demo", [triton_input(array)], model_version="1",
                                 outputs=[triton.InferRequestedOutput("probabilities")])
    np.testing.assert_allclose(result.as_numpy("probabilities"),
                               expected(served.models, array), rtol=1e-6)
    assert [o.name for o in served.models.requests[-1].outputs] == ["probabilities"]


def test_unknown_model_is_not_found(served: Served) -> None:
    client = served.triton
    calls = [lambda: client.is_model_ready("nope"), lambda: client.get_model_metadata("nope"),
             lambda: client.get_model_config("nope"),
             lambda: client.infer("nope", [triton_input(image())]),
             lambda: client.get_model_metadata("demo", "9")]
    for call in calls:
        with pytest.raises(InferenceServerException) as excinfo:
            call()
        assert status_of(excinfo) == "NOT_FOUND"
        assert "nope" in excinfo.value.message() or "9" in excinfo.value.message()


@pytest.mark.parametrize(("tensor", "words"), [
    (lambda: triton_input(image(), name="picture"), "picture"),
    (lambda: triton_input(image().astype(np.float64), datatype="FP64"), "FP64"),
    (lambda: triton_input(np.zeros((1, 3, 32, 32), np.float32)), "shape"),
])
def test_wrong_input_is_invalid_argument(served: Served, tensor: Callable[[], Any],
                                         words: str) -> None:
    with pytest.raises(InferenceServerException) as excinfo:
        served.triton.infer("demo", [tensor()])
    assert status_of(excinfo) == "INVALID_ARGUMENT"
    assert words in excinfo.value.message()
    assert "image" in excinfo.value.message() or "picture" in excinfo.value.message()


def test_request_above_the_limit_is_resource_exhausted(served: Served) -> None:
    array = image(batch=24)  # 1.18 MB, the limit is 1 MiB
    with pytest.raises(InferenceServerException) as excinfo:
        served.triton.infer("demo", [triton_input(array)])
    assert status_of(excinfo) == "RESOURCE_EXHAUSTED"
    assert served.models.requests == []


def test_statistics(served: Served) -> None:
    served.triton.infer("demo", [triton_input(image())])
    stats = served.triton.get_inference_statistics("demo").model_stats
    assert [(s.name, s.version, s.inference_count, s.execution_count) for s in stats] == [
        ("demo", "1", 1, 1)]


def test_a_bug_is_internal_and_logged(serve: Callable[..., Served],
                                      caplog: pytest.LogCaptureFixture) -> None:
    class Broken(RecordingModels):
        def server_metadata(self) -> dict[str, Any]:
            raise RuntimeError("boom")

    served = serve(models=Broken())
    with caplog.at_level(logging.ERROR, "agent.serving.grpc_api"), \
            pytest.raises(InferenceServerException) as excinfo:
        served.triton.get_server_metadata()
    assert status_of(excinfo) == "INTERNAL"
    assert "boom" not in excinfo.value.message()
    assert any("ServerMetadata" in r.getMessage() and r.exc_info for r in caplog.records)


# --- repository and the token --------------------------------------------------------------


def test_repository_index(served: Served) -> None:
    index = served.triton.get_model_repository_index()
    assert [(m.name, m.version, m.state) for m in index.models] == [("demo", "1", "READY")]


def test_load_and_unload_need_the_token(served: Served) -> None:
    client = served.triton
    for headers in (None, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        for call in (client.unload_model, client.load_model):
            with pytest.raises(InferenceServerException) as excinfo:
                call("demo", headers=headers)
            assert status_of(excinfo) == "UNAUTHENTICATED"
    assert client.is_model_ready("demo") is True
    client.unload_model("demo", headers=AUTH)
    assert client.is_model_ready("demo") is False
    index = client.get_model_repository_index()
    assert [(m.name, m.version, m.state, m.reason) for m in index.models] == [
        ("demo", "", "UNAVAILABLE", "unloaded")]
    with GrpcClient(served.target) as ours:
        ready = ours.call("RepositoryIndex", proto.RepositoryIndexRequest(ready=True))
        assert list(ready.models) == []
    client.load_model("demo", headers=AUTH)
    assert client.is_model_ready("demo") is True


def test_everything_needs_the_token_off_loopback(serve: Callable[..., Served]) -> None:
    client = serve(everything=True).triton
    for call in (client.get_server_metadata, client.is_server_live,
                 lambda: client.infer("demo", [triton_input(image())])):
        with pytest.raises(InferenceServerException) as excinfo:
            call()
        assert status_of(excinfo) == "UNAUTHENTICATED"
    assert client.get_server_metadata(headers=AUTH).name == "edge-agent"
    assert client.infer("demo", [triton_input(image())], headers=AUTH).as_numpy(
        "probabilities").shape == (1, 10)


# --- raw calls: typed contents and the checks tritonclient would not let through -----------


def infer_message(array: np.ndarray, *, typed: bool = False, raw: bool = True,
                  datatype: str = "FP32") -> Any:
    request = proto.ModelInferRequest(model_name="demo", id="typed")
    tensor = request.inputs.add(name="image", datatype=datatype, shape=list(array.shape))
    if typed:
        tensor.contents.fp32_contents.extend(array.reshape(-1).tolist())
    if raw:
        request.raw_input_contents.append(array.tobytes())
    return request


def test_typed_contents_match_onnxruntime(served: Served) -> None:
    array = image(batch=2, seed=3)
    with GrpcClient(served.target) as client:
        response = client.call("ModelInfer", infer_message(array, typed=True, raw=False))
    assert response.id == "typed"
    (output,) = response.outputs
    got = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(tuple(output.shape))
    np.testing.assert_allclose(got, expected(served.models, array), rtol=1e-6)


def wrong_field(array: np.ndarray) -> Any:
    request = infer_message(array, raw=False)
    request.inputs[0].contents.fp64_contents.extend(array.reshape(-1).tolist())
    return request


def short_raw(array: np.ndarray) -> Any:
    request = infer_message(array, raw=False)
    request.raw_input_contents.append(array.tobytes()[:-4])
    return request


def two_raw(array: np.ndarray) -> Any:
    request = infer_message(array)
    request.raw_input_contents.append(b"")
    return request


@pytest.mark.parametrize(("build", "words"), [
    (lambda a: infer_message(a, typed=True), "raw_input_contents"),  # both ways at once
    (two_raw, "2 raw_input_contents for 1 inputs"),
    (short_raw, "input image: 49148 bytes"),
    (wrong_field, "input image: FP32 data goes in fp32_contents, not fp64_contents"),
    (lambda a: infer_message(a.astype(np.float16), raw=False, datatype="FP16"),
     "input image: FP16"),
    (lambda a: infer_message(a, datatype="FP8"), "input image: datatype 'FP8'"),
])
def test_malformed_requests_are_invalid_argument(served: Served, build: Callable[..., Any],
                                                 words: str) -> None:
    with GrpcClient(served.target) as client, pytest.raises(ServeError) as excinfo:
        client.call("ModelInfer", build(image()))
    assert excinfo.value.code == "INVALID_ARGUMENT"
    assert words in excinfo.value.message
    assert served.models.requests == []


# --- our own client ------------------------------------------------------------------------


def test_grpc_client(served: Served) -> None:
    array = image(batch=2, seed=4)
    with GrpcClient(served.target, timeout_s=10) as client:
        assert client.live() is True
        assert client.ready() is True
        meta = client.model_metadata("demo")
        assert (meta.name, meta.versions, meta.platform) == ("demo", ("1",), "onnxruntime_onnx")
        assert [(s.name, s.datatype, s.shape) for s in meta.inputs] == [
            ("image", "FP32", (-1, 3, 64, 64))]
        outputs = client.infer("demo", {"image": array}, version="1")
        assert list(outputs) == ["probabilities"]
        np.testing.assert_allclose(outputs["probabilities"], expected(served.models, array),
                                   rtol=1e-6)
        with pytest.raises(ServeError) as excinfo:
            client.infer("nope", {"image": array})
        assert excinfo.value.code == "NOT_FOUND"
        with pytest.raises(ServeError) as excinfo:
            client.call("RepositoryModelUnload", proto.RepositoryModelUnloadRequest(
                model_name="demo"))
        assert excinfo.value.code == "UNAUTHENTICATED"
    with GrpcClient(served.target, token=TOKEN) as client:
        client.call("RepositoryModelUnload", proto.RepositoryModelUnloadRequest(
            model_name="demo"))
        assert served.models.model_ready("demo", "") is False
        with pytest.raises(ServeError) as excinfo:
            client.infer("demo", {"image": array})
        assert excinfo.value.code == "UNAVAILABLE"


def test_grpc_client_on_nothing_listening() -> None:
    with GrpcClient("127.0.0.1:1", timeout_s=5) as client, pytest.raises(ServeError) as excinfo:
        client.ready()
    assert excinfo.value.code == "UNAVAILABLE"


# --- the wire: our declaration against tritonclient's generated one -------------------------


def test_every_declared_field_has_tritons_number_and_type() -> None:
    theirs = descriptor_pool.Default()
    service_pb2.DESCRIPTOR  # noqa: B018 - imported: its messages are in the default pool

    def compare(ours: Any) -> None:
        other = theirs.FindMessageTypeByName(ours.full_name)
        assert ours.GetOptions().map_entry == other.GetOptions().map_entry, ours.full_name
        for field in ours.fields:
            match = other.fields_by_name[field.name]
            where = f"{ours.full_name}.{field.name}"
            assert (field.number, field.type, field.is_repeated) == (
                match.number, match.type, match.is_repeated), where
            assert (field.containing_oneof is None) == (match.containing_oneof is None), where
            if field.message_type is not None:
                assert field.message_type.full_name == match.message_type.full_name, where
            if field.enum_type is not None:
                assert field.enum_type.full_name == match.enum_type.full_name, where
                for value in field.enum_type.values:
                    assert match.enum_type.values_by_name[value.name].number == value.number
        for nested in ours.nested_types:
            compare(nested)

    for name in proto.MESSAGES:
        compare(proto.POOL.FindMessageTypeByName(f"inference.{name}"))


PARAMETERS = {"b": {"boolParam": True}, "i": {"int64Param": "-5"}, "s": {"stringParam": "x"},
              "d": {"doubleParam": 0.25}, "u": {"uint64Param": "18446744073709551615"}}
CONTENTS = {"boolContents": [True, False], "intContents": [-1, 2], "int64Contents": ["-3"],
            "uintContents": [4], "uint64Contents": ["5"], "fp32Contents": [1.5],
            "fp64Contents": [-2.25], "bytesContents": ["AAE="]}
WIRE = {
    "ModelInferRequest": {
        "modelName": "demo", "modelVersion": "1", "id": "r1", "parameters": PARAMETERS,
        "inputs": [{"name": "image", "datatype": "FP32", "shape": ["1", "3"],
                    "parameters": {"p": {"stringParam": "q"}}, "contents": CONTENTS}],
        "outputs": [{"name": "probabilities", "parameters": {"binary_data": {"boolParam": True}}}],
        "rawInputContents": ["AAECAw=="]},
    "ModelInferResponse": {
        "modelName": "demo", "modelVersion": "1", "id": "r1", "parameters": PARAMETERS,
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": ["1", "10"],
                     "contents": CONTENTS}],
        "rawOutputContents": ["AAECAw==", "BA=="]},
    "ModelConfigResponse": {"config": {
        "name": "demo", "platform": "onnxruntime_onnx", "backend": "onnxruntime",
        "maxBatchSize": 4, "versionPolicy": {"specific": {"versions": ["1", "3"]}},
        "input": [{"name": "image", "dataType": "TYPE_FP16", "dims": ["3", "-1"]}],
        "output": [{"name": "out", "dataType": "TYPE_STRING", "dims": ["10"]}],
        "instanceGroup": [{"name": "g", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}],
        "parameters": {"providers": {"stringValue": "CUDAExecutionProvider"}}}},
    "RepositoryIndexResponse": {"models": [
        {"name": "demo", "version": "1", "state": "READY"},
        {"name": "other", "state": "UNAVAILABLE", "reason": "failed to load"}]},
    "ModelMetadataResponse": {
        "name": "demo", "versions": ["1", "2"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "image", "datatype": "FP32", "shape": ["-1", "3", "64", "64"]}],
        "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": ["-1", "10"]}]},
    "ServerMetadataResponse": {"name": "edge-agent", "version": "0.1.0",
                               "extensions": ["a", "b"]},
    "RepositoryModelLoadRequest": {"repositoryName": "r", "modelName": "demo", "parameters": {
        "config": {"stringParam": "{}"}, "file:1/model.onnx": {"bytesParam": "AAE="},
        "flag": {"boolParam": True}, "n": {"int64Param": "7"}}},
    "SystemSharedMemoryStatusResponse": {"regions": {"r": {
        "name": "r", "key": "/edge-agent-r", "offset": "4096",
        "byteSize": "18446744073709551615"}}},
    "SystemSharedMemoryRegisterRequest": {"name": "r", "key": "/edge-agent-r", "offset": "8",
                                          "byteSize": "64"},
    "SystemSharedMemoryUnregisterRequest": {"name": "r"},
    "ModelStatisticsResponse": {"modelStats": [{
        "name": "demo", "version": "1", "lastInference": "9", "inferenceCount": "3",
        "executionCount": "2", "inferenceStats": {"success": {"count": "3", "ns": "100"},
                                                  "queue": {"count": "3", "ns": "7"}},
        "batchStats": [{"batchSize": "1", "computeInfer": {"count": "2", "ns": "50"}}],
        "memoryUsage": [{"type": "GPU", "id": "1", "byteSize": "1024"}]}]},
}


@pytest.mark.parametrize("name", sorted(WIRE))
def test_messages_survive_the_wire_both_ways(name: str) -> None:
    ours = json_format.ParseDict(WIRE[name], proto.message_class(name)())
    theirs = getattr(service_pb2, name).FromString(ours.SerializeToString())
    assert json_format.MessageToDict(theirs) == WIRE[name]
    back = proto.message_class(name).FromString(theirs.SerializeToString())
    assert json_format.MessageToDict(back) == WIRE[name]
    assert back == ours


@pytest.mark.parametrize(("datatype", "field", "values"), [
    ("BOOL", "bool_contents", [True, False, True, True]),
    ("INT8", "int_contents", [-128, 0, 5, 127]),
    ("INT32", "int_contents", [-(2**31), 0, 1, 2**31 - 1]),
    ("INT64", "int64_contents", [-(2**63), 0, 1, 2**63 - 1]),
    ("UINT16", "uint_contents", [0, 1, 2, 65535]),
    ("UINT64", "uint64_contents", [0, 1, 2, 2**64 - 1]),
    ("FP64", "fp64_contents", [0.5, -1.0, 2.25, 1e300]),
])
def test_typed_contents_decode_to_their_datatype(datatype: str, field: str,
                                                 values: list[Any]) -> None:
    request = proto.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=[2, 2])
    getattr(tensor.contents, field).extend(values)
    (decoded,) = infer_request(request, regions=NO_REGIONS,
                               reservation=BUDGET.reserve(0, "test")).inputs
    assert decoded.datatype == datatype
    assert decoded.array.shape == (2, 2)
    assert decoded.array.reshape(-1).tolist() == values


def test_typed_value_out_of_range_is_invalid_argument() -> None:
    request = proto.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="INT8", shape=[1]).contents.int_contents.append(300)
    with pytest.raises(ServeError) as excinfo:
        infer_request(request, regions=NO_REGIONS, reservation=BUDGET.reserve(0, "test"))
    assert excinfo.value.code == "INVALID_ARGUMENT"
    assert "input x" in excinfo.value.message


def test_classification_is_refused(served: Served) -> None:
    with pytest.raises(InferenceServerException) as excinfo:
        served.triton.infer("demo", [triton_input(image())], outputs=[
            triton.InferRequestedOutput("probabilities", class_count=3)])
    assert status_of(excinfo) == "INVALID_ARGUMENT"
    assert "classification" in excinfo.value.message()
