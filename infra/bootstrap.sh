#!/usr/bin/env bash
# Create the work pools and register every deployment of infra/prefect.yaml against $PREFECT_API_URL.
#   CKPTFLOW_GPU_POOL_TYPE=docker|kubernetes (default docker) picks the GPU pool's base job template.
set -euo pipefail
cd "$(dirname "$0")/.."
gpu_type="${CKPTFLOW_GPU_POOL_TYPE:-docker}"
: "${PREFECT_API_URL:?set PREFECT_API_URL to your Prefect server, e.g. http://localhost:4200/api}"

prefect --no-prompt work-pool create cpu --type process --overwrite
prefect --no-prompt work-pool create gpu --type "$gpu_type" \
    --base-job-template "infra/work-pools/${gpu_type}-gpu.json" --overwrite
prefect --no-prompt deploy --all --prefect-file infra/prefect.yaml
