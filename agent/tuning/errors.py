"""Errors a person can act on: the file, the key path, the value and what is allowed."""

from __future__ import annotations

from agent.validation import SettingsError


class ProfileError(SettingsError):
    """A profile that cannot be loaded or planned: ``file: key.path: message``."""
