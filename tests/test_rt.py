"""Real-time placement: real scheduling changes on threads the tests start, /proc parsing.

The tests touch only threads they create (or a child process); the host's other threads are
only ever read.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import pytest

from agent.kernel.fsroot import Root
from agent.kernel.sched import (
    SCHED_POLICIES,
    RtError,
    ThreadSched,
    apply_thread_sched,
    apply_to_current_thread,
    irq_affinity_path,
    irqs_matching,
    parse_interrupts,
    read_thread_sched,
    restore_thread_sched,
    rt_kernel_warning,
    threads_matching,
)

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# -- helpers ---------------------------------------------------------------------------------


@contextmanager
def parked_thread(comm: str | None = None) -> Iterator[int]:
    """A thread of the test's own, blocked on an Event; yields its native TID."""
    ready, release = threading.Event(), threading.Event()
    tids: list[int] = []

    def park() -> None:
        tids.append(threading.get_native_id())
        if comm is not None:
            with open(f"/proc/self/task/{tids[0]}/comm", "w") as handle:
                handle.write(comm)
        ready.set()
        release.wait()

    thread = threading.Thread(target=park, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield tids[0]
    finally:
        release.set()
        thread.join(10)
        assert not thread.is_alive()


def kernel_sched(tid: int) -> tuple[int, int, set[int]]:
    """What the kernel reports, read without the module under test."""
    return os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority, \
        os.sched_getaffinity(tid)


def skip_if_refused(error: RtError) -> NoReturn:
    """Skip when this host refuses real-time scheduling itself; fail on any other RtError."""
    if isinstance(error.__cause__, PermissionError):
        pytest.skip(f"real-time scheduling refused on this host: {error}")
    raise error


def one_cpu() -> list[int]:
    return [max(os.sched_getaffinity(0))]


# -- thread scheduling on real threads -------------------------------------------------------


def test_fifo_priority_and_affinity_applied_and_restored() -> None:
    with parked_thread() as tid:
        before = kernel_sched(tid)
        try:
            original = apply_thread_sched(tid, ThreadSched("fifo", 10, one_cpu()))
        except RtError as error:
            skip_if_refused(error)
        assert kernel_sched(tid) == (os.SCHED_FIFO, 10, set(one_cpu()))
        assert original == ThreadSched("other", 0, sorted(before[2]))
        assert read_thread_sched(tid) == ThreadSched("fifo", 10, one_cpu())
        restore_thread_sched(tid, original)
        assert kernel_sched(tid) == before


def test_non_realtime_policy_needs_no_privilege() -> None:
    with parked_thread() as tid:
        before = kernel_sched(tid)
        original = apply_thread_sched(tid, ThreadSched("batch", 0, one_cpu()))
        assert kernel_sched(tid) == (os.SCHED_BATCH, 0, set(one_cpu()))
        restore_thread_sched(tid, original)
        assert kernel_sched(tid) == before


def test_apply_to_current_thread_inside_a_thread() -> None:
    seen: dict[str, object] = {}

    def body() -> None:
        tid = threading.get_native_id()
        try:
            original = apply_to_current_thread(ThreadSched("rr", 20, one_cpu()))
        except RtError as error:
            seen["error"] = error
            return
        seen["applied"] = kernel_sched(tid)
        restore_thread_sched(tid, original)
        seen["original"], seen["restored"] = original, read_thread_sched(tid)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    error = seen.get("error")
    if isinstance(error, RtError):
        skip_if_refused(error)
    assert seen["applied"] == (os.SCHED_RR, 20, set(one_cpu()))
    assert seen["restored"] == seen["original"]


@pytest.mark.parametrize(("wanted", "field", "allowed"), [
    (ThreadSched("fifo", 0, [0]), "priority 0", "1-99"),
    (ThreadSched("rr", 100, [0]), "priority 100", "1-99"),
    (ThreadSched("other", 5, [0]), "priority 5", "allowed: 0"),
    (ThreadSched("deadline", 1, [0]), "policy 'deadline'", "other, fifo, rr, batch, idle"),
    (ThreadSched("fifo", 10, []), "cpus is empty", "non-empty"),
    (ThreadSched("fifo", 10, [-1]), "cpus [-1]", ">= 0"),
])
def test_invalid_request_names_the_field_and_changes_nothing(
        wanted: ThreadSched, field: str, allowed: str) -> None:
    with parked_thread() as tid:
        before = kernel_sched(tid)
        with pytest.raises(RtError, match="allowed") as caught:
            apply_thread_sched(tid, wanted)
        assert field in str(caught.value)
        assert allowed in str(caught.value)
        assert kernel_sched(tid) == before


def test_cpu_the_kernel_refuses_is_reported_and_nothing_changes() -> None:
    with parked_thread() as tid:
        before = kernel_sched(tid)
        with pytest.raises(RtError, match=r"cpus \[4095\] refused .*online CPUs"):
            apply_thread_sched(tid, ThreadSched("batch", 0, [4095]))
        assert kernel_sched(tid) == before


def test_unrestorable_policy_is_refused_before_any_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # SCHED_DEADLINE needs sched_setattr, which Python lacks; report it the way the kernel would.
    monkeypatch.setattr(os, "sched_getscheduler", lambda tid: 6)
    with pytest.raises(RtError, match="policy 6"):
        read_thread_sched(threading.get_native_id())


# The child drops every privilege that allows real-time scheduling (RLIMIT_RTPRIO 0, and
# uid nobody when started as root, which clears its capabilities), then records every real
# sched_setaffinity call while the policy change is refused.
_UNPRIVILEGED_CHILD = """
import json, os, resource, threading
from agent.kernel import sched as rt
resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
calls = []
real_setaffinity = os.sched_setaffinity
def spy(tid, cpus):
    calls.append(sorted(cpus))
    real_setaffinity(tid, cpus)
os.sched_setaffinity = spy
tid = threading.get_native_id()
before = rt.read_thread_sched(tid)
out = {"before": before.cpus, "calls": calls}
try:
    rt.apply_to_current_thread(rt.ThreadSched("fifo", 10, before.cpus[-1:]))
except rt.RtError as exc:
    out["fifo_error"] = str(exc)
out["after"] = rt.read_thread_sched(tid).policy, rt.read_thread_sched(tid).cpus
rt.apply_to_current_thread(rt.ThreadSched("idle", 0, before.cpus))
try:
    rt.restore_thread_sched(tid, before)
except rt.RtError as exc:
    out["leave_idle_error"] = str(exc)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def unprivileged_child() -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", _UNPRIVILEGED_CHILD], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True)
    out: dict[str, object] = json.loads(result.stdout)
    if "fifo_error" not in out:
        pytest.skip("SCHED_FIFO allowed even with RLIMIT_RTPRIO 0 and no root: cannot "
                    "provoke a refusal here")
    return out


def test_refused_policy_restores_the_affinity(unprivileged_child: dict[str, object]) -> None:
    before = unprivileged_child["before"]
    assert isinstance(before, list)
    if len(before) < 2:
        pytest.skip("only one CPU allowed: an affinity change would not be observable")
    calls = unprivileged_child["calls"]
    assert isinstance(calls, list)
    assert calls[:2] == [before[-1:], before]  # pinned first, then put back
    assert unprivileged_child["after"] == ["other", before]


def test_refusal_message_says_how_to_grant_it(unprivileged_child: dict[str, object]) -> None:
    message = unprivileged_child["fifo_error"]
    assert isinstance(message, str)
    assert "not permitted" in message
    assert "LimitRTPRIO=10" in message
    assert "CAP_SYS_NICE" in message
    assert "(this process: 0)" in message
    leave_idle = unprivileged_child["leave_idle_error"]
    assert isinstance(leave_idle, str)
    assert "leaving 'idle', needs CAP_SYS_NICE" in leave_idle


# -- threads_matching ------------------------------------------------------------------------


def test_threads_matching_finds_a_thread_by_the_comm_it_set() -> None:
    name = f"rtt-{secrets.token_hex(4)}"
    with parked_thread(comm=name) as tid:
        mine = (os.getpid(), tid, name)
        assert threads_matching(Root("/"), name, pid=os.getpid()) == [mine]
        assert threads_matching(Root("/"), "rtt-*", pid=os.getpid()) == [mine]
        assert threads_matching(Root("/"), name) == [mine]  # scans every process
        every = threads_matching(Root("/"), "*", pid=os.getpid())
        assert mine in every
        assert (os.getpid(), os.getpid()) in {(pid, t) for pid, t, _ in every}


def write(root: Path, path: str, text: str) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_threads_matching_on_a_fixture_root_skips_vanished_tasks(tmp_path: Path) -> None:
    write(tmp_path, "/proc/1/task/1/comm", "systemd\n")
    write(tmp_path, "/proc/100/task/100/comm", "infer\n")
    write(tmp_path, "/proc/100/task/101/comm", "infer-worker\n")
    write(tmp_path, "/proc/100/task/99/comm", "infer cuda\n")
    write(tmp_path, "/proc/20/task/20/comm", "infer\n")
    (tmp_path / "proc/300").mkdir()  # exited: no task directory left
    (tmp_path / "proc/400/task/400").mkdir(parents=True)  # exited: no comm left
    write(tmp_path, "/proc/self/task/1/comm", "not a pid\n")
    write(tmp_path, "/proc/interrupts", "")
    root = Root(tmp_path)

    assert threads_matching(root, "infer*") == [
        (20, 20, "infer"), (100, 99, "infer cuda"), (100, 100, "infer"),
        (100, 101, "infer-worker")]
    assert threads_matching(root, "*", pid=100) == [
        (100, 99, "infer cuda"), (100, 100, "infer"), (100, 101, "infer-worker")]
    assert threads_matching(root, "Infer*") == []
    assert threads_matching(root, "*", pid=300) == []
    assert threads_matching(root, "*", pid=12345) == []


# -- /proc/interrupts ------------------------------------------------------------------------

X86_INTERRUPTS = """\
            CPU0       CPU1       CPU2       CPU3
   0:         10          0          0          0  IR-IO-APIC    2-edge      timer
   8:          0          0          0          0  IR-IO-APIC    8-edge      rtc0
   9:          0          4          0          0  IR-IO-APIC    9-fasteoi   acpi
  16:          0          0         29          0  IR-IO-APIC   16-fasteoi   i801_smbus, idma64.0
 120:          0          0          0          0  DMAR-MSI    0-edge      dmar0
 124:          0          0          0          0  IR-PCI-MSI-0000:00:1c.0    0-edge      PCIe PME
 128:       1773          0          0          0  IR-PCI-MSI-0000:00:0b.0    0-edge      intel_vpu
 131:     115816          0          0          0  IR-PCI-MSIX-0000:02:00.0    1-edge      nvme0q1
 140:      16018       2001          0          0  IR-PCI-MSIX-0000:03:00.0    1-edge      eth0-TxRx-0
 141:          0      14003          0          0  IR-PCI-MSIX-0000:03:00.0    2-edge      eth0-TxRx-1
 160:          0          0          0          0  IR-PCI-MSI 67633152-edge      nvme1q0
 NMI:          4          4          3          3   Non-maskable interrupts
 LOC:    6185016    5497792    5154180    4948012   Local timer interrupts
 TRM:          0          0          0          0   Thermal event interrupts
 ERR:          0
 MIS:          0
 PIN:          0          0          0          0   Posted-interrupt notification event
"""  # noqa: E501 - real column widths

X86_EXPECTED = {
    0: ["timer"], 8: ["rtc0"], 9: ["acpi"], 16: ["i801_smbus", "idma64.0"], 120: ["dmar0"],
    124: ["PCIe PME"], 128: ["intel_vpu"], 131: ["nvme0q1"], 140: ["eth0-TxRx-0"],
    141: ["eth0-TxRx-1"], 160: ["nvme1q0"],
}

ARM64_INTERRUPTS = """\
           CPU0       CPU1       CPU2       CPU3       CPU4       CPU5       CPU6       CPU7
 10:          0          0          0          0          0          0          0          0     GICv3  25 Level     vgic
 11:    1368516    1216458    1140430    1094812    1064401    1042678    1026387    1013715     GICv3  30 Level     arch_timer
 13:          0          0          0          0          0          0          0          0     GICv3  27 Level     kvm guest vtimer
 23:          0          0          0          0          0          0          0          0     GICv3 321 Level     rockchip_thermal
 40:         12          0          0          0          0          0          0          0     GICv3 247 Level     ehci_hcd:usb1, ohci_hcd:usb3
 61:        115        102         96         92         89         88         86         85     GICv3 142 Level     fdab0000.npu
 62:          3          0          0          0          0          0          0          0     GICv3 143 Level   
 87:     364677          0          0          0          0          0          0          0   ITS-MSI 524288 Edge      nvme0q1
 95:          0          0          0          0          0          0          0          0  rockchip_gpio_irq   5 Edge      gpio-keys
IPI0:    315517     280460     262931     252414     245402     240394     236638     233716       Rescheduling interrupts
IPI1:    140182     124606     116818     112146     109030     106805     105136     103838       Function call interrupts
Err:          0
"""  # noqa: E501, W291 - real widths; irq 62 lost its action, the kernel pads "Level" anyway

ARM64_EXPECTED = {
    10: ["vgic"], 11: ["arch_timer"], 13: ["kvm guest vtimer"], 23: ["rockchip_thermal"],
    40: ["ehci_hcd:usb1", "ohci_hcd:usb3"], 61: ["fdab0000.npu"], 62: [], 87: ["nvme0q1"],
    95: ["gpio-keys"],
}

# Kernels before 4.x glued the flow handler to the chip name and printed no hwirq.
LEGACY_INTERRUPTS = """\
           CPU0       CPU1
  0:         45          0   IO-APIC-edge      timer
  1:          9          0   IO-APIC-edge      i8042
 19:      80011          0   IO-APIC-fasteoi   ehci_hcd:usb1, uhci_hcd:usb2
 44:     110442          0   PCI-MSI-edge      eth0
NMI:          0          0   Non-maskable interrupts
"""

LEGACY_EXPECTED = {
    0: ["timer"], 1: ["i8042"], 19: ["ehci_hcd:usb1", "uhci_hcd:usb2"], 44: ["eth0"]}


@pytest.mark.parametrize(("text", "expected"), [
    (X86_INTERRUPTS, X86_EXPECTED),
    (ARM64_INTERRUPTS, ARM64_EXPECTED),
    (LEGACY_INTERRUPTS, LEGACY_EXPECTED),
    ("", {}),
], ids=["x86", "arm64", "legacy", "empty"])
def test_parse_interrupts(text: str, expected: dict[int, list[str]]) -> None:
    assert parse_interrupts(text) == expected


def kernel_line(irq: int, cpus: int, chip: str, hwirq: int | None, level: str | None,
                flow: str | None, actions: list[str]) -> str:
    """One row as show_interrupts() in kernel/irq/proc.c prints it (prec 3)."""
    line = f"{irq:>3}: " + "".join(f"{n * 7919 % 100000:10d} " for n in range(cpus))
    line += f" {chip:>8}" + (f" {hwirq:>3}" if hwirq is not None else "    ")
    line += f" {level:<8}" if level is not None else ""
    line += f"-{flow:<8}" if flow is not None else ""
    return line + ("  " + ", ".join(actions) if actions else "")


@pytest.mark.parametrize(("cpus", "fields"), list(itertools.product(
    [1, 3, 64],
    [("IO-APIC", 2, None, "edge"), ("IR-PCI-MSIX-0000:02:00.0", 1, None, "edge"),
     ("GICv3", 30, "Level", None), ("ITS-MSI", 524288, "Edge", None),
     ("None", None, None, "edge"), ("-", None, None, None)])))
def test_parse_interrupts_matches_the_kernel_format(
        cpus: int, fields: tuple[str, int | None, str | None, str | None]) -> None:
    chip, hwirq, level, flow = fields
    header = "".join(f"CPU{n:<7} " for n in range(cpus))
    rows = [kernel_line(7, cpus, chip, hwirq, level, flow, ["nvme0q1"]),
            kernel_line(8, cpus, chip, hwirq, level, flow, ["eth0-TxRx-0", "kvm guest ptimer"]),
            kernel_line(9, cpus, chip, hwirq, level, flow, [])]
    text = "\n".join([f"{'':>4}{header}", *rows, "NMI:" + " 0" * cpus + " Non-maskable"])
    assert parse_interrupts(text) == {
        7: ["nvme0q1"], 8: ["eth0-TxRx-0", "kvm guest ptimer"], 9: []}


def test_irqs_matching_on_a_temp_root(tmp_path: Path) -> None:
    write(tmp_path, "/proc/interrupts", X86_INTERRUPTS)
    root = Root(tmp_path)
    assert irqs_matching(root, "nvme*") == [131, 160]
    assert irqs_matching(root, "eth0-TxRx-*") == [140, 141]
    assert irqs_matching(root, "idma64.*") == [16]
    assert irqs_matching(root, "NMI") == []


@pytest.mark.parametrize(("board", "pattern", "irqs"), [
    ("x86-server-nvidia", "nvme*", [40, 41, 90]),
    ("x86-edge-npu", "nvme0q*", [130, 131]),
    ("jetson-agx-orin-jp6", "*.ga10b", [88]),
    ("rk3588-mainline", "*.npu", [61]),
    ("bare-vm", "virtio*", [24, 25, 27]),
])
def test_irqs_matching_on_board_fixtures(board: str, pattern: str, irqs: list[int]) -> None:
    assert irqs_matching(Root(FIXTURES / board), pattern) == irqs


def test_irqs_matching_reads_the_host() -> None:
    host = parse_interrupts(Path("/proc/interrupts").read_text())
    assert host, "every Linux host has numeric IRQs"
    some_irq, names = next((irq, names) for irq, names in host.items() if names)
    assert some_irq in irqs_matching(Root("/"), names[0])


def test_irq_affinity_path_is_an_allowed_write(tmp_path: Path) -> None:
    assert irq_affinity_path(131) == "/proc/irq/131/smp_affinity_list"
    assert Root(tmp_path).check_writable(irq_affinity_path(131)) == irq_affinity_path(131)


# -- kernel warning --------------------------------------------------------------------------


def test_rt_kernel_warning() -> None:
    assert rt_kernel_warning(True) is None
    warning = rt_kernel_warning(False)
    assert warning is not None
    assert "PREEMPT_RT" in warning
    assert "\n" not in warning


def test_policy_table_uses_the_kernel_numbers() -> None:
    expected: dict[str, int] = {"other": 0, "fifo": 1, "rr": 2, "batch": 3, "idle": 5}
    assert expected == SCHED_POLICIES

