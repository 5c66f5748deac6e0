"""Errors a person can act on: the file, the key path, the value and what is allowed."""

from __future__ import annotations


class ProfileError(ValueError):
    """A profile that cannot be loaded or planned: ``file: key.path: message``."""

    def __init__(self, file: str, key: str, message: str) -> None:
        self.file, self.key, self.message = file, key, message
        super().__init__(f"{file}: {key}: {message}" if key else f"{file}: {message}")
