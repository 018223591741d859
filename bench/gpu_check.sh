#!/usr/bin/env bash
# What one lent GPU must show of the trainer's CUDA/NCCL path, in at most 8 minutes (bench/gpu_check.py
# lists the steps). Nothing is installed or downloaded: the lent machine has torch + CUDA, transformers,
# safetensors and numpy, no vLLM, no network.
#
#   bench/gpu_check.sh --prepare DIR          on a CPU host: the carried inputs (a few MB) into DIR
#   bench/gpu_check.sh --dry-run [DIR]        every step's files and flags checked, nothing run (CI)
#   bench/gpu_check.sh DIR [--out OUTDIR]     on the GPU: rows and logs into OUTDIR (default $OUT) as each
#                                             step ends; a table; exit 1 if any step failed
set -uo pipefail
cd "$(dirname "$0")/.."
py=python3
[[ -x .venv/bin/python ]] && py=.venv/bin/python
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
case "${1:-}" in
    --prepare) shift; exec "$py" bench/gpu_check.py prepare "$@" ;;
    --dry-run) shift; bash -n "$0" || exit 1; exec "$py" bench/gpu_check.py dry-run "$@" ;;
    ""|-h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
    *) exec "$py" bench/gpu_check.py run "$@" ;;
esac
