"""The gRPC front end: Triton's ``inference.GRPCInferenceService`` over ``Models``.

It only translates, as the HTTP front end does: a message becomes the core's types, a
``ServeError`` becomes the gRPC status of the same name, and any other exception is a bug,
logged and answered ``INTERNAL`` so that no traceback reaches a client.  The server is a
plain synchronous one on the caller's thread pool: ``Models.infer`` blocks in the runtime
anyway, and a pool bounds how many run at once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
from google.protobuf import json_format  # type: ignore[import-untyped,unused-ignore]
from google.protobuf.message import DecodeError  # type: ignore[import-untyped,unused-ignore]

from agent.serving import proto
from agent.serving.access import Access, bearer
from agent.serving.budget import MemoryBudget, default_limit_bytes
from agent.serving.core import (
    Models,
)
from agent.serving.errors import ServeError, invalid
from agent.serving.grpc_codec import (
    infer_request,
    infer_response,
    model_config,
    output_targets,
    parameter_values,
    tensor_metadata,
)
from agent.serving.shm import (
    DEFAULT_PREFIX,
    CallerRegions,
    SharedMemoryRegions,
    bounded_regions,
)
from agent.serving.wire import WalkedRequest, walk_infer_request

logger = logging.getLogger(__name__)

MAX_MESSAGE = 2048  # characters of a status message (3 bytes each at worst, escaped)
# the calls whose handler is given the caller's token
TAKES_TOKEN = frozenset({"ModelInfer", "SystemSharedMemoryRegister"})
# the calls that need the token even on loopback
CONTROL = frozenset({"RepositoryModelLoad", "RepositoryModelUnload",
                     "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister"})


class Service:
    """One method per call, named as the protocol names it, each a message in and a message
    out; raises ``ServeError``."""

    def __init__(self, models: Models, regions: SharedMemoryRegions, access: Access,
                 budget: MemoryBudget) -> None:
        self.models = models
        self.regions = regions
        self.access = access
        self.budget = budget

    def ServerLive(self, request: Any) -> Any:
        return proto.ServerLiveResponse(live=self.models.live())

    def ServerReady(self, request: Any) -> Any:
        return proto.ServerReadyResponse(ready=self.models.ready())

    def ServerMetadata(self, request: Any) -> Any:
        meta = self.models.server_metadata()
        return proto.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                            extensions=list(meta["extensions"]))

    def ModelReady(self, request: Any) -> Any:
        return proto.ModelReadyResponse(ready=self.models.model_ready(request.name,
                                                                      request.version))

    def ModelMetadata(self, request: Any) -> Any:
        meta = self.models.model_metadata(request.name, request.version)
        response = proto.ModelMetadataResponse(name=meta.name, versions=list(meta.versions),
                                               platform=meta.platform)
        tensor_metadata(response.inputs, meta.inputs)
        tensor_metadata(response.outputs, meta.outputs)
        return response

    def ModelInfer(self, request: WalkedRequest, token: str | None = None) -> Any:
        """A region in the request needs the token (see shm.CallerRegions).  ``request`` is
        what ``wire.walk_infer_request`` made of the message.  The request's bytes, what
        protobuf makes of them and what decoding copies are admitted against the budget
        before each is made, the outputs counted once they exist; all of it is released
        when the call returns (its response is then serialized by gRPC, the one step the
        budget does not see)."""
        with self.budget.reserve(request.cost, "the request") as reservation:
            message, raw = request.parse()
            regions = CallerRegions(self.regions,
                                    lambda: self.access.check(token, control=True))
            targets = output_targets(message, regions)
            decoded = infer_request(
                message, regions=regions, reservation=reservation, raw_contents=raw,
                trusted=self.access.holds(token),
                check=functools.partial(self.models.check_elements, message.model_name,
                                        message.model_version))
            result = self.models.infer(decoded)
            # the arrays, and the copy of each that goes into the response
            reservation.count(2 * sum(tensor.array.nbytes for tensor in result.outputs))
            return infer_response(result, targets)

    def ModelConfig(self, request: Any) -> Any:
        if request.version:
            self.models.model_ready(request.name, request.version)  # NOT_FOUND if it lacks it
        return model_config(self.models.model_config(request.name))

    def ModelStatistics(self, request: Any) -> Any:
        """Triton's statistics JSON is the message's JSON mapping; our own extra keys (not
        in the message) are dropped here and stay on HTTP."""
        response = proto.ModelStatisticsResponse()
        for entry in self.models.statistics(request.name, request.version):
            json_format.ParseDict(entry, response.model_stats.add(), ignore_unknown_fields=True)
        return response

    def RepositoryIndex(self, request: Any) -> Any:
        """One repository here, so ``repository_name`` selects nothing."""
        response = proto.RepositoryIndexResponse()
        for entry in self.models.index(request.ready):
            response.models.add(name=entry.name, version=entry.version, state=entry.state,
                                reason=entry.reason)
        return response

    def RepositoryModelLoad(self, request: Any) -> Any:
        self.models.load(request.model_name, parameter_values(request.parameters))
        return proto.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request: Any) -> Any:
        self.models.unload(request.model_name, parameter_values(request.parameters))
        return proto.RepositoryModelUnloadResponse()

    def SystemSharedMemoryStatus(self, request: Any) -> Any:
        response = proto.SystemSharedMemoryStatusResponse()
        for status in self.regions.status(request.name):
            response.regions[status["name"]].CopyFrom(proto.RegionStatus(**status))
        return response

    def SystemSharedMemoryRegister(self, request: Any, token: str | None = None) -> Any:
        """Objects the token's owner may use only (see ``SharedMemoryRegions.register``)."""
        self.regions.register(request.name, request.key, request.offset, request.byte_size,
                              owner=self.access.owner(token))
        return proto.SystemSharedMemoryRegisterResponse()

    def SystemSharedMemoryUnregister(self, request: Any) -> Any:
        self.regions.unregister(request.name)
        return proto.SystemSharedMemoryUnregisterResponse()


def _authorization(context: Any) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key.lower() == "authorization" and isinstance(value, str):
            return value
    return None


class Refused(NamedTuple):
    """A message its deserializer refused, handed to the handler to answer: a deserializer
    that raises makes gRPC answer INTERNAL, which is no answer to a client's mistake."""

    error: ServeError


def deserializer(name: str, message_class: Any) -> Callable[[bytes], Any]:
    """The call's request deserializer.  It runs on gRPC's one thread that reads every
    connection, so ModelInfer's is the bounded walk (``wire``): what the deserializer
    costs, every client waits for."""
    if name == "ModelInfer":
        def walk(data: bytes) -> Any:
            try:
                return walk_infer_request(data)
            except ServeError as error:
                return Refused(error)
        return walk

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return Refused(invalid(f"the request is not a valid {name}Request: {error}"))
    return parse


def _fitting(message: str) -> str:
    """A status message within gRPC's metadata limit (16 KB, counted after escaping): one
    naming a thousand inputs must still reach the client as the status it is."""
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + "..."


def guarded(name: str, call: Callable[..., Any], access: Access
            ) -> Callable[[Any, Any], Any]:
    """``call`` behind the token check, with every failure turned into a status."""
    control = name in CONTROL

    def handle(request: Any, context: Any) -> Any:
        try:
            token = bearer(_authorization(context))
            access.check(token, control=control)
            if isinstance(request, Refused):
                raise request.error
            return call(request, token) if name in TAKES_TOKEN else call(request)
        except ServeError as error:
            context.abort(grpc.StatusCode[error.code], _fitting(error.message))
        except Exception:
            logger.exception("gRPC %s failed", name)
            context.abort(grpc.StatusCode.INTERNAL, f"{name} failed inside the server (a bug: "
                          "the agent's log has the details)")

    return handle


@dataclass(frozen=True)
class ConnectionLimits:
    """What clients together may hold of the gRPC front end, each enforced by gRPC core.
    Without them 1,100 idle connections (or a slowloris) filled the descriptor table and
    kept every new client out: connections beyond ``connections`` are closed as they come,
    and one that holds a place without using it is closed in seconds (no HTTP/2 preface
    within ``handshake_timeout_ms``) or goes (GOAWAY: a client's channel reconnects on its
    next call) after ``idle_ms`` without a call, or ``age_ms`` (+ ``age_grace_ms`` for the
    calls under way) in all: a call whose message never comes holds a worker no longer.
    Calls beyond ``concurrent_rpcs`` are answered RESOURCE_EXHAUSTED at once rather than
    queued behind the workers."""

    concurrent_rpcs: int = 128  # twice serve.workers' default
    connections: int = 256
    handshake_timeout_ms: int = 5_000
    idle_ms: int = 15_000
    age_ms: int = 120_000
    age_grace_ms: int = 30_000

    def options(self) -> list[tuple[str, int]]:
        return [("grpc.max_allowed_incoming_connections", self.connections),
                ("grpc.server_handshake_timeout_ms", self.handshake_timeout_ms),
                ("grpc.max_connection_idle_ms", self.idle_ms),
                ("grpc.max_connection_age_ms", self.age_ms),
                ("grpc.max_connection_age_grace_ms", self.age_grace_ms)]


def build_grpc_server(models: Models, access: Access, *, max_request_bytes: int,
                      executor: concurrent.futures.ThreadPoolExecutor,
                      regions: SharedMemoryRegions | None = None,
                      budget: MemoryBudget | None = None,
                      limits: ConnectionLimits = ConnectionLimits()) -> grpc.Server:
    """The server, not yet bound nor started: the caller adds the port
    (``add_insecure_port`` or a secure one) and starts it.  Without ``regions`` (the data
    plane shares one with HTTP) it keeps its own under the default prefix; without
    ``budget`` (the data plane's is shared too) one of its own, sized for no device."""
    service = Service(models, regions if regions is not None
                      else bounded_regions(DEFAULT_PREFIX, max_request_bytes), access,
                      budget or MemoryBudget(default_limit_bytes(None, max_request_bytes)))
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            guarded(name, getattr(service, name), access),
            request_deserializer=deserializer(name, request),
            response_serializer=response.SerializeToString)
        for name, (request, response) in proto.METHODS.items()
    }
    server = grpc.server(executor, options=[
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", -1),
        # a port another server holds is an error, not shared with it (gRPC's default)
        ("grpc.so_reuseport", 0),
        *limits.options(),
    ], maximum_concurrent_rpcs=limits.concurrent_rpcs)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(proto.SERVICE, handlers),))
    return server
