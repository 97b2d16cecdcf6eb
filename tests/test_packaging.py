"""What `pip install ckptflow` asks for: a base set that fits into a training environment, extras for
the rest, and the pins of this machine only in `constraints.txt` (which `make install` passes to pip).

Read from the installed distribution's metadata, as pip sees it."""

from __future__ import annotations

from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

REPO_CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def _requirements() -> list[Requirement]:
    found = requires("ckptflow")
    assert found, "ckptflow is not installed (make install)"
    return [Requirement(line) for line in found]


def _extra(req: Requirement) -> str | None:
    """The extra a requirement belongs to, or None for the base set."""
    if req.marker is None:
        return None
    for extra in ("gcs", "s3", "verify", "prefect", "all", "demo", "test"):
        if req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            return extra
    return None


def _by_extra() -> dict[str | None, dict[str, Requirement]]:
    groups: dict[str | None, dict[str, Requirement]] = {}
    for req in _requirements():
        groups.setdefault(_extra(req), {})[req.name.lower().replace("_", "-")] = req
    return groups


def test_base_requirements_leave_torch_and_deepspeed_to_the_environment() -> None:
    base = _by_extra()[None]
    assert "torch" not in base and "deepspeed" not in base, sorted(base)
    pinned = [str(r) for r in base.values() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == [], f"exact pins in the base requirements: {pinned}"
    assert {"safetensors", "fsspec", "huggingface-hub", "hf-xet", "numpy"} <= set(base)
    assert "prefect" not in base, "the core and its CLI run without Prefect"


def test_extras_carry_ranges_not_pins() -> None:
    groups = _by_extra()
    for extra, reqs in groups.items():
        for req in reqs.values():
            if req.name == "ckptflow":
                continue
            assert not any(s.operator in ("==", "===") for s in req.specifier), f"[{extra}] pins {req}"
    assert {"torch", "transformers"} <= set(groups["verify"])
    assert "gcsfs" in groups["gcs"] and "s3fs" in groups["s3"]
    assert "deepspeed" in groups["demo"]


def test_prefect_extra_keeps_sqlalchemy_below_2_1() -> None:
    """prefect 3.8's scheduler creates no run under SQLAlchemy 2.1 (`Can't evaluate bulk DML statement`)."""
    prefect = _by_extra()["prefect"]
    sqlalchemy = prefect["sqlalchemy"]
    assert not sqlalchemy.specifier.contains("2.1.0") and sqlalchemy.specifier.contains("2.0.40")
    assert prefect["prefect"].specifier.contains("3.8.8")


def test_this_machine_pins_live_in_constraints_txt() -> None:
    pins = {}
    for line in REPO_CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name.lower()] = str(req.specifier)
    assert pins["torch"] == "==2.13.0" and pins["deepspeed"] == "==0.19.8"
    assert pins["sqlalchemy"] == "<2.1"
