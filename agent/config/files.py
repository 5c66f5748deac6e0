"""``config check``'s look at the files a config names, opened the way the agent opens
them: a key can pass the schema and still name a directory, a dangling link, a FIFO, a file
the agent cannot read, a certificate that does not load or a model ONNX refuses.

Each check calls the agent's own loader (``open_model``, ``read_token``, ``read_password``,
the TLS contexts, the converter and ``.npy`` loaders) after a non-blocking look at the
file, so what ``run`` would meet is what ``config check`` says.  Only what the agent itself
treats as an error is one: a missing ``serve.token_file`` at its default path is a device
install's job (nobody may load or unload until it exists), not a broken config.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from agent.config.declare import defaults
from agent.config.loader import ConfigError
from agent.config.sections import Config, ServeConfig
from agent.kernel.regular import kind

DEFAULT_TOKEN_FILE = defaults(ServeConfig)["token_file"]


def unreadable(path: str) -> str | None:
    """Why the agent cannot read ``path`` as a file (None: it can); never blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except PermissionError as error:
        return f"{path}: cannot read it: {error.strerror}" + (
            "" if os.geteuid() == 0 else f" (as uid {os.geteuid()}: the installed service "
            "runs as root; check its config with sudo)")
    except OSError as error:
        return f"{path}: cannot read it: {error.strerror or error}"
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return f"{path}: is {kind(mode)}, not a file"
        os.read(fd, 1)
    except OSError as error:
        return f"{path}: cannot read it: {error.strerror or error}"
    finally:
        os.close(fd)
    return None


def _model(config: Config) -> str | None:
    from agent.inference.errors import SessionError
    from agent.inference.model_files import model_sha256

    model, pin = config.inference.model, config.inference.sha256
    try:
        digest = model_sha256(Path(model))
    except SessionError as error:
        return str(error)
    if pin is not None and pin != digest:
        return f"{model} has sha256 {digest}, but inference.sha256 pins {pin}; refused"
    return None


def _token(path: str) -> str | None:
    from agent.serving.access import MAX_TOKEN_BYTES, read_token

    if path == DEFAULT_TOKEN_FILE and not os.path.lexists(path):
        return None  # install.sh makes it on a device; until then load/unload is closed
    try:
        token = read_token(Path(path))
    except OSError as error:
        return unreadable(path) or f"{path}: {error.strerror or error}"
    if not token:
        return f"{path}: is empty: no token, so nobody may load or unload models"
    if len(token) > MAX_TOKEN_BYTES:
        return f"{path}: the token is over {MAX_TOKEN_BYTES} bytes; no call presents it"
    return None


def _password(path: str) -> str | None:
    from agent.link.settings import read_password

    problem = unreadable(path)
    if problem is None:
        try:
            read_password(path)
        except (OSError, UnicodeDecodeError) as error:
            problem = f"{path}: cannot read it: {error}"
    return problem


def _files_then(paths: dict[str, str | None], load: Callable[[], object],
                what: str) -> Iterator[tuple[str, str]]:
    """Each of ``paths`` readable, then ``load`` (the agent's own) succeeds."""
    named = {key: path for key, path in paths.items() if path}
    broken = [(key, unreadable(path)) for key, path in named.items()]
    yield from ((key, problem) for key, problem in broken if problem)
    if any(problem for _, problem in broken):
        return
    try:
        load()
    except (OSError, ValueError) as error:  # ssl.SSLError is an OSError
        yield what, f"{', '.join(named.values()) or 'the system CAs'}: do not load: {error}"


def _mqtt_tls(config: Config) -> Iterator[tuple[str, str]]:
    tls = config.mqtt.tls
    if tls is None:
        return

    def load() -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        mqtt.Client(CallbackAPIVersion.VERSION2).tls_set(ca_certs=tls.ca, certfile=tls.cert,
                                                        keyfile=tls.key)

    yield from _files_then({"mqtt.tls.ca": tls.ca, "mqtt.tls.cert": tls.cert,
                            "mqtt.tls.key": tls.key}, load, "mqtt.tls")


def _serve_tls(config: Config) -> Iterator[tuple[str, str]]:
    tls = config.serve.tls
    if tls is None or not (tls.cert and tls.key):
        return
    cert, key = tls.cert, tls.key

    def load() -> None:
        from agent.serving.tls import server_tls

        server_tls(cert, key, tls.client_ca)

    yield from _files_then({"serve.tls.cert": cert, "serve.tls.key": key,
                            "serve.tls.client_ca": tls.client_ca}, load, "serve.tls")


def _directory(path: str) -> str | None:
    if os.path.isdir(path):
        return None if os.access(path, os.R_OK | os.X_OK) else f"{path}: cannot read it"
    return f"{path}: no such directory" if not os.path.lexists(path) else \
        f"{path}: is not a directory"


def _npy(directory: str) -> str | None:
    from agent.inference.io import NpyDirectorySource, SourceError

    problem = _directory(directory)
    if problem is None:
        try:
            NpyDirectorySource(directory, "input")
        except (SourceError, OSError, ValueError) as error:
            problem = str(error)
    return problem


def _converter(python: str) -> str | None:
    from agent.modelbuild.request import BuildError
    from agent.modelbuild.rknn import converter_python

    try:
        converter_python(python)
    except BuildError as error:
        return str(error).removeprefix("model_build.rknn_python: ")
    return None


def _checks(config: Config) -> Iterator[tuple[str, str | None]]:
    if config.inference.enabled:
        yield "inference.model", _model(config)
        if config.inference.source.startswith("npy:"):
            yield "inference.source", _npy(config.inference.source.removeprefix("npy:"))
    yield "serve.token_file", _token(config.serve.token_file)
    if config.serve.repository is not None and os.path.lexists(config.serve.repository):
        yield "serve.repository", _directory(config.serve.repository)
    yield from _serve_tls(config)
    if config.mqtt.password_file:
        yield "mqtt.password_file", _password(config.mqtt.password_file)
    yield from _mqtt_tls(config)
    for index, directory in enumerate(config.control.model_dirs):
        yield f"control.model_dirs[{index}]", _directory(directory)
    if config.model_build.rknn_python:
        yield "model_build.rknn_python", _converter(config.model_build.rknn_python)


def file_problems(config: Config) -> list[ConfigError]:
    """One error per key whose file the agent could not use, in the file's key order."""
    return [ConfigError(config.source, key, problem)
            for key, problem in _checks(config) if problem]
