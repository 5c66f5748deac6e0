"""Profiles: YAML files with ``include`` (merged in order, later wins) and ``match``.

Site profiles in ``/etc/edge-agent/profiles`` (read through the root, so ``--root`` works)
override the built-in ones of the same name.
"""

from __future__ import annotations

import copy
import fnmatch
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent import yamlfile
from agent.discovery.model import Board
from agent.kernel.fsroot import Root
from agent.tuning.errors import ProfileError
from agent.tuning.schema import validate_profile

SITE_DIR = "/etc/edge-agent/profiles"
MATCH_WEIGHTS = {"family": 1, "soc": 2, "model": 4}


def builtin_dirs() -> list[Path]:
    """Shipped profiles: $EDGE_AGENT_PROFILES, the checkout's profiles/, the venv's copy."""
    dirs = [Path(p) for p in os.environ.get("EDGE_AGENT_PROFILES", "").split(":") if p]
    dirs += [Path(__file__).resolve().parents[2] / "profiles", Path(sys.prefix) / "profiles"]
    return [d for d in dirs if d.is_dir()]


@dataclass
class Profile:
    name: str
    file: str
    settings: dict[str, Any]  # merged sections, without name/include/description
    match: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    chain: list[str] = field(default_factory=list)  # include order, this profile last
    # key paths this profile's own file sets, less those it lists under ``optional``: a
    # knob the kernel lacks is an error for these, and skipped with a warning for the rest
    required: frozenset[str] = frozenset()

    def matches(self, board: Board) -> bool:
        return match_score(self.match, board) is not None

    def requires(self, key: str) -> bool:
        """Whether ``key`` (``thp.enabled``, ``thp``) is asked for by this profile itself,
        not only inherited from one it includes or marked optional."""
        return any(_nested(key, path) or _nested(path, key) for path in self.required)


def _nested(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer + ".")


def key_paths(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Every leaf's dotted key path (``thp.enabled``, ``sysctl.vm.swappiness``)."""
    paths = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        paths += key_paths(value, path + ".") if isinstance(value, dict) and value else [path]
    return paths


def match_score(match: dict[str, Any], board: Board) -> int | None:
    """None when the board is excluded; otherwise how specific the match is."""
    score = 0
    for key, wanted in match.items():
        actual = getattr(board, key, None) or ""
        options = wanted if isinstance(wanted, list) else [wanted]
        if key == "model":
            ok = any(fnmatch.fnmatch(actual.lower(), f"*{o.lower()}*") for o in options)
        else:
            ok = actual.lower() in (o.lower() for o in options)
        if not ok:
            return None
        score += MATCH_WEIGHTS[key]
    return score


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class ProfileStore:
    """Finds, reads, validates and merges profiles."""

    def __init__(self, root: Root, dirs: list[Path] | None = None) -> None:
        self.root = root
        self.dirs = builtin_dirs() if dirs is None else dirs
        self.skipped: list[str] = []  # the profiles the last auto() passed over, and why

    def _site_files(self) -> dict[str, tuple[str, str | OSError]]:
        found: dict[str, tuple[str, str | OSError]] = {}
        for path in self.root.glob(f"{SITE_DIR}/*.yaml"):
            try:
                found[Path(path).stem] = (path, self.root.read_text(path))
            except OSError as error:  # reported when that profile is loaded, not before
                found[Path(path).stem] = (path, error)
        return found

    def sources(self) -> dict[str, tuple[str, str | OSError]]:
        """name -> (file shown in errors, YAML text or why it cannot be read); site profiles
        win."""
        found: dict[str, tuple[str, str | OSError]] = {}
        for directory in reversed(self.dirs):
            for path in sorted(directory.glob("*.yaml")):
                try:
                    # undecodable bytes are kept visible, so the YAML error points at them
                    found[path.stem] = (str(path),
                                        path.read_bytes().decode("utf-8", "replace"))
                except OSError as error:
                    found[path.stem] = (str(path), error)
        found.update(self._site_files())
        return found

    def names(self) -> list[str]:
        return sorted(self.sources())

    def load(self, name: str) -> Profile:
        return self._load(name, self.sources(), [])

    def not_here(self, name: str) -> str | None:
        """Why a configured profile name cannot be used here, or None: the wording of the
        config's ``tuning.profile`` check and of the service that starts degraded."""
        names = self.names()
        if name == "auto" or name in names:
            return None
        return f"{name!r} is not a profile here (available: {', '.join(names) or 'none'})"

    def load_all(self) -> dict[str, Profile | ProfileError]:
        """Every profile by name, or the error that keeps it from loading: one broken file
        spoils only itself and the profiles that include it."""
        sources = self.sources()
        loaded: dict[str, Profile | ProfileError] = {}
        for name in sorted(sources):
            try:
                loaded[name] = self._load(name, sources, [])
            except ProfileError as error:
                loaded[name] = error
        return loaded

    def _load(self, name: str, sources: dict[str, tuple[str, str | OSError]],
              stack: list[str]) -> Profile:
        if name in stack:
            cycle = " -> ".join([*stack[stack.index(name):], name])
            raise ProfileError(sources[name][0], "include", f"include cycle: {cycle}")
        if name not in sources:
            where = sources[stack[-1]][0] if stack else "profile"
            raise ProfileError(where, "include" if stack else "",
                               f"no profile named {name!r} (available: "
                               f"{', '.join(sorted(sources)) or 'none'})")
        file, text = sources[name]
        if isinstance(text, OSError):
            raise ProfileError(file, "", f"cannot be read: {text.strerror or text}")
        if "\ufffd" in text:
            line = text[:text.index("\ufffd")].count("\n") + 1
            raise ProfileError(file, f"line {line}", "not UTF-8 text")
        try:
            data = yamlfile.load(text)
        except yamlfile.DuplicateKeyError as error:
            raise ProfileError(file, error.path, error.message) from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"line {mark.line + 1}" if mark else "YAML"
            raise ProfileError(file, where, f"not valid YAML: {error}") from None
        except Exception as error:
            # PyYAML's constructors also raise ValueError, KeyError, IndexError, ... on tags
            # and values such as 2001-13-45 or a bare !!int: untrusted input, any failure
            raise ProfileError(file, "YAML", f"not valid YAML: {type(error).__name__}: "
                               f"{str(error)[:200]}") from None
        data = validate_profile({} if data is None else data, file)
        if "name" in data and data["name"] != name:
            raise ProfileError(file, "name", f"{data['name']!r} differs from the file name "
                               f"{name!r}")
        merged: dict[str, Any] = {}
        chain: list[str] = []
        for included in data.get("include", []):
            parent = self._load(included, sources, [*stack, name])
            merged = deep_merge(merged, {**parent.settings, "match": parent.match}
                                if parent.match else parent.settings)
            chain += [c for c in parent.chain if c not in chain]
        own = {k: v for k, v in data.items()
               if k not in ("name", "include", "description", "optional")}
        merged = deep_merge(merged, own)
        match = merged.pop("match", {})
        optional = data.get("optional", [])
        required = frozenset(path for path in key_paths(own) if not _nested(path, "match")
                             and not any(_nested(path, o) for o in optional))
        return Profile(name=name, file=file, settings=merged, match=match,
                       description=data.get("description", ""), chain=[*chain, name],
                       required=required)

    def auto(self, board: Board) -> Profile:
        """The most specific profile whose ``match`` fits the board; ``balanced`` otherwise.
        A profile that does not load is passed over, and named in ``skipped``."""
        candidates = []
        profiles = {}
        self.skipped = []
        for name, loaded in self.load_all().items():
            if isinstance(loaded, ProfileError):
                self.skipped.append(f"profile {name} is skipped: {loaded}")
                continue
            profiles[name] = loaded
            score = match_score(loaded.match, board) if loaded.match else None
            if score is not None:
                # most specific first; among equals the base board profile (shortest name)
                candidates.append((-score, len(name), name))
        if candidates:
            return profiles[min(candidates)[2]]
        return profiles.get("balanced") or self.load("balanced")  # its error if it has one
