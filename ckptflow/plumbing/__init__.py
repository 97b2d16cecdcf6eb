"""What every step stands on: storage (URIs to fsspec), stores (what each backend is: checksums, stamps,
limits, broken upload sessions, the local fast-path test), ranges (the one byte-range reader), retry and
failures, staging (prepare / commit / abort, marker last), progress (one callback contract), executors
(units side by side), direct (O_DIRECT writes of whole blocks), redaction, sizes."""
