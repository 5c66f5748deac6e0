"""Errors a person can act on: which file and entry is wrong, or why an install was refused."""

from __future__ import annotations

from agent.validation import SettingsError


class OverlayError(SettingsError):
    """A table or overlay that cannot be used: ``file: opps[2].hz: message``."""


class InstallRefused(Exception):
    """The boot files were left untouched: an unknown layout, a missing label, no FDT line."""
