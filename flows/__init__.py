"""Prefect flows over the `tasks/` layer: the checkpoint lifecycle, the bucket watcher, the demo.

Flows compose tasks and own deployment concerns (parameters for the UI, `run_deployment`, events);
`infra/prefect.yaml` deploys them.
"""
