"""Compile overlay source with Debian's ``dtc`` (device-tree-compiler), always with ``-@``.

``-@`` keeps the labels an overlay references as ``__fixups__``, which the boot loader
resolves against the base DTB's ``__symbols__``; without it the overlay cannot apply.
"""

from __future__ import annotations

import shutil
import subprocess

from agent.overlays.errors import OverlayError


class DtcMissing(RuntimeError):
    """``dtc`` is not installed here."""

    def __init__(self) -> None:
        super().__init__("dtc not found: install Debian's device-tree-compiler "
                         "(apt-get install device-tree-compiler; ./install.sh --dev does it)")


def compile_dts(source: str, file: str) -> tuple[bytes, list[str]]:
    """The ``.dtbo`` bytes for overlay source, and dtc's warnings; errors name ``file``."""
    dtc = shutil.which("dtc")
    if dtc is None:
        raise DtcMissing()
    result = subprocess.run([dtc, "-@", "-I", "dts", "-O", "dtb", "-o", "-", "-"],
                            input=source.encode(), capture_output=True, check=False,
                            timeout=60)
    messages = result.stderr.decode(errors="replace").replace("<stdin>", file).strip()
    if result.returncode != 0:
        raise OverlayError(file, "", f"dtc could not compile it: {messages}")
    return result.stdout, messages.splitlines()
