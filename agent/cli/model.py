"""``edge-agent model build``: INT8, FP16 or ``.rknn`` builds of an ONNX model for a target,
installed as the model's next version only when they pass the accuracy gate and are faster
here (exit 1 with the report when none does)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from agent.cli.common import UsageError, add_repository_choice, emit

if TYPE_CHECKING:
    from agent.config import Config
    from agent.modelbuild.report import BuildReport
    from agent.modelbuild.request import BuildRequest

TARGET_HELP = "cpu | tensorrt | openvino | rknn:rk3588 | rknn:rk3576 | rknn:rk3566"


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = commands.add_parser("model", help="build and tune models for this device")
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub = actions.add_parser(
        "build", help="an INT8, FP16 or .rknn build of an ONNX model, checked against the "
        "original and installed as the next version when it passes")
    sub.add_argument("source", type=Path, metavar="SRC.onnx")
    sub.add_argument("--name", required=True, help="the model's name in the repository")
    sub.add_argument("--target", default="cpu", help=f"{TARGET_HELP} (default: cpu)")
    sub.add_argument("--precision", default=None,
                     help="int8 | fp16 (default: int8; fp16 for tensorrt)")
    sub.add_argument("--calibration", type=Path, metavar="DIR", required=True,
                     help="a directory of .npy (one input batch each), .npz (one array per "
                     "input) or image files: every other one calibrates, the rest are the "
                     "held-out inputs the gate compares on")
    sub.add_argument("--gate", metavar="K=V,...",
                     help="top1=0.99,cosine=0.999,speed=1.05 (the defaults; speed=0: not "
                     "judged)")
    sub.add_argument("--preprocess", metavar="K=V,...",
                     help="for images: mean=R:G:B,std=R:G:B (0..255 units),order=rgb|bgr")
    add_repository_choice(sub, "repository and converter are used")
    sub.add_argument("--rknn-python", metavar="PATH",
                     help="the rknn-toolkit2 converter's python (default: the config's "
                     "model_build.rknn_python)")
    sub.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.set_defaults(handler=build, root=None)
    from agent.cli.model_tune import register_tune

    register_tune(actions)


def _request(args: argparse.Namespace, rknn_python: str | None) -> BuildRequest:
    from agent.modelbuild.request import BuildError, BuildRequest, parse_gate, parse_preprocess
    from agent.serving.repository import valid_name

    if not valid_name(args.name):
        raise UsageError(f"--name {args.name!r}: letters, digits, '.', '_' and '-', not "
                         "starting with '.'")
    precision = args.precision or ("fp16" if args.target == "tensorrt" else "int8")
    try:
        return BuildRequest(args.source, args.name, args.target, precision, args.calibration,
                            parse_gate(args.gate), parse_preprocess(args.preprocess),
                            rknn_python)
    except BuildError as error:
        raise UsageError(str(error)) from None


def build(args: argparse.Namespace) -> int:
    from agent.cli.service import command_config
    from agent.modelbuild.build import build_candidate
    from agent.modelbuild.install import install

    config = command_config(args) if args.repository is None else None
    repository = args.repository or Path(config.repository if config else "")
    builtins: set[str] = set()
    if config is not None:
        from agent.service.serve import builtin_models

        builtins = set(builtin_models(config))
    request = _request(args, args.rknn_python
                       or (config.model_build.rknn_python if config else None))
    progress = (lambda step: None) if args.json else (
        lambda step: print(f"  ... {step}", file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="edge-agent-build-") as work:
        report = build_candidate(request, Path(work), progress)
        if report.passed:
            install(report, Path(work), repository, builtins)
    loaded, served = _load(config, report, repository) if config and report.passed \
        else (report.passed, "")
    document = {**report.to_dict(), **({"data_plane": served} if served else {})}
    emit(args.json, document, report.render() + (f"\n  {served}" if served else "")
         + _hint(report, repository))
    return 0 if loaded else 1


def _load(config: Config, report: BuildReport, repository: Path) -> tuple[bool, str]:
    """Load the new version into the running data plane (model control is explicit: a
    running server serves a version once it is asked to load it).  A version the server
    refuses is removed again, so the next start does not fail on it."""
    from agent.cli.running import running_data_plane
    from agent.serving.errors import ServeError

    client, address = running_data_plane(config)
    if client is None:
        return True, f"{address}: it loads version {report.version} when it starts"
    try:
        with client:
            client.load(report.request.name)
    except ServeError as error:
        shutil.rmtree(repository / report.request.name / str(report.version),
                      ignore_errors=True)
        return False, (f"the running data plane ({address}) refused version "
                       f"{report.version} ({error.message}); it was removed again")
    return True, f"loaded into the running data plane ({address})"


def _hint(report: BuildReport, repository: Path) -> str:
    """What the user still does for an installed TensorRT or OpenVINO build: the model's
    precision in config.yaml decides the engine the provider builds."""
    if not report.passed or report.request.target not in ("tensorrt", "openvino"):
        return ""
    return (f"\n  note: set `precision: {report.request.precision}` in "
            f"{repository / report.request.name / 'config.yaml'} so that "
            f"{report.request.target} builds its engine in {report.request.precision}")
