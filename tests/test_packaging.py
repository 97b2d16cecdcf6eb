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
    for extra in ("gcs", "s3", "verify", "prefect", "all", "demo", "test", "cluster"):
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


def test_prefect_extra_installs_beside_prefect_3_9() -> None:
    """The prefect extra admits the current Prefect 3.9 and whatever SQLAlchemy and fastapi it resolves:
    3.9's scheduler runs on SQLAlchemy 2.1 and 3.9 caps fastapi itself. prefect 3.8 is left out (its
    scheduler creates no run under SQLAlchemy 2.1, and capping SQLAlchemy would move a 3.9 install)."""
    prefect = _by_extra()["prefect"]
    assert prefect["prefect"].specifier.contains("3.9.1") and prefect["prefect"].specifier.contains("3.9.0")
    assert not prefect["prefect"].specifier.contains("3.8.8")
    assert "sqlalchemy" not in prefect and "fastapi" not in prefect, sorted(prefect)


def test_no_upper_bound_without_a_reason() -> None:
    """Every upper bound in the extras is one of the two that are explained in pyproject.toml: Prefect's
    next major release and DeepSpeed 0.20 for the demo and test writers."""
    capped = sorted(
        f"[{extra}] {req.name}{req.specifier}" for extra, reqs in _by_extra().items() for req in reqs.values()
        if any(s.operator in ("<", "<=", "~=") for s in req.specifier)
    )
    assert capped == ["[demo] deepspeed<0.20,>=0.19.8", "[prefect] prefect<4,>=3.9"], capped


def test_this_machine_pins_live_in_constraints_txt() -> None:
    pins = {}
    for line in REPO_CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name.lower().replace("_", "-")] = str(req.specifier)
    assert pins["torch"] == "==2.13.0" and pins["deepspeed"] == "==0.19.8"
    assert all(spec.startswith("==") for spec in pins.values()), pins
    assert {"prefect", "huggingface-hub", "hf-xet", "transformers", "safetensors", "fsspec", "gcsfs", "s3fs",
            "dask", "distributed", "prefect-dask"} <= set(pins)
