"""Pure parsers of kernel file formats, tested from strings (no files needed)."""

from __future__ import annotations

import pytest

from agent.discovery.block import parse_scheduler
from agent.discovery.thermal import normalise_zone_type
from agent.kernel import parsers


@pytest.mark.parametrize(("text", "cpus"), [
    ("0-3,6\n", [0, 1, 2, 3, 6]), ("8-11\n", [8, 9, 10, 11]), ("\n", []), ("5", [5]),
    ("0-1,4-5,7\n", [0, 1, 4, 5, 7])])
def test_cpulist_round_trip(text: str, cpus: list[int]) -> None:
    assert parsers.parse_cpulist(text) == cpus
    assert parsers.parse_cpulist(parsers.format_cpulist(cpus)) == cpus


@pytest.mark.parametrize("garbage", ["a-b", "3-1", "0-3;6", "1,,x"])
def test_cpulist_rejects_garbage(garbage: str) -> None:
    with pytest.raises(ValueError):
        parsers.parse_cpulist(garbage)


def test_format_cpulist_merges_ranges() -> None:
    assert parsers.format_cpulist([6, 0, 1, 2, 3]) == "0-3,6"
    assert parsers.format_cpulist([]) == ""


def test_int_and_int_list_with_trailing_space() -> None:
    assert parsers.parse_int("-256000\n") == -256000
    assert parsers.parse_int("0x10de\n") == 0x10DE
    assert parsers.parse_int_list("408000 600000 816000 \n") == [408000, 600000, 816000]
    with pytest.raises(ValueError, match="expected an integer, got 'garbage'"):
        parsers.parse_int("garbage\n")


def test_selection_bracket_format() -> None:
    assert parsers.parse_selection("always [madvise] never\n") == (
        "madvise", ["always", "madvise", "never"])
    assert parsers.parse_selection("always defer defer+madvise [madvise] never")[0] == "madvise"
    with pytest.raises(ValueError, match="no \\[selected\\]"):
        parsers.parse_selection("always madvise never")


def test_scheduler_accepts_lone_none() -> None:
    assert parse_scheduler("[none] mq-deadline kyber bfq \n") == (
        "none", ["none", "mq-deadline", "kyber", "bfq"])
    assert parse_scheduler("none\n") == ("none", ["none"])


def test_dt_strings_nul_separated() -> None:
    data = b"nvidia,p3737-0000+p3701-0005\0nvidia,p3701-0005\0nvidia,tegra234\0"
    assert parsers.parse_dt_strings(data) == [
        "nvidia,p3737-0000+p3701-0005", "nvidia,p3701-0005", "nvidia,tegra234"]
    assert parsers.parse_dt_strings(b"Radxa ROCK 5B\0") == ["Radxa ROCK 5B"]


def test_nv_tegra_release() -> None:
    line = ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
            "DATE: Wed Jan 15 22:52:09 UTC 2025\n")
    assert parsers.parse_nv_tegra_release(line) == "36.4.3"
    with pytest.raises(ValueError):
        parsers.parse_nv_tegra_release("garbage\n")


def test_meminfo_converts_kb_to_bytes() -> None:
    text = "MemTotal:       16314828 kB\nMemFree:  100 kB\nHugePages_Total:       0\n"
    info = parsers.parse_meminfo(text)
    assert info["MemTotal"] == 16314828 * 1024
    assert info["HugePages_Total"] == 0
    node = parsers.parse_meminfo("Node 1 MemTotal:       32768000 kB\n")
    assert node["MemTotal"] == 32768000 * 1024


def test_cpuinfo_blocks_per_processor() -> None:
    text = ("processor\t: 0\nBogoMIPS\t: 48.00\nCPU implementer\t: 0x41\nCPU part\t: 0xd05\n\n"
            "processor\t: 4\nCPU implementer\t: 0x41\nCPU part\t: 0xd0b\n\n"
            "Serial\t\t: 1234\n")
    blocks = parsers.parse_cpuinfo(text)
    assert [b["processor"] for b in blocks] == ["0", "4"]
    assert blocks[1]["CPU part"] == "0xd0b"


def test_mounts_decode_octal_escapes() -> None:
    text = ("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
            "/dev/sda1 /mnt/my\\040disk ext4 rw 0 0\n")
    assert parsers.parse_mounts(text) == [
        ("cgroup2", "/sys/fs/cgroup", "cgroup2"), ("/dev/sda1", "/mnt/my disk", "ext4")]


def test_rknpu_load_padded_format() -> None:
    assert parsers.parse_rknpu_load("NPU load:  Core0: 12%, Core1:  0%, Core2:  5%,\n") == [
        12, 0, 5]
    assert parsers.parse_rknpu_load("NPU load:  37%\n") == [37]
    with pytest.raises(ValueError):
        parsers.parse_rknpu_load("off\n")


def test_mali_load() -> None:
    assert parsers.parse_mali_load("14@300000000Hz\n") == (14, 300_000_000)
    with pytest.raises(ValueError):
        parsers.parse_mali_load("14\n")


def test_pcie_link_speed() -> None:
    assert parsers.parse_link_speed_gts("16.0 GT/s PCIe\n") == 16.0
    assert parsers.parse_link_speed_gts("2.5 GT/s\n") == 2.5
    assert parsers.parse_link_speed_gts("Unknown\n") is None


@pytest.mark.parametrize(("version", "model"), [
    ("#1 SMP PREEMPT_RT Thu Oct 16 12:00:00 UTC 2025", "PREEMPT_RT"),
    ("#1 SMP PREEMPT RT Mon Jan 1 00:00:00 UTC 2018", "PREEMPT_RT"),
    ("#1 SMP PREEMPT Mon Jan 20 10:00:00 PST 2025", "PREEMPT"),
    ("#48-Ubuntu SMP PREEMPT_DYNAMIC Fri Sep 27 14:04:52 UTC 2024", "PREEMPT_DYNAMIC"),
    ("#1 SMP Debian 6.1.0-26", "none")])
def test_preempt_model_plain_preempt_is_not_rt(version: str, model: str) -> None:
    assert parsers.preempt_model(version) == model


def test_kernel_config_option() -> None:
    config = "CONFIG_PREEMPT=y\n# CONFIG_PREEMPT_RT is not set\nCONFIG_HZ=250\n"
    assert not parsers.kernel_config_enabled(config, "PREEMPT_RT")
    assert parsers.kernel_config_enabled(config, "PREEMPT")
    assert parsers.kernel_config_enabled("CONFIG_PREEMPT_RT=y\n", "PREEMPT_RT")


@pytest.mark.parametrize(("raw", "name"), [
    ("CPU-therm", "cpu"), ("cpu-thermal", "cpu"), ("Tboard_tegra", "tboard"),
    ("bigcore0-thermal", "bigcore0"), ("x86_pkg_temp", "x86_pkg_temp")])
def test_zone_type_normalisation(raw: str, name: str) -> None:
    assert normalise_zone_type(raw) == name
