#!/usr/bin/env bash
# Run N local processes x M CPU devices as one multi-process JAX job (gloo collectives):
#
#   launch/local.sh N M [launcher flags] -- <ppgd-tpu args...>
#   launch/local.sh 2 2 -- train --config configs/tms_5-2.yaml
#
# A thin wrapper over `python -m ppgd_tpu launch-local` (`ppgd-tpu launch-local`);
# launcher flags: --port P, --module M, --exec. Set PYTHON to choose the interpreter.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: $0 N M [launcher flags] -- <ppgd-tpu args...>" >&2
  exit 2
fi
processes=$1
devices=$2
shift 2
repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="${repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python}" -m ppgd_tpu launch-local \
  --processes "${processes}" --devices_per_process "${devices}" "$@"
