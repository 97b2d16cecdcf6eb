"""The one compiled part of ckptflow: `ckptflow.formats._casts`, the float32 -> bfloat16 / float16 casts in
one pass (see its source). Optional: where no C compiler is at hand the install goes on without it and
`ckptflow.formats.casts` uses numpy, bit for bit the same, about 3x slower. Everything else is in
pyproject.toml."""

import os

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "ckptflow.formats._casts",
    ["ckptflow/formats/_casts.c"],
    extra_compile_args=[] if os.name == "nt" else ["-O3"],
    optional=True,
)])
