#!/usr/bin/env bash
# Create an NVIDIA IMEX channel so that CUDA VMM fabric handles work on this host.
#
#   conf_vmm.sh [--dry-run] [channel_id]        (channel_id: non-negative integer, default 0)
#
# Needs sudo (or root). Creates /dev/nvidia-caps-imex-channels/channel<id> as a character
# device with the major number the NVIDIA driver registered for nvidia-caps-imex-channels
# (read from /proc/devices) and minor <id>, then gives the invoking user read/write access.
# It does not install the NVIDIA driver or make unsupported hardware fabric-capable; in a
# container, pass the created device through as well. Channels do not survive a reboot.
# --dry-run prints the commands instead of running them.
set -euo pipefail

dry_run=0
if [[ ${1:-} == --dry-run ]]; then dry_run=1; shift; fi
channel=${1:-0}
if [[ $# -gt 1 || ! $channel =~ ^[0-9]+$ ]]; then
  echo "conf_vmm.sh: channel_id must be one non-negative integer, got '$*'" >&2
  exit 2
fi
devices=${CONF_VMM_PROC_DEVICES:-/proc/devices}  # overridable for tests
dev_dir=${CONF_VMM_DEV_DIR:-/dev/nvidia-caps-imex-channels}
major=$(awk '$2 == "nvidia-caps-imex-channels" {print $1}' "$devices" 2>/dev/null || true)
if [[ -z $major ]]; then
  echo "conf_vmm.sh: the NVIDIA driver has not registered nvidia-caps-imex-channels in" \
       "$devices; load a driver with IMEX support first" >&2
  exit 1
fi
user=${SUDO_USER:-$(id -un)}
node=$dev_dir/channel$channel
sudo_cmd=(sudo)
[[ $(id -u) == 0 ]] && sudo_cmd=()
run() {
  if [[ $dry_run == 1 ]]; then echo "$*"; else "${sudo_cmd[@]}" "$@"; fi
}
run mkdir -p "$dev_dir"
if [[ ! -e $node ]]; then run mknod "$node" c "$major" "$channel"; fi
run chown "$user" "$node"
run chmod u+rw "$node"
echo "IMEX channel $node (major $major, minor $channel): readable and writable by $user"
