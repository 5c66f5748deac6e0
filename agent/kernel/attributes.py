"""How a kernel attribute file reads after a write, for fixture roots: a board tree's plain
files then behave like sysfs/procfs where tuning depends on it (a selection file, a cgroup's
subtree_control, the refusals below), so a plan, apply and rollback there is judged as on a
device."""

from __future__ import annotations

import errno
import re
from collections.abc import Callable
from pathlib import Path

from agent.kernel import irqs

_SELECTION = re.compile(r"\[([^\]\s]+)\]")
_KSTRTO_BASE0 = re.compile(r"([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")  # kstrtos32(.., 0)
_S32_MAX = 2**31 - 1  # PM_QOS_RESUME_LATENCY_NO_CONSTRAINT
Reader = Callable[[str], "str | None"]


def _no_files(_path: str) -> str | None:
    return None


def _refusal(path: str, value: str, read: Reader) -> OSError | None:
    """The errno the kernel answers a write with, where tuning depends on it."""
    word = value.strip()
    directory = path.rsplit("/", 1)[0]
    if path.endswith("/energy_performance_preference"):
        # intel_pstate (and amd-pstate-epp) refuse any EPP but performance while the policy
        # runs the performance governor (EBUSY; Documentation/admin-guide/pm/intel_pstate.rst)
        governor = (read(f"{directory}/scaling_governor") or "").strip()
        if governor == "performance" and word != "performance":
            return OSError(errno.EBUSY, f"{path}: EPP is fixed under the performance governor")
        offered = (read(f"{directory}/energy_performance_available_preferences") or "").split()
        if offered and word not in offered:
            return OSError(errno.EINVAL, f"{path}: {word!r} is not one of {offered}")
    # drivers/pci/pcie/aspm.c pcie_aspm_set_policy: EPERM while ASPM is disabled
    # (pcie_aspm=off, or the firmware did not grant ASPM control)
    if path == "/sys/module/pcie_aspm/parameters/policy" and "pcie_aspm=off" in (
            read("/proc/cmdline") or "").split():
        return OSError(errno.EPERM, f"{path}: ASPM is disabled (pcie_aspm=off)")
    if path.endswith("/power/pm_qos_latency_tolerance_us") and word not in ("auto", "any") \
            and not word.isdigit():  # pm_qos_latency_tolerance_us_store: kstrtos32, >= 0
        return OSError(errno.EINVAL, f"{path}: {word!r} is not auto, any or a number >= 0")
    # drivers/base/power/sysfs.c: control takes "on" or "auto"; autosuspend_delay_ms kstrtol
    if path.endswith("/power/control") and word not in ("on", "auto"):
        return OSError(errno.EINVAL, f"{path}: {word!r} is not on or auto")
    if path.endswith("/power/autosuspend_delay_ms") and not word.lstrip("-").isdigit():
        return OSError(errno.EINVAL, f"{path}: {word!r} is not a number of milliseconds")
    if path.endswith("/rknpu/delayms") and not word.isdigit():
        # rknpu_power_put_delay_set: kstrtoul failure answers EFAULT, not EINVAL
        return OSError(errno.EFAULT, f"{path}: {word!r} is not a number of milliseconds")
    return None


def emulate_attribute_write(current: bytes, value: str, path: str,
                            read: Reader = _no_files, base: Path | None = None) -> bytes:
    """What a sysfs/procfs attribute reads after ``value`` is written to it.

    A selection file (``always [madvise] never``) moves its brackets to the written word and
    refuses words it does not offer (EINVAL, as the kernel does); ``cgroup.subtree_control``
    takes ``+name``/``-name`` edits; rknpu's ``power`` ignores words other than on/off (the
    driver logs them and returns success); a PM QoS resume latency, /proc/irq and the
    workqueue cpumask follow their kernel code (below; ``base`` is the tree, for the IRQ and
    cpumask rules); any other attribute reads back the value and a newline.  ``read`` gives
    sibling files (a policy's governor, the command line) for the kernel's refusals.
    """
    refusal = _refusal(path, value, read)
    if refusal is not None:
        raise refusal
    if path.endswith("/power/pm_qos_resume_latency_us"):
        return _resume_latency(value, path)
    if base is not None and path == irqs.WORKQUEUE_CPUMASK:
        return irqs.fixture_workqueue_write(base, path, value)
    if base is not None and path.startswith("/proc/irq/"):
        normalised = irqs.fixture_affinity_write(base, path, value)
        if normalised is not None:
            return normalised
    text = current.decode(errors="replace")
    if path == "/proc/sys/kernel/io_uring_disabled" and value.strip() not in ("0", "1", "2"):
        raise OSError(errno.EINVAL, f"{path}: {value.strip()!r} is outside 0..2")  # minmax
    if path.endswith("/cgroup.subtree_control"):  # "+cpu -io" edits the enabled set
        enabled = text.split()
        for token in value.split():
            name = token[1:]
            if token[0] == "+" and name not in enabled:
                enabled.append(name)
            elif token[0] == "-" and name in enabled:
                enabled.remove(name)
        return (" ".join(enabled) + "\n").encode()
    if path.endswith("/rknpu/power"):
        if value.strip() not in ("on", "off"):
            return current
        if base is not None:
            _rknpu_runtime_pm(base, value.strip())
    if _SELECTION.search(text) is None:
        return (value.strip() + "\n").encode()
    word = value.strip()
    options = [w.strip("[]") for w in text.split()]
    if word not in options:
        raise OSError(errno.EINVAL, f"{path}: {word!r} is not one of {options}")
    unbracketed = _SELECTION.sub(lambda m: m.group(1), text)
    return re.sub(rf"(?<!\S){re.escape(word)}(?!\S)", f"[{word}]", unbracketed, count=1).encode()


def _rknpu_runtime_pm(base: Path, word: str) -> None:
    """rknpu_power_get/put: a hold resumes the NPU device (pm_runtime_get_sync); once the
    holds are gone it suspends (after the power-off delay, at once here)."""
    for status in base.glob("sys/bus/platform/drivers/RKNPU/*/power/runtime_status"):
        status.write_text("active\n" if word == "on" else "suspended\n")


def _resume_latency(value: str, path: str) -> bytes:
    """drivers/base/power/sysfs.c ``pm_qos_resume_latency_us_store``/``_show``: "n/a" asks
    for no latency at all (stored 0, shown "n/a"); 0 asks for no constraint (stored S32_MAX,
    shown "0"); other numbers (kstrtos32, base 0) are shown as they are; negatives and
    S32_MAX itself are EINVAL (Documentation/ABI/testing/sysfs-devices-power)."""
    word = value.strip()
    if word == "n/a":
        return b"n/a\n"
    match = _KSTRTO_BASE0.fullmatch(word)
    if match is None:
        raise OSError(errno.EINVAL, f"{path}: {word!r} is not a number or n/a")
    sign, digits = match.group(1), match.group(2)
    base = 16 if digits[:2].lower() == "0x" else 8 if digits.startswith("0") else 10
    number = int(sign + (digits[2:] if base == 16 else digits), base)
    if number < 0 or number >= _S32_MAX:
        raise OSError(errno.EINVAL, f"{path}: {number} is out of range (0..{_S32_MAX - 1}, "
                      "or n/a)")
    return f"{number}\n".encode()
