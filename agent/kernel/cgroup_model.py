"""cgroup v2's rules for fixture roots, so a test tree refuses what the kernel refuses.

A plain directory accepts any write; the kernel does not (Documentation/admin-guide/
cgroup-v2.rst).  Below a fixture root, :class:`~agent.kernel.fsroot.Root` hands writes to a v2
cgroup directory (one holding ``cgroup.controllers``) and ``mkdir``/``rmdir`` to this module:

- a controller's interface files (``memory.max`` ...) exist only in the children of a cgroup
  that lists the controller in ``cgroup.subtree_control``; enabling one that the cgroup's
  ``cgroup.controllers`` does not offer is ENOENT;
- the no-internal-process rule: a non-root cgroup that holds processes cannot enable
  controllers for its children, and one that enabled some cannot take processes (EBUSY);
- a process lives in one cgroup: writing its pid to ``cgroup.procs`` moves it;
- bad values are EINVAL; ``rmdir`` of a cgroup with processes or children is EBUSY.

The root cgroup (no ``cgroup.type`` file, as in the kernel) is exempt from the process rule;
a container's namespace root has ``cgroup.type`` and is not.  Paths here are host paths.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from agent.kernel.parsers import format_cpulist, parse_cpulist

# The files mkdir creates for each controller enabled in the parent, with the kernel's
# defaults (cpuset's effective lists are copied from the parent).
CONTROLLER_FILES: dict[str, dict[str, str]] = {
    "memory": {"memory.current": "0", "memory.min": "0", "memory.low": "0",
               "memory.high": "max", "memory.max": "max",
               "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0"},
    "cpu": {"cpu.max": "max 100000", "cpu.weight": "100"},
    "cpuset": {"cpuset.cpus": "", "cpuset.mems": "", "cpuset.cpus.effective": "",
               "cpuset.mems.effective": ""},
    "io": {"io.max": ""}, "pids": {"pids.max": "max", "pids.current": "0"},
}
_CORE_FILES = {"cgroup.procs": "", "cgroup.threads": "", "cgroup.subtree_control": "",
               "cgroup.type": "domain", "cgroup.events": "populated 0\nfrozen 0"}


def _fail(code: int, path: Path | str, why: str) -> OSError:
    return OSError(code, f"{path}: {why}")


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _put(path: Path, text: str) -> None:
    path.write_text(text.strip() + "\n" if text.strip() else "")


def is_cgroup_dir(directory: Path) -> bool:
    return (directory / "cgroup.controllers").is_file()


def _is_root(directory: Path) -> bool:
    return not (directory / "cgroup.type").exists()


def _tree_top(directory: Path) -> Path:
    while is_cgroup_dir(directory.parent):
        directory = directory.parent
    return directory


def _children(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.is_dir() and is_cgroup_dir(p)]


def make(directory: Path) -> None:
    """``mkdir`` in cgroupfs: the directory comes with its interface files."""
    parent = directory.parent
    os.mkdir(directory)
    enabled = _read(parent / "cgroup.subtree_control").split()
    for name, text in {**_CORE_FILES, "cgroup.controllers": " ".join(enabled)}.items():
        _put(directory / name, text)
    for controller in enabled:
        _add_files(directory, controller)


def _add_files(directory: Path, controller: str) -> None:
    for name, text in CONTROLLER_FILES.get(controller, {}).items():
        if name.endswith(".effective"):
            text = _read(directory.parent / name) or _read(_tree_top(directory) / name)
        _put(directory / name, text)


def remove(directory: Path) -> None:
    """``rmdir`` in cgroupfs: refused while processes or child cgroups are inside."""
    if _read(directory / "cgroup.procs").split() or _children(directory):
        raise _fail(errno.EBUSY, directory, "the cgroup holds processes or child cgroups")
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()


def write(file: Path, value: str, page: int) -> None:
    """One write(2) to a cgroup interface file, with the kernel's checks; memory limits are
    kept in ``page``-byte pages."""
    directory, name = file.parent, file.name
    if not file.exists():
        raise _fail(errno.ENOENT, file, "no such interface file (is its controller enabled "
                    "in the parent's cgroup.subtree_control?)")
    if name == "cgroup.subtree_control":
        _subtree_control(directory, value)
    elif name in ("cgroup.procs", "cgroup.threads"):
        _move(directory, value.strip())
    else:
        _put(file, _checked_value(file, name, value.strip(), page))


def _subtree_control(directory: Path, value: str) -> None:
    offered = _read(directory / "cgroup.controllers").split()
    enabled = _read(directory / "cgroup.subtree_control").split()
    wanted = list(enabled)
    for token in value.split():
        name = token[1:]
        if token[:1] not in ("+", "-") or not name:
            raise _fail(errno.EINVAL, directory, f"{token!r}: expected +name or -name")
        if token[0] == "+" and name not in offered:
            raise _fail(errno.ENOENT, directory, f"controller {name} is not available here "
                        f"(cgroup.controllers: {' '.join(offered) or 'none'})")
        if token[0] == "+" and name not in wanted:
            wanted.append(name)
        elif token[0] == "-" and name in wanted:
            if any(name in _read(c / "cgroup.subtree_control").split()
                   for c in _children(directory)):
                raise _fail(errno.EBUSY, directory, f"a child cgroup still delegates {name}")
            wanted.remove(name)
    added = [c for c in wanted if c not in enabled]
    if added and not _is_root(directory) and _read(directory / "cgroup.procs").split():
        raise _fail(errno.EBUSY, directory, "the cgroup holds processes: the no-internal-"
                    "process rule forbids enabling controllers for its children")
    _put(directory / "cgroup.subtree_control", " ".join(wanted))
    for child in _children(directory):
        _put(child / "cgroup.controllers", " ".join(wanted))
        for controller in added:
            _add_files(child, controller)
        for controller in set(enabled) - set(wanted):
            for file_name in CONTROLLER_FILES.get(controller, {}):
                (child / file_name).unlink(missing_ok=True)


def _move(directory: Path, pid: str) -> None:
    if not pid.isdigit():
        raise _fail(errno.EINVAL, directory / "cgroup.procs", f"{pid!r} is not one pid")
    if not _is_root(directory) and _read(directory / "cgroup.subtree_control").split():
        raise _fail(errno.EBUSY, directory, "the cgroup delegates controllers to its "
                    "children: the no-internal-process rule forbids processes in it")
    for procs in _tree_top(directory).rglob("cgroup.procs"):
        pids = _read(procs).split()
        if pid in pids:
            _put(procs, "\n".join(p for p in pids if p != pid))
    _put(directory / "cgroup.procs", "\n".join([*_read(directory / "cgroup.procs").split(),
                                                pid]))


_LIMIT = re.compile(r"^(max|\d+)$")
_CPU_MAX = re.compile(r"^(max|\d+)(?: (\d+))?$")


def _checked_value(file: Path, name: str, value: str, page: int) -> str:
    """What the file reads after the write; EINVAL where the kernel refuses the value."""
    if name in ("memory.max", "memory.high", "memory.low", "memory.min", "pids.max"):
        if not _LIMIT.match(value):
            raise _fail(errno.EINVAL, file, f"{value!r} is not bytes or max")
        return value if value == "max" or name == "pids.max" else \
            str(int(value) // page * page)
    if name == "cpu.max":
        match = _CPU_MAX.match(value)
        if match is None or (match.group(2) is not None and
                             not 1000 <= int(match.group(2)) <= 1_000_000):
            raise _fail(errno.EINVAL, file, f"{value!r} is not '<quota|max> [period]'")
        period = match.group(2) or _read(file).split()[1]
        return f"{match.group(1)} {period}"
    if name == "cpu.weight":
        if not value.isdigit() or not 1 <= int(value) <= 10000:
            raise _fail(errno.EINVAL, file, f"{value!r} is not a weight from 1 to 10000")
        return value
    if name in ("cpuset.cpus", "cpuset.mems"):
        try:
            return format_cpulist(parse_cpulist(value))
        except ValueError:
            raise _fail(errno.EINVAL, file, f"{value!r} is not a list") from None
    return value
