"""``edge-agent serve``: the inference data plane alone (``run`` starts and supervises it)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from agent.cli.common import add_config_file, add_state_dir


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub = commands.add_parser(
        "serve", help="the inference server: the Open Inference Protocol (HTTP, gRPC) over "
        "the model repository, until SIGTERM")
    add_config_file(sub)
    sub.add_argument("--root", metavar="DIR", help="override the config's root")
    add_state_dir(sub, "the agent's state (repository default, model cache)")
    sub.add_argument("--http", metavar="HOST:PORT", help="override serve.http (port 0: any)")
    sub.add_argument("--grpc", metavar="HOST:PORT", help="override serve.grpc (port 0: any)")
    sub.add_argument("--ready-file", type=Path, metavar="FILE",
                     help="write {pid, http, grpc} here once both listen")
    sub.add_argument("--sched-file", type=Path, metavar="FILE",
                     help="the inference threads' scheduling, read again on SIGHUP")
    sub.add_argument("--token-file", type=Path, action="append", default=[], metavar="FILE",
                     help="another file whose token may load and unload models")
    sub.add_argument("--parent-pid", type=int, metavar="PID", help=argparse.SUPPRESS)
    sub.set_defaults(handler=serve)


def serve(args: argparse.Namespace) -> int:
    from agent.cli.service import LOG_FORMAT, command_config
    from agent.service.serve import serve as run_serve

    if args.parent_pid:  # supervised: end with the control plane that started it
        from agent.kernel.process import die_with_parent

        die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    config = command_config(args)
    return run_serve(config, Path(config.state_dir), ready_file=args.ready_file,
                     sched_file=args.sched_file, token_files=tuple(args.token_file),
                     http=args.http, grpc=args.grpc)
