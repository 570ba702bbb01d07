#!/bin/sh
# Slurm Prolog/Epilog for keel exporter's job_mapping_dir (dcgm-exporter's
# format: a file per GPU index, one job id per line).
#
#   Prolog=/etc/slurm/keel-job-mapping.sh     (runs as: keel-job-mapping.sh)
#   Epilog=/etc/slurm/keel-job-mapping.sh
#
# SLURM_SCRIPT_CONTEXT says which (prolog_slurmd / epilog_slurmd); the
# first argument `prolog` or `epilog` overrides it. The GPUs are the node's
# indexes in GPU_DEVICE_ORDINAL, else CUDA_VISIBLE_DEVICES, else
# SLURM_JOB_GPUS (in the prolog they are global, not the job's 0..n-1).
# The directory is KEEL_JOB_MAPPING_DIR, default
# /var/lib/dcgm-exporter/job-mapping. It always exits 0: a failing prolog
# or epilog drains the node.
dir=${KEEL_JOB_MAPPING_DIR:-/var/lib/dcgm-exporter/job-mapping}
job=${SLURM_JOB_ID:-}
gpus=${GPU_DEVICE_ORDINAL:-${CUDA_VISIBLE_DEVICES:-${SLURM_JOB_GPUS:-}}}
mode=${1:-}
case $mode in
prolog | epilog) ;;
*) case ${SLURM_SCRIPT_CONTEXT:-} in
    prolog*) mode=prolog ;;
    epilog*) mode=epilog ;;
    *) exit 0 ;;
    esac ;;
esac
case $job in '' | *[!0-9_]*) exit 0 ;; esac
mkdir -p "$dir" 2>/dev/null || exit 0
for g in $(printf '%s' "$gpus" | tr ',' ' '); do
    case $g in '' | *[!0-9]*) continue ;; esac
    f=$dir/$g
    if [ "$mode" = prolog ]; then
        grep -qx "$job" "$f" 2>/dev/null || printf '%s\n' "$job" >>"$f"
    elif [ -f "$f" ]; then
        tmp=$(mktemp "$dir/.$g.XXXXXX") || continue
        grep -vx "$job" "$f" >"$tmp" 2>/dev/null
        chmod 644 "$tmp"
        mv -f "$tmp" "$f"
    fi
done
exit 0
