#!/usr/bin/env bash
# Submit `vintage run CONFIG` to a running Ray cluster as a Ray job (`ray job submit`).
#
#   deploy/submit.sh [--address URL] [--working-dir DIR] [--no-wait] [--submission-id ID] CONFIG [-- VINTAGE_RUN_ARGS...]
#
#   --address URL        the cluster's job API (dashboard), e.g. http://127.0.0.1:8265;
#                        default $RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS, then http://127.0.0.1:8265
#   --working-dir DIR    upload DIR (honouring .gitignore) as the job's working directory; CONFIG is
#                        then taken relative to DIR. Without it the entrypoint runs in the directory
#                        the head was started from, with the vintage installed there.
#   --no-wait            return after submission (default: stream logs; exit 0 iff the job SUCCEEDED)
#   --submission-id ID   a job id of your choice (for `ray job status|logs|stop ID`)
#   after `--`           extra arguments of `vintage run`, e.g. --set controller.total_steps=5
#
# Authentication: Ray >= 2.52 clusters with token auth (the default for local clusters from Ray 2.59)
# refuse unauthenticated job submissions. Export the cluster's token as RAY_AUTH_TOKEN (or point
# RAY_AUTH_TOKEN_PATH at a file holding it); this script then sets RAY_AUTH_MODE=token for the
# client. Without either, the Ray CLI falls back to ~/.ray/auth_token.
#
# The job connects to the cluster it runs on (`--address auto`, the job's RAY_ADDRESS), never a
# private one. Examples:
#   RAY_AUTH_TOKEN=... deploy/submit.sh --address http://127.0.0.1:8265 deploy/configs/tiny.toml
#   RAY_AUTH_TOKEN=... deploy/submit.sh --address http://head:8265 --working-dir . \
#       deploy/configs/gpu-cluster.toml -- --set controller.total_steps=100
set -euo pipefail

usage() { sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; }

ADDRESS="${RAY_API_SERVER_ADDRESS:-${RAY_ADDRESS:-http://127.0.0.1:8265}}"
WORKDIR=""
SUBMIT_EXTRA=()
CONFIG=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --address) ADDRESS="$2"; shift 2 ;;
    --address=*) ADDRESS="${1#*=}"; shift ;;
    --working-dir) WORKDIR="$2"; shift 2 ;;
    --working-dir=*) WORKDIR="${1#*=}"; shift ;;
    --no-wait) SUBMIT_EXTRA+=(--no-wait); shift ;;
    --submission-id) SUBMIT_EXTRA+=(--submission-id "$2"); shift 2 ;;
    --submission-id=*) SUBMIT_EXTRA+=(--submission-id "${1#*=}"); shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "submit.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) if [[ -z "$CONFIG" ]]; then CONFIG="$1"; shift; else echo "submit.sh: unexpected argument $1" >&2; exit 2; fi ;;
  esac
done
if [[ -z "$CONFIG" ]]; then echo "submit.sh: CONFIG is required" >&2; usage >&2; exit 2; fi
case "$ADDRESS" in http://*|https://*) ;; *) ADDRESS="http://$ADDRESS" ;; esac

# the Ray CLI of this checkout's venv when there is one, else the one on PATH
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RAY="$HERE/.venv/bin/ray"
[[ -x "$RAY" ]] || RAY="$(command -v ray || true)"
if [[ -z "$RAY" ]]; then echo "submit.sh: the ray CLI is not installed (make install)" >&2; exit 2; fi

if [[ -n "${RAY_AUTH_TOKEN:-}" || -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
  export RAY_AUTH_MODE=token
fi

if [[ -n "$WORKDIR" ]]; then
  SUBMIT_EXTRA+=(--working-dir "$WORKDIR")
  # the config must be inside the uploaded directory; pass it relative to it
  if [[ "$CONFIG" = /* ]]; then
    CONFIG="$(realpath --relative-to="$WORKDIR" "$CONFIG")"
  fi
  [[ -f "$WORKDIR/$CONFIG" ]] || { echo "submit.sh: $CONFIG not found under $WORKDIR" >&2; exit 2; }
else
  # no upload: the config path must be valid on the head node; make a local path absolute
  if [[ -f "$CONFIG" && "$CONFIG" != /* ]]; then CONFIG="$(realpath "$CONFIG")"; fi
fi

set -x
exec "$RAY" job submit --address "$ADDRESS" "${SUBMIT_EXTRA[@]}" -- vintage run "$CONFIG" --address auto "$@"
