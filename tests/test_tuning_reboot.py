"""After a reboot (issue 31 item 16a): a runtime journal whose boot id is gone describes
settings that went with the boot; verify and status say so, and what applies them again,
instead of reporting every runtime setting as drift."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from cli_helpers import edge_agent
from tuning_helpers import copy_board

BOARD = "rk3588-vendor"


def _rebooted(tmp_path: Path) -> tuple[Path, Path]:
    """rk3588-latency applied on one boot; then a fresh boot: every file back at the kernel's
    defaults (a new copy of the board) and a new boot id.  Returns (tree, state dir)."""
    state = tmp_path / "state"
    applied = edge_agent("profile", "apply", "rk3588-latency", "--root",
                         copy_board(BOARD, tmp_path / "first"), "--state-dir", state)
    assert applied.returncode == 0, applied.stderr
    tree = copy_board(BOARD, tmp_path / "second")
    (tree / "proc/sys/kernel/random/boot_id").write_text(f"{uuid.uuid4()}\n")
    return tree, state


def test_verify_after_a_reboot_says_the_settings_went_with_the_boot(tmp_path: Path) -> None:
    tree, state = _rebooted(tmp_path)
    verify = edge_agent("profile", "verify", "--root", tree, "--state-dir", state)
    assert verify.returncode == 1  # nothing of the profile is in force
    assert verify.stdout.startswith("verify: the runtime settings of rk3588-latency were "
                                    "applied in an earlier boot")
    assert "went with the reboot; that is not drift" in verify.stdout
    assert "The service re-applies them when it starts (tuning.apply: true" in verify.stdout
    assert "`sudo edge-agent profile apply rk3588-latency`" in verify.stdout
    assert "drift found" not in verify.stdout
    data = json.loads(edge_agent("profile", "verify", "--root", tree, "--state-dir", state,
                                 "--json").stdout)
    assert data["ok"] is False and data["drift"] == []
    assert "went with the reboot" in data["gone_with_boot"]


def test_status_after_a_reboot_says_gone_with_the_boot(tmp_path: Path) -> None:
    tree, state = _rebooted(tmp_path)
    status = edge_agent("profile", "status", "--root", tree, "--state-dir", state)
    assert status.returncode == 0
    assert "went with the reboot; that is not drift" in status.stdout
    assert "drifted" not in status.stdout
    applied = json.loads(edge_agent("profile", "status", "--root", tree, "--state-dir", state,
                                    "--json").stdout)["applied"]
    assert applied["status"] == "gone with the boot" and applied["drift"] == 0


def test_apply_again_after_the_reboot_holds(tmp_path: Path) -> None:
    tree, state = _rebooted(tmp_path)
    again = edge_agent("profile", "apply", "rk3588-latency", "--root", tree, "--state-dir",
                       state)
    assert again.returncode == 0 and "is from another boot" in again.stdout
    verify = edge_agent("profile", "verify", "--root", tree, "--state-dir", state)
    assert verify.returncode == 0 and verify.stdout.strip() == \
        "verify: every applied setting holds"
