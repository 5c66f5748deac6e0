"""Install, remove and list overlays in the board's boot configuration; never reboot.

Every change is checked first (the layout, the running device tree's compatible and
``__symbols__``), the boot config is backed up before its first edit for an overlay, and
each file is replaced atomically: the ``.dtbo`` before the config that names it on install,
the config before the ``.dtbo`` on remove, so no crash leaves a config naming a missing file.
``remove`` restores the backup byte for byte when nothing else changed the config since;
otherwise it takes out exactly what install added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.kernel.fsroot import Root, RootError
from agent.overlays import extlinux, tryonce
from agent.overlays.bootfs import BootFiles
from agent.overlays.build import Built
from agent.overlays.check import Overlay
from agent.overlays.errors import InstallRefused
from agent.overlays.layouts import UBOOT_DEFAULTS, Layout, detect
from agent.overlays.table import OppTable

DT = "/proc/device-tree"
REBOOT = "reboot to apply it: edge-agent never reboots the board"


@dataclass
class Outcome:
    name: str
    layout: str
    config: str
    dtbo: str
    result: str                                         # what happened, for the person
    warnings: list[str] = field(default_factory=list)


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="surrogateescape")  # round-trips any byte


def _data(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


def check_board(root: Root, overlay: Overlay, name: str) -> list[str]:
    """Refuse an overlay the running device tree cannot take; notes for what went unchecked.

    Without ``__symbols__`` in the base DTB (one built without ``dtc -@``) labels do not
    resolve: Armbian then drops every overlay, and an extlinux boot may fail.
    """
    if not root.is_dir(DT):
        return [f"no running device tree below {root.base}: the board's compatible and "
                "__symbols__ were not checked"]
    try:
        board = [c for c in root.read_bytes(f"{DT}/compatible").decode(errors="replace")
                 .split("\0") if c]
    except OSError:
        board = []
    wanted = overlay.soc.compatibles if overlay.soc else tuple(overlay.compatibles)
    if wanted and not set(wanted) & set(board):
        raise InstallRefused(f"{name} is for {', '.join(wanted)}; this board is "
                             f"{', '.join(board) or 'unknown (no compatible)'}")
    if overlay.labels and not root.is_dir(f"{DT}/__symbols__"):
        raise InstallRefused(f"{name} targets labels ({', '.join(overlay.labels)}) but the "
                             "running device tree has no __symbols__: the base DTB was not "
                             "built with dtc -@, so they cannot resolve")
    missing = [label for label in overlay.labels
               if not root.exists(f"{DT}/__symbols__/{label}")]
    missing += [fragment.path for fragment in overlay.fragments
                if fragment.path and not root.exists(DT + fragment.path)]
    if missing:
        raise InstallRefused(f"{name} targets {', '.join(missing)}, which the running device "
                             "tree does not have (another kernel flavour or board?)")
    return [note for table in overlay.tables for note in _flavour_notes(root, table, name)]


def _flavour_notes(root: Root, table: OppTable, name: str) -> list[str]:
    """Refuse a table for the other kernel flavour: the label's node path tells them apart."""
    label = table.target.label
    actual = root.read_text(f"{DT}/__symbols__/{label}").rstrip("\0\n")
    if actual == table.target.paths[table.flavour]:
        return []
    for flavour, path in table.target.paths.items():
        if actual == path:
            raise InstallRefused(f"{name} is for {table.flavour} kernels, but &{label} is "
                                 f"{actual} here: a {flavour} kernel (its voltages take "
                                 "another form); build one with --flavour " + flavour)
    return [f"&{label} is {actual} here, not {table.target.paths[table.flavour]}: the kernel "
            f"flavour could not be confirmed as {table.flavour}"]


NO_TRY_ONCE = {
    "armbian": "its boot.scr always reads armbianEnv.txt, so U-Boot's altbootcmd has no "
               "previous tree to boot",
    "jetson": "UEFI L4TLauncher has no extlinux FALLBACK; a failed boot falls back to the A/B "
              "kernel partition, not the previous entry"}


def _try_once(root: Root, built: Built, layout: Layout, fallback: bool,
              runner: tryonce.Runner | None, warnings: list[str]) -> tryonce.TryOnce | None:
    """How an undervolting overlay is installed: armed on U-Boot extlinux, refused where no
    try-once boot exists unless ``fallback`` is off (then said in a warning)."""
    points = tryonce.undervolted(built.overlay)
    if not points:
        return None
    if not fallback:
        warnings.append(f"{built.name} undervolts ({', '.join(points)}) and is installed "
                        "without a try-once boot (--no-fallback): a board that does not boot "
                        "needs the previous entry chosen at the console")
        return None
    if layout.kind != "extlinux":
        raise InstallRefused(f"{built.name} undervolts ({', '.join(points)}), and the "
                             f"{layout.kind} layout has no try-once boot edge-agent can arm: "
                             f"{NO_TRY_ONCE.get(layout.kind, 'unknown loader')}; "
                             "--no-fallback installs it anyway; nothing was changed")
    trial = tryonce.TryOnce(root, runner)
    trial.check(built.name, points)
    if root.exists(UBOOT_DEFAULTS):
        warnings.append(f"{UBOOT_DEFAULTS}: u-boot-update (a kernel update runs it) rewrites "
                        f"{layout.config} without the fallback entry: confirm the tree "
                        f"({tryonce.CONFIRM}) before updating the kernel")
    return trial


def install(root: Root, built: Built, fallback: bool = True,
            runner: tryonce.Runner | None = None) -> Outcome:
    """Put the ``.dtbo`` where the boot loader reads it and register it; idempotent.  An
    undervolting overlay goes through a try-once boot (:mod:`agent.overlays.tryonce`)."""
    boot = BootFiles(root)
    layout = detect(root, boot)
    warnings = [*built.warnings, *layout.notes, *check_board(root, built.overlay, built.name)]
    trial = _try_once(root, built, layout, fallback, runner, warnings)
    original = _config(boot, layout)
    text = _text(original)
    dtbo, backup = layout.dtbo_path(built.name), layout.backup_path(built.name)
    ours = boot.read(backup) is not None
    existing = boot.read(dtbo)
    if existing is not None and existing != built.dtbo and not ours:
        raise InstallRefused(f"{dtbo} exists, differs, and was not installed by edge-agent; "
                             "choose another name; nothing was changed")
    updated = layout.register(text, built.name)
    source = extlinux.copy_source(updated) if trial is not None else None
    if source is not None:
        updated = extlinux.set_fallback(updated, source)
    changed = boot.write(dtbo, built.dtbo)
    if updated != text:
        if not ours:
            boot.write(backup, original)
        changed = boot.write(layout.config, _data(updated)) or changed
    if trial is not None and changed:
        warnings += trial.arm()
    return Outcome(built.name, layout.kind, layout.config, dtbo,
                   REBOOT if changed else f"{built.name} is already installed: nothing changed",
                   warnings)


def remove(root: Root, name: str, runner: tryonce.Runner | None = None) -> Outcome:
    """Unregister and delete an overlay edge-agent installed; the config as it was before."""
    boot = BootFiles(root)
    layout = detect(root, boot)
    original = _config(boot, layout)
    backup = boot.read(layout.backup_path(name))
    if backup is None:
        raise InstallRefused(f"{name} was not installed by edge-agent (no "
                             f"{layout.backup_path(name)}); nothing was changed")
    text = _text(original)
    source = extlinux.copy_source(text) if layout.kind == "extlinux" else None
    registered = layout.register(_text(backup), name)
    unregistered = layout.unregister(text, name)
    if source is not None and extlinux.copy_source(unregistered) is None:
        unregistered = extlinux.clear_fallback(unregistered, source)  # the copy is gone
    exact = text in (registered, extlinux.set_fallback(registered, source) if source else "")
    restored = backup if exact else _data(unregistered)
    if source is not None and extlinux.clear_fallback(text, source) != text and \
            extlinux.clear_fallback(_text(restored), source) == _text(restored):
        tryonce.TryOnce(root, runner).disarm()  # the fallback is gone: stop counting boots
    changed = boot.write(layout.config, restored)
    changed = boot.remove(layout.dtbo_path(name)) or changed
    boot.remove(layout.backup_path(name))
    return Outcome(name, layout.kind, layout.config, layout.dtbo_path(name),
                   REBOOT if changed else f"{name} was not registered: nothing changed")


def listed(root: Root) -> tuple[Layout, list[dict[str, object]]]:
    """The layout and every overlay its config applies: name, path, present, edge_agent."""
    boot = BootFiles(root)
    layout = detect(root, boot)
    text = _text(_config(boot, layout))
    return layout, [{"name": name, "path": path, "present": _present(boot, path),
                     "edge_agent": boot.read(layout.backup_path(name)) is not None}
                    for name, path in layout.registered(text)]


def _present(boot: BootFiles, path: str) -> bool | None:
    """Whether the file is there; None for a path outside /boot, which is not looked at."""
    try:
        return boot.read(path) is not None
    except RootError:
        return None


def _config(boot: BootFiles, layout: Layout) -> bytes:
    data = boot.read(layout.config)
    if data is None:
        raise InstallRefused(f"{layout.config} vanished; nothing was changed")
    return data
