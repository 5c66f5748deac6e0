"""The agent's configuration (``/etc/edge-agent/agent.yaml``): its sections are declared in
``sections`` (rules and defaults with each key), ``loader`` reads and checks a file.

Every key has a default, so no file (or an empty one) runs the built-in demo.
"""

from __future__ import annotations

from agent.config.loader import (
    DEFAULT_PATH,
    ConfigError,
    check_root,
    from_dict,
    load_config,
    profile_problem,
)
from agent.config.sections import Config

__all__ = ["DEFAULT_PATH", "Config", "ConfigError", "check_root", "from_dict", "load_config",
           "profile_problem"]
