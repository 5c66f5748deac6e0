"""``edge-agent fleet``'s broker session: from --config (an agent.yaml), --broker and --fleet,
a broker or a cluster's members (``mqtt.brokers``, or --broker with a comma-separated list)
to fail over between."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agent.cli.common import UsageError
from agent.link.brokers import MAX_MEMBERS, parse_member

if TYPE_CHECKING:
    from agent.control.operator import BrokerSettings, Bus


def share_group(value: str) -> str:
    """``--share``'s group: one topic level (it becomes ``$share/<group>/...``)."""
    from agent.config.checks import TOPIC_LEVEL

    if not TOPIC_LEVEL.match(value):
        raise argparse.ArgumentTypeError(f"{value!r}: a share group is letters, digits, '.', "
                                         "'_' and '-' (at most 64)")
    return value


def _broker_list(text: str) -> tuple[str, ...]:
    listed = tuple(text.split(","))
    if len(listed) > MAX_MEMBERS or not all(parse_member(item) for item in listed):
        raise UsageError(f"--broker {text}: expected host:port, or up to {MAX_MEMBERS} of "
                         "them separated by commas ([...] around an IPv6 address)")
    return listed


def _connection(args: argparse.Namespace) -> tuple[BrokerSettings, str]:
    """Broker settings from --config and --broker, and the fleet name."""
    from agent.config import ConfigError, load_config
    from agent.control.operator import BrokerSettings

    try:
        config = load_config(args.config) if args.config else None
    except ConfigError as error:
        raise UsageError(str(error)) from None
    settings = BrokerSettings()
    if config is not None:
        m, tls = config.mqtt, config.mqtt.tls
        settings = BrokerSettings(
            host=m.host, port=m.port, brokers=m.brokers or (), protocol=m.protocol,
            tls=tls is not None,
            tls_ca=tls.ca if tls else None, tls_cert=tls.cert if tls else None,
            tls_key=tls.key if tls else None, username=m.username,
            password_file=m.password_file)
    if args.broker:
        settings = dataclasses.replace(settings, brokers=_broker_list(args.broker))
    if args.protocol:
        settings = dataclasses.replace(settings, protocol=args.protocol)
    fleet = args.fleet or (config.fleet if config is not None else "default")
    return settings, fleet


def connect(args: argparse.Namespace, watch: Sequence[str], share: str | None = None) -> Bus:
    """The operator session for --broker/--config/--fleet; brokers that cannot be used are
    a usage error (exit status 2) that says which broker and why."""
    from agent.control import operator

    settings, fleet = _connection(args)
    try:
        return operator.connect(settings, fleet, watch, share)
    except operator.BrokerError as error:
        raise UsageError(str(error)) from None
