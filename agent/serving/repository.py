"""The model repository on disk, in Triton's layout, and the built-in entries beside it.

``<repository>/<model>/<version>/model.onnx`` (and/or ``model.rknn`` for Rockchip NPU
instances) with ``version`` a positive integer directory name, and an optional
``<repository>/<model>/config.yaml`` (``settings``).  A built-in entry
(the bundled demo model, a configured model file) is served in place as version 1; a
repository directory of the same name may add versions 2, 3, ... and a config.yaml.

Scanning never raises for a bad tree: a model that cannot be read is listed with its reason,
so the index can show it and a later fix plus a load can bring it in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.serving.settings import ModelSettings, ModelSettingsError, read_settings

MODEL_NAME = re.compile(r"(?!\.)[A-Za-z0-9_.-]{1,64}")
MODEL_FILE = "model.onnx"
RKNN_FILE = "model.rknn"  # a Rockchip NPU's build of it (converted from the model.onnx beside)
CONFIG_FILE = "config.yaml"
BUILTIN_VERSION = 1


def valid_name(name: str) -> bool:
    """A model name the repository accepts (and a URL path segment needs no escaping); the
    whole name must match: ``$`` let "demo\\n" through as a name of its own."""
    return MODEL_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class ModelEntry:
    """One model as the repository holds it: its version files and settings, or why it
    cannot be served (``error``; then ``versions`` may still list what was found)."""

    name: str
    versions: Mapping[int, Path] = field(default_factory=dict)
    settings: ModelSettings = field(default_factory=ModelSettings)
    error: str = ""

    def wanted(self) -> dict[int, Path]:
        """The versions the policy serves."""
        chosen = self.settings.version_policy.select(list(self.versions))
        return {version: self.versions[version] for version in chosen}


def scan(repository: Path, builtins: Mapping[str, Path],
         pins: Mapping[str, str] | None = None) -> dict[str, ModelEntry]:
    """Every model of the repository and the built-ins, by name; ``pins``: a built-in's
    sha256 (``inference.sha256`` pins the configured file)."""
    names = set(builtins)
    try:
        children = list(repository.iterdir()) if repository.is_dir() else []
    except OSError:
        children = []
    names.update(child.name for child in children if valid_name(child.name)
                 and _is_dir(child))
    found: dict[str, ModelEntry] = {}
    for name in sorted(names):
        entry = scan_model(repository, builtins, name, pins)
        if entry is not None:
            found[name] = entry
    return found


def scan_model(repository: Path, builtins: Mapping[str, Path], name: str,
               pins: Mapping[str, str] | None = None) -> ModelEntry | None:
    """One model read again; None when neither the repository nor the built-ins hold it."""
    if not valid_name(name):
        return None
    directory = repository / name
    builtin = builtins.get(name)
    if builtin is None and not _is_dir(directory):
        return None
    versions: dict[int, Path] = {}
    if builtin is not None:
        versions[BUILTIN_VERSION] = builtin
    problems: list[str] = []
    if _is_dir(directory):
        try:
            versions.update(_version_files(directory, skip=set(versions)))
        except OSError as error:
            problems.append(f"cannot list {directory}: {error.strerror or error}")
    try:
        settings = read_settings(directory / CONFIG_FILE)
    except ModelSettingsError as error:
        return ModelEntry(name, versions, error=str(error))
    if builtin is not None and (pins or {}).get(name):
        settings = replace(settings, sha256={
            **settings.sha256, BUILTIN_VERSION: (pins or {})[name]})
    if not problems and not versions:
        problems.append(f"{directory} holds no version directory with {MODEL_FILE} "
                        f"or {RKNN_FILE} (<model>/<version>/model.onnx)")
    if not problems and not settings.version_policy.select(list(versions)):
        problems.append(f"version_policy {settings.version_policy} selects none of the "
                        f"versions {', '.join(map(str, sorted(versions)))}")
    return ModelEntry(name, versions, settings, "; ".join(problems))


def _version_files(directory: Path, skip: set[int]) -> dict[int, Path]:
    """``<version>/model.onnx`` for each positive integer directory name; anything else (a
    file, a dotfile, ``latest``, a version without a model file) is not a version.  A
    built-in's version 1 stays the built-in file (``skip``)."""
    found: dict[int, Path] = {}
    for child in directory.iterdir():
        name = child.name
        if not (name.isascii() and name.isdigit()) or str(int(name)) != name:
            continue  # "01" is not version 1: two directories must not claim one version
        if int(name) < 1 or int(name) in skip:
            continue
        for file in (MODEL_FILE, RKNN_FILE):  # the ONNX model is the contract when both
            if (child / file).is_file():
                found[int(name)] = child / file
                break
    return found


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False
