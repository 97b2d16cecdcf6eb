#!/usr/bin/env bash
# Create the work pools, the result storage block and the failure notification (infra/server_objects.py),
# register every deployment of infra/prefect.yaml against $PREFECT_API_URL, then check that the server's
# scheduler creates runs for the scheduled ones (infra/check_schedules.py).
#   CKPTFLOW_GPU_POOL_TYPE=docker|kubernetes (default docker) picks the GPU pool's base job template.
#   CKPTFLOW_RESULTS (default ~/.cache/ckptflow/results) is the result storage folder of a new block.
#   CKPTFLOW_NOTIFY_BLOCK=block-type/name (e.g. slack-webhook/ckptflow-alerts) turns on failure notifications.
#   CKPTFLOW_SCHEDULE_CHECK_SECONDS (default 60) is how long to wait for scheduled runs; 0 skips the check.
set -euo pipefail
cd "$(dirname "$0")/.."
gpu_type="${CKPTFLOW_GPU_POOL_TYPE:-docker}"
: "${PREFECT_API_URL:?set PREFECT_API_URL to your Prefect server, e.g. http://localhost:4200/api}"
# The Python that `prefect` runs on (a virtual environment's or the image's), for the check below.
python="$(dirname "$(command -v prefect)")/python"
[ -x "$python" ] || python=python3

prefect --no-prompt work-pool create cpu --type process --overwrite
prefect --no-prompt work-pool create gpu --type "$gpu_type" \
    --base-job-template "infra/work-pools/${gpu_type}-gpu.json" --overwrite
"$python" infra/server_objects.py
prefect --no-prompt deploy --all --prefect-file infra/prefect.yaml

wait_s="${CKPTFLOW_SCHEDULE_CHECK_SECONDS:-60}"
if [ "$wait_s" != 0 ]; then
    "$python" infra/check_schedules.py --wait "$wait_s"
fi
