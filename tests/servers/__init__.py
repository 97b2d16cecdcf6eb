"""Real servers on loopback for the tests: the GCS emulator and moto's S3 (``stores``, a pytest plugin),
a Hub-protocol server (``hub``), the fault-injecting proxy in front of them (``faultproxy``), a Dask
cluster whose workers each sit behind their own proxies (``cluster``) and a Prefect server
(``prefect``). The plugins are registered in ``tests/conftest.py``."""
