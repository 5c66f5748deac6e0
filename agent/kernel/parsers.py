"""Pure parsers for kernel file formats: text in, typed value out, ValueError on garbage.

Kept free of I/O so every format is testable from a string.
"""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_CPU_ID = 65535  # far above any kernel's NR_CPUS; bounds what a list may expand to


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,6\\n"`` -> ``[0, 1, 2, 3, 6]``; an empty line is an empty list."""
    cpus: list[int] = []
    for chunk in text.strip().split(","):
        if not chunk:
            continue
        match = _RANGE.match(chunk.strip())
        if match is None:
            raise ValueError(f"not a CPU list: {text.strip()!r}")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if last < first:
            raise ValueError(f"descending CPU range: {chunk!r}")
        if last > MAX_CPU_ID:
            raise ValueError(f"CPU id {last} is above {MAX_CPU_ID}")
        cpus.extend(range(first, last + 1))
    return cpus


def parse_cpus_spaced(text: str) -> list[int]:
    """cpufreq ``related_cpus``/``affected_cpus``: ``"0 1 2 3 \\n"``."""
    return [int(word) for word in text.split()]


def parse_int(text: str) -> int:
    """A plain decimal (or ``0x`` hex) integer with optional surrounding whitespace."""
    value = text.strip()
    try:
        return int(value, 16) if value.lower().startswith("0x") else int(value)
    except ValueError:
        raise ValueError(f"expected an integer, got {value[:40]!r}") from None


def parse_int_list(text: str) -> list[int]:
    """Space-separated integers, often with a trailing space."""
    return [parse_int(word) for word in text.split()]


def parse_selection(text: str) -> tuple[str, list[str]]:
    """``"always [madvise] never"`` -> ``("madvise", ["always", "madvise", "never"])``."""
    options: list[str] = []
    current: str | None = None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            word = word[1:-1]
            current = word
        options.append(word)
    if current is None:
        raise ValueError(f"no [selected] entry in {text.strip()!r}")
    return current, options


def parse_dt_strings(data: bytes) -> list[str]:
    """A device-tree string or string list: NUL-separated, NUL-terminated."""
    return [part.decode("utf-8", errors="replace") for part in data.split(b"\0") if part]


_TEGRA_RELEASE = re.compile(r"R(\d+) \(\w+\), REVISION: ([\d.]+)")


def parse_nv_tegra_release(text: str) -> str:
    """First line of /etc/nv_tegra_release -> L4T version such as ``"36.4.3"``."""
    match = _TEGRA_RELEASE.search(text)
    if match is None:
        raise ValueError(f"not an nv_tegra_release line: {text.splitlines()[0][:60]!r}"
                         if text else "empty nv_tegra_release")
    return f"{match.group(1)}.{match.group(2)}"


_MEMINFO_LINE = re.compile(r"^(?:Node \d+ )?([\w()]+):\s+(\d+)(?: kB)?$")


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo or nodeN/meminfo -> {key: bytes} (kB values converted to bytes)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = _MEMINFO_LINE.match(line.strip())
        if match:
            number = int(match.group(2))
            values[match.group(1)] = number * 1024 if line.rstrip().endswith("kB") else number
    if not values:
        raise ValueError("no meminfo lines")
    return values


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """/proc/cpuinfo -> one dict per ``processor`` block (x86 and arm64 layouts)."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            current[key.strip()] = value.strip()
    if current:
        blocks.append(current)
    return [block for block in blocks if "processor" in block]


def parse_mounts(text: str) -> list[tuple[str, str, str]]:
    """/proc/mounts -> ``(source, mountpoint, fstype)``; octal escapes such as ``\\040`` decoded."""
    mounts: list[tuple[str, str, str]] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            mounts.append((fields[0], point, fields[2]))
    return mounts


_RKNPU_CORE = re.compile(r"Core(\d+):\s*(\d+)%")


def parse_rknpu_load(text: str) -> list[int]:
    """``"NPU load:  Core0: 12%, Core1:  0%,"`` -> per-core percentages in core order."""
    cores = sorted((int(idx), int(pct)) for idx, pct in _RKNPU_CORE.findall(text))
    if cores:
        return [pct for _, pct in cores]
    single = re.search(r"NPU load:\s*(\d+)%", text)  # single-core parts (RK3566/RK3568)
    if single:
        return [int(single.group(1))]
    raise ValueError(f"not an rknpu load line: {text.strip()[:60]!r}")


_MALI_LOAD = re.compile(r"^(\d+)@(\d+)Hz$")


def parse_mali_load(text: str) -> tuple[int, int]:
    """Rockchip Mali ``load``: ``"14@300000000Hz"`` -> (percent, Hz)."""
    match = _MALI_LOAD.match(text.strip())
    if match is None:
        raise ValueError(f"not a Mali load value: {text.strip()[:40]!r}")
    return int(match.group(1)), int(match.group(2))


def parse_link_speed_gts(text: str) -> float | None:
    """PCIe ``current_link_speed``: ``"16.0 GT/s PCIe"`` -> 16.0; ``"Unknown"`` -> None."""
    match = re.match(r"^([\d.]+) GT/s", text.strip())
    if match:
        return float(match.group(1))
    if text.strip().lower().startswith("unknown"):
        return None
    raise ValueError(f"not a PCIe link speed: {text.strip()[:40]!r}")


def parse_char_majors(text: str) -> dict[int, str]:
    """``/proc/devices``' character section: major -> the name its driver registered
    (fs/char_dev.c chrdev_show, ``"%3d %s"``); the block section is not read."""
    majors: dict[int, str] = {}
    for line in text.split("Block devices:")[0].splitlines()[1:]:
        number, _, name = line.strip().partition(" ")
        if number.isdigit() and name:
            majors.setdefault(int(number), name.strip())
    return majors


_RT_VERSION = re.compile(r"\bPREEMPT[_ ]RT\b")


def preempt_model(version: str) -> str:
    """The preemption model named in ``uname -v``: ``PREEMPT_RT``, ``PREEMPT_DYNAMIC``,
    ``PREEMPT`` or ``none``.  A plain ``SMP PREEMPT`` kernel is not real-time."""
    if _RT_VERSION.search(version):
        return "PREEMPT_RT"
    for model in ("PREEMPT_DYNAMIC", "PREEMPT"):
        if re.search(rf"\b{model}\b", version):
            return model
    return "none"


def kernel_config_enabled(config: str, option: str) -> bool:
    """Whether ``CONFIG_<option>=y`` appears in a kernel config file."""
    return re.search(rf"^CONFIG_{re.escape(option)}=y$", config, re.MULTILINE) is not None


def format_cpulist(cpus: list[int]) -> str:
    """Inverse of :func:`parse_cpulist`: ``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``."""
    ranges: list[str] = []
    ordered = sorted(set(cpus))
    start = 0
    for index, cpu in enumerate(ordered):
        if index + 1 == len(ordered) or ordered[index + 1] != cpu + 1:
            first = ordered[start]
            ranges.append(str(first) if first == cpu else f"{first}-{cpu}")
            start = index + 1
    return ",".join(ranges)


_ADMIN_THP = re.compile(r"(?:^|\s)transparent_hugepage=(\S+)")


def thp_cmdline_choice(cmdline: str) -> str | None:
    """``transparent_hugepage=`` on the kernel command line: the admin's choice, not ours."""
    match = _ADMIN_THP.search(cmdline)
    return match.group(1) if match else None


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """/proc/pressure/* -> ``{"some": {"avg10": .., "avg60": .., "avg300": .., "total": ..}}``
    plus ``"full"``; averages are % of wall time, ``total`` cumulative µs."""
    lines: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, *pairs = line.split() or [""]
        if kind not in ("some", "full"):
            raise ValueError(f"not a PSI line: {line[:60]!r}")
        values = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep:
                raise ValueError(f"not a PSI name=value pair: {pair!r}")
            values[name] = float(value)
        lines[kind] = values
    if not lines:
        raise ValueError("empty PSI file")
    return lines


def parse_memory_events(text: str) -> dict[str, int]:
    """cgroup v2 ``memory.events``: lines ``name count`` -> {name: count}."""
    events = {}
    for line in text.splitlines():
        name, _, count = line.partition(" ")
        if name:
            events[name] = int(count)
    return events
