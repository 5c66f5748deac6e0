#!/usr/bin/env bash
# edge-agent installer.
#   ./install.sh --dev          workstation checkout: .venv with the package (editable) and the
#                               test tools, plus the Debian packages the tests need
#   ./install.sh [--prefix P]   device install into P (default /opt/edge-agent)
# Only pip and apt packages are fetched; nothing else is downloaded.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="/opt/edge-agent"
mode="device"

usage() {
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dev) mode="dev" ;;
        --prefix) prefix="${2:?--prefix needs a directory}"; shift ;;
        --prefix=*) prefix="${1#--prefix=}" ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option '$1' (allowed: --dev, --prefix DIR, --help)" >&2
           exit 2 ;;
    esac
    shift
done

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "install.sh: $python is missing or older than 3.10 (JetPack 6 ships 3.10)" >&2
    exit 1
fi

case "$(uname -m)" in
    aarch64|x86_64) ;;
    *) echo "install.sh: unsupported architecture $(uname -m) (allowed: aarch64, x86_64)" >&2
       exit 1 ;;
esac

# Debian packages: venv support always; the tests' system tools in --dev mode.
apt_packages=()
"$python" -c 'import ensurepip, venv' 2>/dev/null || apt_packages+=(python3-venv)
if [ "$mode" = dev ]; then
    dpkg -s libudev1 >/dev/null 2>&1 || apt_packages+=(libudev1)
    # the MQTT tests start a real broker (mosquitto, mosquitto_passwd)
    dpkg -s mosquitto >/dev/null 2>&1 || apt_packages+=(mosquitto)
fi
if [ "${#apt_packages[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "install.sh: please install these Debian packages first: ${apt_packages[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

if [ "$mode" = dev ]; then
    venv="$here/.venv"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e "$here[dev]"
    echo "edge-agent (dev) installed in $venv"
else
    venv="$prefix"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "$here"
    # built-in profiles next to the venv, where the agent looks for them (sys.prefix)
    mkdir -p "$venv/profiles"
    cp "$here"/profiles/*.yaml "$venv/profiles/"
    echo "edge-agent installed in $venv (command: $venv/bin/edge-agent)"
fi
