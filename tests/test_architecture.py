"""The house rules, checked on the source: the folder tree is the architecture.

- No import circles in `ckptflow/`, counting imports inside functions and under `TYPE_CHECKING`.
- Arrows point down: cli -> steps -> formats -> plumbing -> errors. `formats` knows nothing of the
  steps, `plumbing` nothing of formats or steps, `errors` nothing at all; a step uses another step
  only through its package's public names, never its modules.
- The core never imports Prefect; shipped code (`ckptflow`, `tasks`, `flows`) never imports `tests`.
- Inside `formats`: the torch archive rooms (`formats.torch`) know nothing of DeepSpeed; the DeepSpeed
  rooms below the readers (`model`, `inspection`, `tag`, `partition`, `config`, ...) import no reader;
  a layout's reader imports the shared bases (`zero`, `zero0`, `experts`, `model_parallel`), never
  another layout's reader.
- Importing the core sets no environment variable.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "ckptflow"
STEPS = ("validate", "consolidate", "reshard", "verify", "publish", "watch")
LAYERS = {"cli": 4, **{step: 3 for step in STEPS}, "formats": 2, "plumbing": 1, "errors": 0}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def core_modules() -> dict[str, Path]:
    return {module_name(p): p for p in CORE.rglob("*.py")}


def imports_of(path: Path) -> Iterator[str]:
    """Every module `path` imports, anywhere in the file, as absolute dotted names."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`


def core_graph() -> dict[str, set[str]]:
    modules = core_modules()
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def test_the_core_has_no_import_circle() -> None:
    graph = core_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == [], "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if module.count(".") else "ckptflow"
    return top, LAYERS.get(top, 5)


def test_arrows_point_down() -> None:
    wrong = []
    for name, targets in core_graph().items():
        top, level = _layer(name)
        for target in targets:
            other, other_level = _layer(target)
            if other == top or target == "ckptflow":
                continue
            if other_level > level:
                wrong.append(f"{name} imports {target}")
            elif other_level == level == LAYERS["validate"] and target.count(".") > 1:
                wrong.append(f"{name} imports {target}, a module of another step (use its package's public names)")
    assert wrong == []


@pytest.mark.parametrize("folder", ["ckptflow", "tasks", "flows"])
def test_shipped_code_never_imports_the_tests(folder: str) -> None:
    offenders = sorted({f"{p.relative_to(REPO)}: {m}" for p in (REPO / folder).rglob("*.py")
                        for m in imports_of(p) if m == "tests" or m.startswith("tests.")})
    assert offenders == []


def test_the_core_never_imports_prefect() -> None:
    offenders = sorted({f"{p.relative_to(REPO)}: {m}" for p in CORE.rglob("*.py")
                        for m in imports_of(p) if m.split(".")[0] in ("prefect", "prefect_dask")})
    assert offenders == []


def test_importing_the_core_sets_no_environment_variable() -> None:
    names = sorted(core_modules())
    script = (
        "import importlib, json, os, sys\n"
        "before = dict(os.environ)\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "after = dict(os.environ)\n"
        "print(json.dumps(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "HF_HUB_DISABLE_XET")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


DEEPSPEED = "ckptflow.formats.deepspeed"
READERS = f"{DEEPSPEED}.readers"
READER_BASES = {f"{READERS}.{name}" for name in ("zero", "zero0", "experts", "model_parallel")}


def test_the_torch_archive_rooms_know_nothing_of_deepspeed() -> None:
    wrong = sorted(f"{name} imports {target}" for name, targets in core_graph().items()
                   if name.startswith("ckptflow.formats.torch") for target in targets
                   if target.startswith(DEEPSPEED))
    assert wrong == []


def test_readers_stand_on_the_bases_and_never_on_each_other() -> None:
    graph = core_graph()
    assert READER_BASES <= set(graph), "a reader base moved: update READER_BASES"
    leaves = {name for name in graph if name.startswith(READERS + ".") and name not in READER_BASES}
    assert {f"{READERS}.{n}" for n in ("autotp", "pipeline", "autoep", "moe")} <= leaves
    wrong = []
    for name, targets in graph.items():
        if name.startswith(DEEPSPEED + ".") and not name.startswith(READERS):
            wrong += [f"{name} imports the reader {t}" for t in targets if t.startswith(READERS + ".")]
        if name in leaves:
            wrong += [f"{name} imports the reader {t}" for t in targets if t in leaves]
    assert wrong == []
