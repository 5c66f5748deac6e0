"""Which boot loader reads this board's overlays, where the ``.dtbo`` goes, how it is listed.

Three layouts: Armbian's ``armbianEnv.txt``; U-Boot ``extlinux.conf``
(Radxa and other distros, ``fdtoverlays``); Jetson JP6+ ``extlinux.conf`` read by UEFI
L4TLauncher (``OVERLAYS``, needs ``FDT``).  Anything else is refused, never guessed.

Kernel arguments alone (``detect(overlays=False)``) also have: u-boot-update's
``U_BOOT_PARAMETERS`` (Radxa, Debian's u-boot-menu: it regenerates extlinux.conf from
``/etc/default/u-boot``, so arguments go there, or to ``/etc/kernel/cmdline`` when the
variable reads it, and ``u-boot-update`` follows); the Raspberry Pi's ``cmdline.txt``
(``/boot/firmware`` since Bookworm); GRUB's ``GRUB_CMDLINE_LINUX_DEFAULT`` in
``/etc/default/grub`` with ``update-grub`` after it, as TuneD's bootloader plugin does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.kernel.fsroot import Root
from agent.overlays import armbian_env, extlinux, shell_defaults
from agent.overlays.bootfs import BOOT, BootFiles
from agent.overlays.errors import InstallRefused

ARMBIAN_ENVS = ("/boot/armbianEnv.txt", "/boot/orangepiEnv.txt")
EXTLINUX = "/boot/extlinux/extlinux.conf"
UBOOT_DEFAULTS = "/etc/default/u-boot"          # Radxa's u-boot-update settings
UBOOT_OVERLAYS_DIR = "/boot/dtbo"               # when U_BOOT_FDT_OVERLAYS_DIR is not set
L4T_RELEASE = re.compile(r"R(\d+) \(\w+\), REVISION: ([\d.]+)")
GRUB_DEFAULTS = "/etc/default/grub"
GRUB_VARIABLE = "GRUB_CMDLINE_LINUX_DEFAULT"
UBOOT_VARIABLE = "U_BOOT_PARAMETERS"
KERNEL_CMDLINE = "/etc/kernel/cmdline"
PI_CMDLINES = ("/boot/firmware/cmdline.txt", "/boot/cmdline.txt")
# the files kernel arguments may be written to outside /boot
ARGUMENT_FILES = (GRUB_DEFAULTS, UBOOT_DEFAULTS, KERNEL_CMDLINE)


@dataclass(frozen=True)
class Layout:
    kind: str                          # armbian, extlinux, jetson
    config: str                        # the boot config edited (logical path)
    dtbo_dir: str
    dialect: extlinux.Dialect | None   # None for Armbian
    boot_prefix: str = BOOT            # "" when /boot is its own partition
    fdt: str | None = None             # Jetson: the DTB to name when the entry has no FDT
    notes: tuple[str, ...] = ()
    follow_up: tuple[str, ...] = ()    # the command that makes the config take effect

    def dtbo_path(self, name: str) -> str:
        return f"{self.dtbo_dir}/{name}.dtbo"

    def backup_path(self, name: str) -> str:
        return f"{self.config}.edge-agent-{name}.bak"

    def _loader_path(self, name: str) -> str:
        """The ``.dtbo`` as the boot loader names it (relative to its partition)."""
        return self.boot_prefix + self.dtbo_path(name).removeprefix(BOOT)

    def register(self, text: str, name: str) -> str:
        if self.dialect is None:
            return armbian_env.register(text, name)
        return extlinux.register(text, self._loader_path(name), self.dialect, self.fdt)

    def unregister(self, text: str, name: str) -> str:
        if self.dialect is None:
            return armbian_env.unregister(text, name)
        return extlinux.unregister(text, self._loader_path(name), self.dialect)

    def argument(self, text: str, name: str) -> str:
        """The kernel argument ``name`` as the boot loader will pass it; "" when absent."""
        if self.kind in ("grub", "u-boot-update") and self.config != KERNEL_CMDLINE:
            return shell_defaults.argument(text, self.config, self._variable, name)
        if self.kind in ("raspi", "u-boot-update"):
            return shell_defaults.line_argument(text, name)
        if self.dialect is None:
            return armbian_env.argument(text, name)
        return extlinux.argument(text, name)

    def set_argument(self, text: str, name: str, token: str) -> str:
        """``text`` with the argument set to ``token``, or taken out when it is ""."""
        if self.kind in ("grub", "u-boot-update") and self.config != KERNEL_CMDLINE:
            return shell_defaults.set_argument(text, self.config, self._variable, name, token)
        if self.kind in ("raspi", "u-boot-update"):
            return shell_defaults.set_line_argument(text, name, token)
        if self.dialect is None:
            return armbian_env.set_argument(text, name, token)
        return extlinux.set_argument(text, name, token)

    @property
    def _variable(self) -> str:
        return GRUB_VARIABLE if self.kind == "grub" else UBOOT_VARIABLE

    def registered(self, text: str) -> list[tuple[str, str]]:
        """(name, logical path) of every overlay the boot loader will apply."""
        if self.dialect is None:
            vendor = (armbian_env.value(text, "fdtfile") or "rockchip/").split("/")[0]
            prefix = armbian_env.value(text, "overlay_prefix") or ""
            return [(n, self.dtbo_path(n)) for n in armbian_env.names(text, armbian_env.USER)] \
                + [(n, f"{BOOT}/dtb/{vendor}/overlay/{prefix}-{n}.dtbo")
                   for n in armbian_env.names(text, armbian_env.VENDOR)]
        return [(p.rsplit("/", 1)[-1].removesuffix(".dtbo"),
                 p if self.boot_prefix else BOOT + p)
                for p in extlinux.overlays(text, self.dialect)]


def _is_jetson(root: Root) -> bool:
    try:
        compatible = root.read_bytes("/proc/device-tree/compatible")
    except OSError:
        compatible = b""
    return b"nvidia,tegra" in compatible or root.exists("/etc/nv_tegra_release")


def _l4t_notes(root: Root) -> tuple[str, ...]:
    """Refuse L4T releases without OVERLAYS (before R36.2); note when the release is unknown."""
    try:
        match = L4T_RELEASE.search(root.read_text("/etc/nv_tegra_release"))
    except OSError:
        match = None
    if match is None:
        return ("/etc/nv_tegra_release not found: OVERLAYS needs L4T R36.2 (JetPack 6) or "
                "newer",)
    major, minor = int(match.group(1)), int(match.group(2).split(".")[0])
    if (major, minor) < (36, 2):
        raise InstallRefused(f"L4T R{major}.{match.group(2)}: extlinux OVERLAYS arrived with "
                             "R36.2 (JetPack 6); on JetPack 5 jetson-io writes a merged DTB")
    return ()


def _boot_prefix(text: str) -> str:
    _, entry = extlinux.default_entry(text)
    kernel = extlinux.entry_value(entry, "linux") or extlinux.entry_value(entry, "kernel")
    return BOOT if kernel is None or kernel.startswith(BOOT + "/") else ""


def _jetson_fdt(root: Root, prefix: str) -> str | None:
    """The one DTB in /boot/dtb, as jetson-io names it in FDT; None unless exactly one."""
    found = root.glob(f"{BOOT}/dtb/kernel_*.dtb")
    return prefix + found[0].removeprefix(BOOT) if len(found) == 1 else None


def _uboot_overlay_dir(root: Root) -> str:
    try:
        defaults = root.read_text(UBOOT_DEFAULTS)
    except OSError:
        return UBOOT_OVERLAYS_DIR
    match = re.search(r"^\s*U_BOOT_FDT_OVERLAYS_DIR=(.*)$", defaults, re.MULTILINE)
    directory = match.group(1).strip().strip("\"'").rstrip("/") if match else ""
    if not directory:
        return UBOOT_OVERLAYS_DIR
    if not directory.startswith(BOOT + "/"):
        raise InstallRefused(f"{UBOOT_DEFAULTS}: U_BOOT_FDT_OVERLAYS_DIR={directory} is "
                             f"outside {BOOT}; edge-agent writes boot files only below it")
    return directory


def detect(root: Root, boot: BootFiles, overlays: bool = True) -> Layout:
    """The board's boot layout; refused when none, or more than one, is recognised.

    ``overlays=False`` (kernel arguments only): every L4T release's UEFI L4TLauncher reads
    APPEND from extlinux.conf, so JetPack 5 is not refused as it is for OVERLAYS."""
    envs = [path for path in ARMBIAN_ENVS if root.exists(path)]
    has_extlinux = root.exists(EXTLINUX)
    if not overlays and not envs:
        arguments = _arguments_layout(root, has_extlinux)
        if arguments is not None:
            return arguments
    if envs and has_extlinux:
        raise InstallRefused(f"both {envs[0]} and {EXTLINUX} exist below {root.base}, so "
                             "which one the boot loader reads is unknown; nothing was changed")
    if envs:
        return Layout("armbian", envs[0], f"{BOOT}/overlay-user", None)
    if not has_extlinux:
        raise InstallRefused(
            f"unrecognised boot layout below {root.base}: expected {ARMBIAN_ENVS[0]} "
            f"(Armbian) or {EXTLINUX} (U-Boot extlinux, or Jetson JetPack 6+); nothing was "
            "changed")
    text = (boot.read(EXTLINUX) or b"").decode("utf-8", errors="replace")
    prefix = _boot_prefix(text)
    if _is_jetson(root):
        return Layout("jetson", EXTLINUX, BOOT, extlinux.JETSON, prefix,
                      _jetson_fdt(root, prefix), _l4t_notes(root) if overlays else ())
    return Layout("extlinux", EXTLINUX, _uboot_overlay_dir(root), extlinux.UBOOT, prefix)


def _uboot_parameters(root: Root) -> Layout | None:
    """u-boot-update's layout when /etc/default/u-boot sets U_BOOT_PARAMETERS: a literal
    (edited there) or ``$(cat /etc/kernel/cmdline)`` (that file edited)."""
    try:
        raw = shell_defaults.raw_value(root.read_text(UBOOT_DEFAULTS), UBOOT_VARIABLE)
    except OSError:
        return None
    if raw is None:
        return None
    command = ("u-boot-update",)
    if re.fullmatch(r"""(["']?)\$\(cat\s+["']?/etc/kernel/cmdline["']?\)\1""", raw):
        return Layout("u-boot-update", KERNEL_CMDLINE, "", None, follow_up=command)
    return Layout("u-boot-update", UBOOT_DEFAULTS, "", None, follow_up=command)


def _grub(root: Root) -> Layout:
    """GRUB, refused when a /etc/default/grub.d snippet (sourced after the file, so its
    assignment wins: Ubuntu's cloud images set one) assigns the variable itself."""
    for snippet in root.glob("/etc/default/grub.d/*.cfg"):
        try:
            raw = shell_defaults.raw_value(root.read_text(snippet), GRUB_VARIABLE)
        except OSError:
            continue
        if raw is not None and "$" + GRUB_VARIABLE not in raw.replace("${", "$").replace(
                "}", ""):
            raise InstallRefused(f"{snippet} sets {GRUB_VARIABLE}, and update-grub reads it "
                                 f"after {GRUB_DEFAULTS}, so an argument added there would be "
                                 f"lost; move its value into {GRUB_DEFAULTS} first")
    return Layout("grub", GRUB_DEFAULTS, "", None, boot_prefix="",
                  follow_up=("update-grub",))


def _arguments_layout(root: Root, has_extlinux: bool) -> Layout | None:
    """The kernel-argument layouts that have no overlays here; None: the overlay ones."""
    if has_extlinux and not _is_jetson(root):
        return _uboot_parameters(root)
    if has_extlinux:
        return None
    pi = [path for path in PI_CMDLINES if root.exists(path)]
    if pi:
        return Layout("raspi", pi[0], "", None)
    return _grub(root) if root.exists(GRUB_DEFAULTS) else None
