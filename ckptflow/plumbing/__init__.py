"""What every step stands on: storage (URIs to fsspec), retry, staging (prepare / commit / abort,
marker last), progress (one callback contract), executors (units side by side), direct (O_DIRECT writes of
whole blocks), redaction, sizes."""
