#!/usr/bin/env bash
# Installs the system packages the testbed needs, on a fresh Debian 12, as root, non-interactively.
#
# Idempotent: when every package is already installed it does nothing (no apt-get update, no network).
# It must not leave the distro's own services running: the testbed starts its *own* sshd, dockerd and
# containerd per node (network namespaces), and Prometheus from the tests. A policy-rc.d that forbids
# starting services is in place while apt runs; afterwards the distro units are stopped and disabled,
# whether systemd is PID 1 or not (in a sandbox it usually is not).
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "install-deps.sh: must run as root" >&2
    exit 1
fi

PACKAGES=(
    openssh-server openssh-client   # sshd per node, ssh-keygen for host and client keys
    docker.io containerd runc       # one dockerd (+ its containerd) per node
    rsync                           # the reconciler copies weights with it
    gcc make libpopt-dev zlib1g-dev xz-utils curl   # testbed/rsync-builds.sh: rsync 3.4.1 built for the confinement test
    iproute2 iputils-ping           # netns, veth, link faults
    util-linux e2fsprogs mount      # nsenter, losetup, mkfs.ext4 for the worker's small model disk
    procps psmisc                   # ps/kill, used when tearing down
    sudo                            # the spark user's few NOPASSWD commands
    systemd                         # systemd-analyze verify, systemd-socket-activate (tests/unit/loop/test_listener.py)
    prometheus                      # scrapes the daemon; promtool tests alert rules
    prometheus-alertmanager         # amtool check-config and a real Alertmanager: tests/unit/repo/test_alertmanager_example.py; never its unit
    busybox-static                  # tiny static tools inside the stand-in images
    lxcfs                           # each node's /proc/meminfo from its memory cgroup (testbed/memory.py)
    python3 python3.11-venv         # the real vLLM image's venv is made with Debian's python3.11
    g++-12 libpython3.11-dev openssl   # copied into the real vLLM image: torch's inductor compiles C++ at run time
    docker-registry                 # distribution 2.8: the head's "internet" registry (testbed/registry.py); never its unit
    tmux                            # a real terminal at 80 and 200 columns for `reconciler status` (tests/unit/cli/test_status_tmux.py)
)
NAMES=("${PACKAGES[@]}")

missing=()
for p in "${NAMES[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    if [ "$status" != "install ok installed" ]; then
        missing+=("$p")
    fi
done

DISTRO_UNITS=(ssh.service ssh.socket docker.service docker.socket containerd.service
              prometheus.service prometheus-node-exporter.service lxcfs.service docker-registry.service
              prometheus-alertmanager.service)

stop_distro_services() {
    if [ "$(cat /proc/1/comm 2>/dev/null)" = systemd ]; then
        for u in "${DISTRO_UNITS[@]}"; do
            if systemctl list-unit-files "$u" >/dev/null 2>&1; then
                systemctl disable --now "$u" >/dev/null 2>&1 || true
            fi
        done
    else
        # No systemd: the sysvinit scripts (if apt ran them) keep pidfiles we can stop by.
        for s in ssh docker containerd prometheus prometheus-node-exporter lxcfs docker-registry prometheus-alertmanager; do
            if [ -x "/etc/init.d/$s" ]; then
                "/etc/init.d/$s" stop >/dev/null 2>&1 || true
                update-rc.d "$s" disable >/dev/null 2>&1 || true
            fi
        done
    fi
}

# The `hf` CLI for the head node only (testbed/hub.py is its Hub): huggingface_hub pinned in its own venv, made with
# Debian's python3 so the `spark` user can run it; the head's sshd puts its bin/ on the head's PATH (testbed/sshd.py).
HF_VENV=/opt/spark-testbed/hf
HF_REQS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/hf-requirements.txt"
install_hf_cli() {
    local want
    want=$(sha256sum "$HF_REQS" | cut -d' ' -f1)
    if [ -x "$HF_VENV/bin/hf" ] && [ "$(cat "$HF_VENV/.installed" 2>/dev/null)" = "$want" ]; then
        return 0
    fi
    echo "install-deps.sh: the hf CLI into $HF_VENV"
    rm -rf "$HF_VENV"
    /usr/bin/python3 -m venv "$HF_VENV"
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$HF_VENV/bin/pip" install -q --no-deps -r "$HF_REQS"
    chmod -R a+rX "$HF_VENV"
    echo "$want" > "$HF_VENV/.installed"
}

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install-deps.sh: all ${#NAMES[@]} packages already installed"
    stop_distro_services
    install_hf_cli
    exit 0
fi
echo "install-deps.sh: installing: ${missing[*]}"

export DEBIAN_FRONTEND=noninteractive

# Forbid apt from starting services while it installs (standard Debian mechanism, see invoke-rc.d(8)).
POLICY=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$POLICY"
    chmod 755 "$POLICY"
    made_policy=1
fi
cleanup() { if [ "$made_policy" = 1 ]; then rm -f "$POLICY"; fi; }
trap cleanup EXIT

# apt-get update only if the package lists are missing or older than a day.
lists_fresh=0
if compgen -G "/var/lib/apt/lists/*_Packages" >/dev/null; then
    if [ -n "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages' -mmin -1440 -print -quit)" ]; then
        lists_fresh=1
    fi
fi
if [ "$lists_fresh" = 0 ]; then
    apt-get update -qq -o DPkg::Lock::Timeout=600
fi

if ! apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"; then
    # Lists may be stale even though recent: refresh once and retry.
    apt-get update -qq -o DPkg::Lock::Timeout=600
    apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"
fi

stop_distro_services
install_hf_cli
echo "install-deps.sh: done"
