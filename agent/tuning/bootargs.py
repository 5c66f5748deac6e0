"""The "cmdline" kind: one kernel argument in the board's boot config (path ``cmdline:NAME``).

Edited through the overlays' boot layouts (:mod:`agent.overlays.layouts`): Armbian's
``extraargs=``, ``APPEND`` on extlinux's ``LABEL edge-agent`` copy (never on the booting
entry), u-boot-update's ``U_BOOT_PARAMETERS`` (so its next run keeps them), the Pi's
``cmdline.txt``, or GRUB's ``GRUB_CMDLINE_LINUX_DEFAULT``; after a write the layout's
``follow_up`` (``update-grub``, ``u-boot-update``) regenerates the loader's own config.
The value is the whole token as written (``isolcpus=managed_irq,domain,4-7``), ""
when the argument is absent.  The kernel parses its command line once, at boot
(Documentation/admin-guide/kernel-parameters.rst), so a change takes effect after the next
reboot, which edge-agent never does itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.kernel.fsroot import Root

if TYPE_CHECKING:
    from agent.overlays.bootfs import ConfinedFiles
    from agent.overlays.layouts import Layout

PREFIX = "cmdline:"
CMDLINE = "/proc/cmdline"
AFTER_REBOOT = "takes effect after reboot"


class BootConfigError(OSError):
    """No boot config edge-agent can edit here (layout unknown, ambiguous, or gone)."""


def _layout(root: Root) -> tuple[ConfinedFiles, Layout]:
    """Loaded when first needed: discovery and plans without kernel arguments skip it."""
    from agent.overlays.bootfs import BOOT, BootFiles, ConfinedFiles
    from agent.overlays.errors import InstallRefused
    from agent.overlays.layouts import ARGUMENT_FILES, detect

    files = ConfinedFiles(root, lambda p: p.startswith(BOOT + "/") or p in ARGUMENT_FILES,
                          f"{BOOT} and {', '.join(ARGUMENT_FILES)}")
    try:
        return files, detect(root, BootFiles(root), overlays=False)
    except InstallRefused as error:
        raise BootConfigError(str(error)) from None


def _config(root: Root) -> tuple[ConfinedFiles, Layout, str]:
    boot, layout = _layout(root)
    data = boot.read(layout.config)
    if data is None:
        raise BootConfigError(f"{layout.config} vanished")
    return boot, layout, data.decode("utf-8", errors="surrogateescape")


def config_path(root: Root) -> str:
    """The boot config the arguments go to (for plans and messages)."""
    return _layout(root)[1].config


def follow_up(root: Root) -> tuple[str, ...]:
    """The command that regenerates the loader's config from it (update-grub,
    u-boot-update); () where the loader reads the edited file itself."""
    try:
        return _layout(root)[1].follow_up
    except (BootConfigError, OSError):
        return ()


class CmdlineKind:
    persistent = True

    def read(self, root: Root, path: str) -> str | None:
        _boot, layout, text = _config(root)
        return layout.argument(text, path.removeprefix(PREFIX))

    def write(self, root: Root, path: str, value: str) -> None:
        boot, layout, text = _config(root)
        updated = layout.set_argument(text, path.removeprefix(PREFIX), value)
        if updated != text:
            boot.write(layout.config, updated.encode("utf-8", errors="surrogateescape"))


def running(root: Root) -> list[str]:
    """The tokens the running kernel booted with."""
    try:
        return root.read_text(CMDLINE).split()
    except OSError:
        return []
