"""A small synchronous client of the HTTP data plane, for the agent's control plane and
``edge-agent infer --url http://…``: the standard library's ``http.client`` only, so a
caller needs no event loop and no tritonclient.

One keep-alive connection per object, opened on first use; a connection the server dropped
while idle (a keep-alive timeout, a restart) is reopened once and the request sent again,
any other failure is reported.  Not thread-safe: one request at a time per object, so give
each thread its own.  Every failure is a ``ServeError``: the server's answer with the status
name its HTTP status stands for, a connection that cannot be made or is lost UNAVAILABLE,
a server that does not answer in time DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agent.serving.core import (
    DATATYPES,
    PLATFORM,
    IndexEntry,
    ModelMetadata,
    TensorSpec,
    datatype_of,
)
from agent.serving.errors import HTTP_STATUS, ServeError
from agent.serving.http_codec import HEADER_LENGTH, dumps
from agent.serving.shm_tensors import REGION, RegionInput, RegionRef
from agent.serving.tensors import to_raw, to_values

LOAD_TIMEOUT_S = 300.0  # a load reads and compiles a model: far longer than a request
# HTTP status -> status name: the one name of each status in errors.HTTP_STATUS.
STATUS_NAMES: dict[int, str] = {}
for _name, _status in HTTP_STATUS.items():
    STATUS_NAMES.setdefault(_status, _name)
_DROPPED = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
            http.client.RemoteDisconnected)


def status_name(status: int) -> str:
    """The status name an HTTP status stands for (a status errors.py lacks: by its class)."""
    if status in STATUS_NAMES:
        return STATUS_NAMES[status]
    if status == 502:
        return "UNAVAILABLE"
    return "INVALID_ARGUMENT" if 400 <= status < 500 else "INTERNAL"


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _model_path(model: str, version: str) -> str:
    path = f"/v2/models/{_quote(model)}"
    return f"{path}/versions/{_quote(version)}" if version else path


def _malformed(what: str, detail: object) -> ServeError:
    return ServeError("INTERNAL", f"malformed {what} from the server ({detail})")


class HttpClient:
    """The data plane at ``base_url`` (``http://host:port`` or ``https://…``, optionally with
    a path prefix); ``token`` is sent as ``Authorization: Bearer``."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 5.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r} is not an http:// or https:// URL")
        self.base_url = base_url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self._timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None
        self._ssl = ssl_context  # None: the system's CAs

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._https:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout_s,
                                               context=self._ssl)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)

    def request(self, method: str, path: str, body: bytes = b"",
                headers: Mapping[str, str] | None = None,
                timeout_s: float | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
        """Status, headers and body of one request; ServeError only when no answer came."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        sent = dict(headers or {})
        if self._token is not None:
            sent["Authorization"] = f"Bearer {self._token}"
        url = self.base_url + path
        for attempt in range(2):
            reused = self._connection is not None
            if self._connection is None:
                self._connection = self._connect(timeout)
            connection = self._connection
            connection.timeout = timeout
            if connection.sock is not None:
                connection.sock.settimeout(timeout)
            try:
                connection.request(method, self._prefix + path, body=body, headers=sent)
                response = connection.getresponse()
                data = response.read()
            except _DROPPED as error:
                self.close()
                if reused and attempt == 0:
                    continue  # the idle connection was gone: once more on a fresh one
                raise ServeError("UNAVAILABLE", f"{url}: connection lost ({error})") from None
            except TimeoutError:
                self.close()
                raise ServeError("DEADLINE_EXCEEDED",
                                 f"{url}: no answer within {timeout:g} s") from None
            except (OSError, http.client.HTTPException) as error:
                self.close()
                raise ServeError("UNAVAILABLE", f"{url}: {error or type(error).__name__}") \
                    from None
            if response.will_close:
                self.close()
            return response.status, response.headers, data
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _raise(status: int, body: bytes) -> ServeError:
        message = ""
        try:
            document = json.loads(body)
            if isinstance(document, dict) and isinstance(document.get("error"), str):
                message = document["error"]
        except ValueError:
            message = body[:200].decode("utf-8", "replace")
        return ServeError(status_name(status), message or f"HTTP status {status}")

    def _json(self, method: str, path: str, document: Any = None,
              timeout_s: float | None = None) -> Any:
        body = b"" if document is None else dumps(document)
        headers = {"Content-Type": "application/json"} if body else {}
        status, _, data = self.request(method, path, body, headers, timeout_s)
        if status != 200:
            raise self._raise(status, data)
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError as error:
            raise _malformed("JSON", error) from None

    def _health(self, path: str) -> bool:
        status, _, _ = self.request("GET", path)
        return status == 200

    def live(self) -> bool:
        """Whether the server answers 200 to its liveness probe (ServeError: no answer)."""
        return self._health("/v2/health/live")

    def ready(self) -> bool:
        return self._health("/v2/health/ready")

    def server_metadata(self) -> dict[str, Any]:
        found = self._json("GET", "/v2")
        if not isinstance(found, dict):
            raise _malformed("server metadata", found)
        return found

    def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        document = self._json("GET", _model_path(model, version))
        try:
            def specs(key: str) -> tuple[TensorSpec, ...]:
                return tuple(TensorSpec(str(d["name"]), str(d["datatype"]),
                                        tuple(int(x) for x in d["shape"]))
                             for d in document[key])
            return ModelMetadata(str(document["name"]),
                                 tuple(str(v) for v in document.get("versions", ())),
                                 specs("inputs"), specs("outputs"),
                                 str(document.get("platform", PLATFORM)))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise _malformed("model metadata", error) from None

    def model_ready(self, model: str, version: str = "") -> bool:
        """True ready, False known but not ready; ServeError (NOT_FOUND…) otherwise."""
        status, _, data = self.request("GET", _model_path(model, version) + "/ready")
        if status == 200:
            return True
        if status in (400, 503):
            return False
        raise self._raise(status, data)

    def infer(self, model: str, feeds: Mapping[str, np.ndarray | RegionInput],
              version: str = "", outputs: Sequence[str] | None = None, binary: bool = True,
              parameters: Mapping[str, Any] | None = None,
              regions: Mapping[str, RegionRef] | None = None) -> dict[str, np.ndarray]:
        """The outputs (all, or those named) by name; ``binary``: tensors travel as the
        binary extension's raw bytes both ways, else as JSON lists.  Binary outputs are
        read-only views of the response.  A feed may lie in a registered shared memory
        region; the outputs in ``regions`` are written there and left out of the answer."""
        inputs, chunks = [], []
        for name, value in feeds.items():
            if isinstance(value, RegionInput):
                inputs.append({"name": name, "shape": list(value.shape),
                               "datatype": value.datatype, "parameters": value.ref.parameters()})
                continue
            array = np.asarray(value)
            entry: dict[str, Any] = {"name": name, "shape": list(array.shape),
                                     "datatype": datatype_of(array)}
            if binary:
                raw = to_raw(array)
                entry["parameters"] = {"binary_data_size": len(raw)}
                chunks.append(raw)
            else:
                entry["data"] = to_values(array)
            inputs.append(entry)
        params = dict(parameters or {})
        document: dict[str, Any] = {"inputs": inputs}
        targets = dict(regions or {})
        wanted = [{"name": name, "parameters": {"binary_data": binary}}
                  for name in outputs or () if name not in targets]
        wanted += [{"name": name, "parameters": ref.parameters()}
                   for name, ref in targets.items()]
        if wanted:
            document["outputs"] = wanted
        if not outputs:
            params["binary_data_output"] = binary
        document["parameters"] = params
        head = dumps(document)
        headers = {"Content-Type": "application/octet-stream" if chunks
                   else "application/json"}
        if chunks:
            headers[HEADER_LENGTH] = str(len(head))
        status, answer_headers, data = self.request(
            "POST", _model_path(model, version) + "/infer", b"".join([head, *chunks]), headers)
        if status != 200:
            raise self._raise(status, data)
        return decode_outputs(data, answer_headers.get(HEADER_LENGTH))

    def statistics(self, model: str = "") -> list[dict[str, Any]]:
        path = f"{_model_path(model, '')}/stats" if model else "/v2/models/stats"
        document = self._json("GET", path)
        if not isinstance(document, dict) or not isinstance(document.get("model_stats"), list):
            raise _malformed("statistics", document)
        return document["model_stats"]  # type: ignore[no-any-return]

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        document = self._json("POST", "/v2/repository/index", {"ready": ready_only})
        try:
            return [IndexEntry(str(e["name"]), str(e.get("version", "")),
                               str(e.get("state", "")), str(e.get("reason", "")))
                    for e in document]
        except (KeyError, TypeError, AttributeError) as error:
            raise _malformed("repository index", error) from None

    def load(self, model: str, parameters: Mapping[str, Any] | None = None,
             timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Load (or reload) a model; waits for it, so its own, longer timeout."""
        self._json("POST", f"/v2/repository/models/{_quote(model)}/load",
                   {"parameters": dict(parameters or {})}, timeout_s)

    def unload(self, model: str, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self._json("POST", f"/v2/repository/models/{_quote(model)}/unload",
                   {"parameters": {}}, timeout_s)

    def set_levers(self, model: str, levers: Mapping[str, Any]) -> dict[str, Any]:
        """The QoS controller's levers on ``model`` (needs the token), any of levers.KEYS:
        each serving version's levers as the data plane now serves them.  ``threads``
        starts a rebuild and shows in the statistics only once it swapped
        (``edge_agent.levers``; ``edge_agent.rebuild`` says how it went)."""
        document = self._json("POST", f"/v2/repository/models/{_quote(model)}/levers",
                              dict(levers))
        if not isinstance(document, dict) or not isinstance(document.get("versions"), dict):
            raise _malformed("levers", document)
        return document["versions"]  # type: ignore[no-any-return]

    def register_shm(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        """Register ``byte_size`` bytes from ``offset`` of the POSIX shared memory object
        ``key`` as region ``name`` (needs the token)."""
        self._json("POST", f"/v2/systemsharedmemory/region/{_quote(name)}/register",
                   {"key": key, "offset": offset, "byte_size": byte_size})

    def unregister_shm(self, name: str = "") -> None:
        """One region, or every region for "" (needs the token)."""
        region = f"/region/{_quote(name)}" if name else ""
        self._json("POST", f"/v2/systemsharedmemory{region}/unregister")

    def shm_status(self, name: str = "") -> list[dict[str, Any]]:
        region = f"/region/{_quote(name)}" if name else ""
        document = self._json("GET", f"/v2/systemsharedmemory{region}/status")
        if not isinstance(document, list):
            raise _malformed("shared memory status", document)
        return document


def decode_outputs(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    """An inference response's outputs: the JSON part, then each binary output's
    ``binary_data_size`` bytes in order; those written to shared memory are left out."""
    try:
        end = len(body) if header_length is None else int(header_length)
        if not 0 <= end <= len(body):
            raise ValueError(f"{HEADER_LENGTH} {end} beyond the body")
        document = json.loads(body[:end])
        found: dict[str, np.ndarray] = {}
        offset = end
        for output in document["outputs"]:
            dtype = DATATYPES[output["datatype"]]
            shape = tuple(int(x) for x in output["shape"])
            params = output.get("parameters") or {}
            if REGION in params:
                continue
            size = params.get("binary_data_size")
            if size is None:
                array = np.array(output["data"], dtype=dtype)
            else:
                if offset + int(size) > len(body):
                    raise ValueError(f"output {output['name']}: binary data beyond the body")
                array = np.frombuffer(body, dtype=dtype, count=int(size) // dtype.itemsize,
                                      offset=offset)
                offset += int(size)
            found[str(output["name"])] = array.reshape(shape)
        return found
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise _malformed("inference response", error) from None
