"""``edge-agent config check``: would ``edge-agent run`` start with this file, and as asked?

The schema (unknown keys, bad values), the consistency of the values, the root and the
tuning profile are checked as ``run`` checks them, and every file the config names is opened
as the agent opens it (agent.config.files); every problem is a line naming the file and the
key, and any problem is exit 2.  With inference on, so are the models of the repository the
data plane would refuse (a bad key in a model's config.yaml, no version to serve): ``run``
starts without them, so an operator's check of a change should say so first.

``edge-agent config node-id``: the node id ``run`` would use (the file's, else the default
of agent.config.nodeid); install.sh writes it into a new config, so the rule lives here only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from agent.cli.common import UsageError, add_config_file, print_json

if TYPE_CHECKING:
    from agent.config import Config


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = commands.add_parser("config", help="check an agent.yaml as run would read it")
    actions = config.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, handler, summary in (
            ("check", run, "schema, values, root, tuning profile and the files it names; "
             "exit 0 if fine, 2 with each problem"),
            ("node-id", show_node_id, "the node id run would use: the file's node_id, else "
             "hostname-<6 hex of the machine id's sha256>")):
        action = actions.add_parser(name, help=summary)
        add_config_file(action)
        action.add_argument("--json", action="store_true", help="machine-readable output")
        action.set_defaults(handler=handler)


def problems(path: str | None) -> tuple[str, list[str]]:
    """(the file as messages name it, each problem in the order run would meet them)."""
    from agent.config import ConfigError, check_root, load_config, profile_problem
    from agent.config.files import file_problems

    try:
        config = load_config(path)
    except ConfigError as error:
        return error.file, [str(error)]
    try:
        check_root(config)
    except ConfigError as error:
        return config.source, [str(error)]  # the profiles are read through the root
    unknown_profile = profile_problem(config)
    found = [] if unknown_profile is None else [str(unknown_profile)]
    found += [str(problem) for problem in file_problems(config)]
    return config.source, found + (_model_problems(config) if config.inference.enabled else [])


def _model_problems(config: Config) -> list[str]:
    """Why the data plane would not serve each model of the repository it would scan, one
    line each (a YAML parser's message spans several); none when the repository is no
    directory (file_problems said so, and every built-in would only repeat it)."""
    from agent.service.serve import builtin_models
    from agent.serving.repository import scan

    repository = Path(config.repository)
    if repository.exists() and not repository.is_dir():
        return []
    models = scan(repository, builtin_models(config))
    return [f"model {name}: {' '.join(entry.error.split())}"
            for name, entry in models.items() if entry.error]


def run(args: argparse.Namespace) -> int:
    from agent.config import DEFAULT_PATH

    file, found = problems(args.config)
    if args.config is None and file == "built-in defaults":
        file += f" (no {DEFAULT_PATH})"
    if args.json:
        print_json({"file": file, "ok": not found, "problems": found})
    else:
        print("\n".join(found) if found else f"{file}: ok")
    return 2 if found else 0


def show_node_id(args: argparse.Namespace) -> int:
    """The id on stdout (one line, for install.sh); why it may collide on stderr."""
    from agent.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as error:
        raise UsageError(str(error)) from None
    warning = config.node_id_warning
    if args.json:
        print_json({"node_id": config.node_id, "file": config.source,
                    "derived": config.raw.get("node_id") is None, "warning": warning})
    else:
        print(config.node_id)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    return 0
