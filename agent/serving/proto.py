"""The messages of Triton's ``inference.GRPCInferenceService``, declared here and built at
run time, so no generated code ties the agent to one protobuf release.

Each field carries Triton's own number and type (grpc_service.proto, model_config.proto):
that is what makes tritonclient and perf_analyzer speak to us unchanged.  Only the fields
this server reads or writes are declared; proto3 skips the rest on the wire.  The classes
live in a private descriptor pool, because tritonclient registers the same ``inference.*``
names in the default pool when a process imports it (the tests do).
"""

from __future__ import annotations

import re
from typing import Any

from google.protobuf import (  # type: ignore[import-untyped,unused-ignore]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"
FILE_NAME = "edge_agent/serving/inference.proto"  # our own file name: nothing to clash with

# One line a field, in proto syntax: "[repeated] TYPE NAME = NUMBER", "map<K, V> NAME = N",
# "oneof GROUP TYPE NAME = N".  A dotted message name nests it in the one before the dot.
MESSAGES: dict[str, tuple[str, ...]] = {
    "ServerLiveRequest": (),
    "ServerLiveResponse": ("bool live = 1",),
    "ServerReadyRequest": (),
    "ServerReadyResponse": ("bool ready = 1",),
    "ModelReadyRequest": ("string name = 1", "string version = 2"),
    "ModelReadyResponse": ("bool ready = 1",),
    "ServerMetadataRequest": (),
    "ServerMetadataResponse": ("string name = 1", "string version = 2",
                               "repeated string extensions = 3"),
    "ModelMetadataRequest": ("string name = 1", "string version = 2"),
    "ModelMetadataResponse": ("string name = 1", "repeated string versions = 2",
                              "string platform = 3", "repeated TensorMetadata inputs = 4",
                              "repeated TensorMetadata outputs = 5"),
    "ModelMetadataResponse.TensorMetadata": ("string name = 1", "string datatype = 2",
                                             "repeated int64 shape = 3"),
    "InferParameter": ("oneof parameter_choice bool bool_param = 1",
                       "oneof parameter_choice int64 int64_param = 2",
                       "oneof parameter_choice string string_param = 3",
                       "oneof parameter_choice double double_param = 4",
                       "oneof parameter_choice uint64 uint64_param = 5"),
    "InferTensorContents": ("repeated bool bool_contents = 1", "repeated int32 int_contents = 2",
                            "repeated int64 int64_contents = 3",
                            "repeated uint32 uint_contents = 4",
                            "repeated uint64 uint64_contents = 5",
                            "repeated float fp32_contents = 6",
                            "repeated double fp64_contents = 7",
                            "repeated bytes bytes_contents = 8"),
    "ModelInferRequest": ("string model_name = 1", "string model_version = 2", "string id = 3",
                          "map<string, InferParameter> parameters = 4",
                          "repeated InferInputTensor inputs = 5",
                          "repeated InferRequestedOutputTensor outputs = 6",
                          "repeated bytes raw_input_contents = 7"),
    "ModelInferRequest.InferInputTensor": ("string name = 1", "string datatype = 2",
                                           "repeated int64 shape = 3",
                                           "map<string, InferParameter> parameters = 4",
                                           "InferTensorContents contents = 5"),
    "ModelInferRequest.InferRequestedOutputTensor": (
        "string name = 1", "map<string, InferParameter> parameters = 2"),
    "ModelInferResponse": ("string model_name = 1", "string model_version = 2", "string id = 3",
                           "map<string, InferParameter> parameters = 4",
                           "repeated InferOutputTensor outputs = 5",
                           "repeated bytes raw_output_contents = 6"),
    "ModelInferResponse.InferOutputTensor": ("string name = 1", "string datatype = 2",
                                             "repeated int64 shape = 3",
                                             "map<string, InferParameter> parameters = 4",
                                             "InferTensorContents contents = 5"),
    "ModelConfigRequest": ("string name = 1", "string version = 2"),
    "ModelConfigResponse": ("ModelConfig config = 1",),
    # model_config.proto, the part with an equivalent here
    "ModelConfig": ("string name = 1", "string platform = 2",
                    "ModelVersionPolicy version_policy = 3", "int32 max_batch_size = 4",
                    "repeated ModelInput input = 5", "repeated ModelOutput output = 6",
                    "repeated ModelInstanceGroup instance_group = 7",
                    "map<string, ModelParameter> parameters = 14", "string backend = 17"),
    "ModelInput": ("string name = 1", "DataType data_type = 2", "repeated int64 dims = 4"),
    "ModelOutput": ("string name = 1", "DataType data_type = 2", "repeated int64 dims = 3"),
    "ModelInstanceGroup": ("string name = 1", "int32 count = 2", "repeated int32 gpus = 3",
                           "Kind kind = 4"),
    "ModelVersionPolicy": ("oneof policy_choice Latest latest = 1",
                           "oneof policy_choice All all = 2",
                           "oneof policy_choice Specific specific = 3"),
    "ModelVersionPolicy.Latest": ("uint32 num_versions = 1",),
    "ModelVersionPolicy.All": (),
    "ModelVersionPolicy.Specific": ("repeated int64 versions = 1",),
    "ModelParameter": ("string string_value = 1",),
    "ModelStatisticsRequest": ("string name = 1", "string version = 2"),
    "ModelStatisticsResponse": ("repeated ModelStatistics model_stats = 1",),
    "StatisticDuration": ("uint64 count = 1", "uint64 ns = 2"),
    "InferStatistics": ("StatisticDuration success = 1", "StatisticDuration fail = 2",
                        "StatisticDuration queue = 3", "StatisticDuration compute_input = 4",
                        "StatisticDuration compute_infer = 5",
                        "StatisticDuration compute_output = 6",
                        "StatisticDuration cache_hit = 7", "StatisticDuration cache_miss = 8"),
    "InferBatchStatistics": ("uint64 batch_size = 1", "StatisticDuration compute_input = 2",
                             "StatisticDuration compute_infer = 3",
                             "StatisticDuration compute_output = 4"),
    "MemoryUsage": ("string type = 1", "int64 id = 2", "uint64 byte_size = 3"),
    "ModelStatistics": ("string name = 1", "string version = 2", "uint64 last_inference = 3",
                        "uint64 inference_count = 4", "uint64 execution_count = 5",
                        "InferStatistics inference_stats = 6",
                        "repeated InferBatchStatistics batch_stats = 7",
                        "repeated MemoryUsage memory_usage = 8"),
    "RepositoryIndexRequest": ("string repository_name = 1", "bool ready = 2"),
    "RepositoryIndexResponse": ("repeated ModelIndex models = 1",),
    "RepositoryIndexResponse.ModelIndex": ("string name = 1", "string version = 2",
                                           "string state = 3", "string reason = 4"),
    "ModelRepositoryParameter": ("oneof parameter_choice bool bool_param = 1",
                                 "oneof parameter_choice int64 int64_param = 2",
                                 "oneof parameter_choice string string_param = 3",
                                 "oneof parameter_choice bytes bytes_param = 4"),
    "RepositoryModelLoadRequest": ("string repository_name = 1", "string model_name = 2",
                                   "map<string, ModelRepositoryParameter> parameters = 3"),
    "RepositoryModelLoadResponse": (),
    "RepositoryModelUnloadRequest": ("string repository_name = 1", "string model_name = 2",
                                     "map<string, ModelRepositoryParameter> parameters = 3"),
    "RepositoryModelUnloadResponse": (),
    "SystemSharedMemoryStatusRequest": ("string name = 1",),
    "SystemSharedMemoryStatusResponse": ("map<string, RegionStatus> regions = 1",),
    "SystemSharedMemoryStatusResponse.RegionStatus": ("string name = 1", "string key = 2",
                                                      "uint64 offset = 3",
                                                      "uint64 byte_size = 4"),
    "SystemSharedMemoryRegisterRequest": ("string name = 1", "string key = 2",
                                          "uint64 offset = 3", "uint64 byte_size = 4"),
    "SystemSharedMemoryRegisterResponse": (),
    "SystemSharedMemoryUnregisterRequest": ("string name = 1",),
    "SystemSharedMemoryUnregisterResponse": (),
}
# Values in number order from 0, as Triton numbers them.
ENUMS: dict[str, tuple[str, ...]] = {
    "DataType": ("TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32",
                 "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64",
                 "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16"),
    "ModelInstanceGroup.Kind": ("KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"),
}

_F = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES,
    "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64, "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64, "float": _F.TYPE_FLOAT, "double": _F.TYPE_DOUBLE,
}
_FIELD = re.compile(r"^(?:oneof (?P<oneof>\w+) )?(?:(?P<repeated>repeated) )?"
                    r"(?:map<(?P<key>\w+), (?P<value>\w+)>|(?P<type>\w+)) (?P<name>\w+) = "
                    r"(?P<number>\d+)$")


def _resolve(scope: str, type_name: str) -> str:
    """The full name a type reference means inside ``scope``, looked up as protoc does:
    the innermost enclosing message first."""
    parts = scope.split(".")
    for depth in range(len(parts), -1, -1):
        candidate = ".".join([*parts[:depth], type_name])
        if candidate in MESSAGES or candidate in ENUMS:
            return candidate
    raise ValueError(f"{scope}: unknown type {type_name}")


def _set_type(field: Any, scope: str, type_name: str) -> None:
    if type_name in SCALARS:
        field.type = SCALARS[type_name]
        return
    full = _resolve(scope, type_name)
    field.type = _F.TYPE_ENUM if full in ENUMS else _F.TYPE_MESSAGE
    field.type_name = f".{PACKAGE}.{full}"


def _add_field(message: Any, scope: str, line: str) -> None:
    match = _FIELD.match(line)
    if match is None:
        raise ValueError(f"{scope}: cannot read field {line!r}")
    field = message.field.add(name=match["name"], number=int(match["number"]),
                              label=_F.LABEL_OPTIONAL)
    if match["oneof"]:
        names = [o.name for o in message.oneof_decl]
        if match["oneof"] not in names:
            message.oneof_decl.add(name=match["oneof"])
            names.append(match["oneof"])
        field.oneof_index = names.index(match["oneof"])
    if match["repeated"]:
        field.label = _F.LABEL_REPEATED
    if match["key"]:  # a map: a repeated nested entry message, as protoc writes it
        entry_name = "".join(p.capitalize() for p in match["name"].split("_")) + "Entry"
        entry = message.nested_type.add(name=entry_name)
        entry.options.map_entry = True
        _add_field(entry, scope, f"{match['key']} key = 1")
        _add_field(entry, scope, f"{match['value']} value = 2")
        field.label = _F.LABEL_REPEATED
        field.type = _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{scope}.{entry_name}"
    else:
        _set_type(field, scope, match["type"])


def file_descriptor() -> Any:
    """The ``FileDescriptorProto`` of every declared message and enum."""
    proto = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE,
                                               syntax="proto3")
    built: dict[str, Any] = {}
    for full, values in ENUMS.items():
        parent, _, name = full.rpartition(".")
        if parent:
            continue  # added with its message below
        enum = proto.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for full, fields in MESSAGES.items():
        parent, _, name = full.rpartition(".")
        container = built[parent].nested_type if parent else proto.message_type
        message = container.add(name=name)
        built[full] = message
        for enum_full, values in ENUMS.items():
            if enum_full.rpartition(".")[0] == full:
                enum = message.enum_type.add(name=enum_full.rpartition(".")[2])
                for number, value in enumerate(values):
                    enum.value.add(name=value, number=number)
        for line in fields:
            _add_field(message, full, line)
    return proto


POOL = descriptor_pool.DescriptorPool()
POOL.AddSerializedFile(file_descriptor().SerializeToString())


def message_class(name: str) -> Any:
    """The class of ``inference.<name>`` (a dotted name for a nested message)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


def enum_number(enum: str, value: str) -> int:
    """The number of an enum value, e.g. ``("DataType", "TYPE_FP32")``."""
    number: int = POOL.FindEnumTypeByName(f"{PACKAGE}.{enum}").values_by_name[value].number
    return number


def enum_name(enum: str, number: int) -> str:
    name: str = POOL.FindEnumTypeByName(f"{PACKAGE}.{enum}").values_by_number[number].name
    return name


ServerLiveRequest = message_class("ServerLiveRequest")
ServerLiveResponse = message_class("ServerLiveResponse")
ServerReadyRequest = message_class("ServerReadyRequest")
ServerReadyResponse = message_class("ServerReadyResponse")
ModelReadyRequest = message_class("ModelReadyRequest")
ModelReadyResponse = message_class("ModelReadyResponse")
ServerMetadataRequest = message_class("ServerMetadataRequest")
ServerMetadataResponse = message_class("ServerMetadataResponse")
ModelMetadataRequest = message_class("ModelMetadataRequest")
ModelMetadataResponse = message_class("ModelMetadataResponse")
ModelInferRequest = message_class("ModelInferRequest")
ModelInferResponse = message_class("ModelInferResponse")
ModelConfigRequest = message_class("ModelConfigRequest")
ModelConfigResponse = message_class("ModelConfigResponse")
ModelStatisticsRequest = message_class("ModelStatisticsRequest")
ModelStatisticsResponse = message_class("ModelStatisticsResponse")
RepositoryIndexRequest = message_class("RepositoryIndexRequest")
RepositoryIndexResponse = message_class("RepositoryIndexResponse")
RepositoryModelLoadRequest = message_class("RepositoryModelLoadRequest")
RepositoryModelLoadResponse = message_class("RepositoryModelLoadResponse")
RepositoryModelUnloadRequest = message_class("RepositoryModelUnloadRequest")
RepositoryModelUnloadResponse = message_class("RepositoryModelUnloadResponse")
SystemSharedMemoryStatusRequest = message_class("SystemSharedMemoryStatusRequest")
SystemSharedMemoryStatusResponse = message_class("SystemSharedMemoryStatusResponse")
RegionStatus = message_class("SystemSharedMemoryStatusResponse.RegionStatus")
SystemSharedMemoryRegisterRequest = message_class("SystemSharedMemoryRegisterRequest")
SystemSharedMemoryRegisterResponse = message_class("SystemSharedMemoryRegisterResponse")
SystemSharedMemoryUnregisterRequest = message_class("SystemSharedMemoryUnregisterRequest")
SystemSharedMemoryUnregisterResponse = message_class("SystemSharedMemoryUnregisterResponse")

# method name -> (request class, response class), the service's unary calls
METHODS: dict[str, tuple[Any, Any]] = {
    name: (message_class(f"{name}Request"), message_class(f"{name}Response"))
    for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                 "ModelInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex",
                 "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
                 "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister")
}
