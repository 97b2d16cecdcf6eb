"""Prefect tasks over the core library: retries, caching, artifacts and logging; no checkpoint logic.

Each task calls one core function (`ckptflow.validate`, `ckptflow.consolidate`, `ckptflow.verify`,
`ckptflow.reshard`, `ckptflow.publish`) and adds what Prefect is for: I/O tasks retry transient
errors with exponential backoff and jitter (`tasks.retries`), results are cached on the checkpoint's
identity and the options (`tasks.caching`), and each task leaves artifacts (`tasks.artifacts`).
"""
