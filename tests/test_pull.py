"""The deployments' pull step (`flows.pull`): where a worker finds the code, and the message when it cannot.
(The run-level behaviour, a process worker running `checkpoint-lifecycle/manual` from this checkout, is
in tests/test_flows.py.)"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flows.pull import CodeNotFound, code_directory, set_code_directory

REPO = Path(__file__).resolve().parents[1]


def test_without_the_variable_the_installed_checkout_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPTFLOW_CODE_DIR", raising=False)
    assert code_directory() == REPO


def test_the_variable_wins_and_the_step_changes_into_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "lifecycle.py").write_text("")
    monkeypatch.setenv("CKPTFLOW_CODE_DIR", str(tmp_path))
    monkeypatch.chdir(REPO)
    assert set_code_directory() == {"directory": str(tmp_path.resolve())}
    assert Path.cwd() == tmp_path.resolve()


def test_a_variable_naming_no_code_says_where_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFLOW_CODE_DIR", "/opt/ckptflow-nowhere")
    with pytest.raises(CodeNotFound) as caught:
        set_code_directory()
    assert str(caught.value) == (
        f"CKPTFLOW_CODE_DIR=/opt/ckptflow-nowhere on worker host {socket.gethostname()}, but "
        "/opt/ckptflow-nowhere/flows/lifecycle.py is not there: point CKPTFLOW_CODE_DIR at the ckptflow checkout "
        "(or image folder) on this machine, or unset it to use the checkout ckptflow is installed from"
    )
