"""The package's layers (docs/architecture.md) point one way: every import of an hf_csa2 module,
at the top of a file or inside a function, goes to the same package or a lower layer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_csa2"

LAYERS = {
    "kernels": 0, "errors": 0, "cache": 0, "typed_config": 0,
    "model": 1,
    "io": 2, "data": 2, "metrics": 2, "formats": 2,
    "engine": 3,
    "surgery": 4,
    "evals": 5, "export": 5, "train": 5,
    "publish": 6,
    "cli": 7, "__main__": 7, "__init__": 7,
}
# function-level imports of our own modules that are there for another reason than a cycle
ALLOWED_LOCAL_IMPORTS = {
    ("data/__init__.py", "hf_csa2.data"),
    # the model files are copied next to weights, where hf_csa2 may be absent: the kernel path imports on use
    ("model/sparse_attention.py", "hf_csa2.kernels"),
    ("model/sparse_attention.py", "hf_csa2.kernels.sparse_read"),
    ("model/indexer.py", "hf_csa2.kernels.indexer"),
    ("model/sink_attention.py", "hf_csa2.kernels"),
    ("model/sink_attention.py", "hf_csa2.kernels.decode"),
    # Triton is imported on first use only, so hf_csa2.kernels imports without it
    ("kernels/sparse_read/op.py", "hf_csa2.kernels.sparse_read"),
    ("kernels/indexer/op.py", "hf_csa2.kernels.indexer"),
    ("kernels/decode/op.py", "hf_csa2.kernels.decode"),
}
ROOT = {"cli", "__main__", "__init__"}  # the top layer: one unit


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def dotted(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path):
    """(target module, inside a function?) for every import of an hf_csa2 module in ``path``."""
    tree = ast.parse(path.read_text())
    here = dotted(path).split(".")
    is_init = path.name == "__init__.py"
    functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_init else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
        elif isinstance(node, ast.Import):
            target = node.names[0].name
        else:
            continue
        if target == "hf_csa2" or target.startswith("hf_csa2."):
            yield target, id(node) in functions


def test_every_module_has_a_layer():
    assert {package_of(p) for p in modules()} <= set(LAYERS)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    source = package_of(path)
    for target, local in imports(path):
        parts = target.split(".")
        dest = parts[1] if len(parts) > 1 else "__init__"
        assert dest in LAYERS, target
        if dest != source and not {dest, source} <= ROOT:
            assert LAYERS[dest] < LAYERS[source], f"{path.relative_to(PACKAGE)} imports {target} (layer {LAYERS[dest]} >= {LAYERS[source]})"
        if local:
            assert (str(path.relative_to(PACKAGE)), target) in ALLOWED_LOCAL_IMPORTS, \
                f"{path.relative_to(PACKAGE)} imports {target} inside a function"


def optional_imports(tree) -> set[int]:
    """Import nodes inside a ``try`` that catches ImportError: they may fail and are handled."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError"
                                             for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return guarded


def test_model_package_is_self_contained():
    """Copied next to checkpoints: it may import only torch, transformers and itself; the Triton
    kernels of hf_csa2 and fla-core's only optionally (inside a try that handles ImportError)."""
    for path in (PACKAGE / "model").glob("*.py"):
        tree = ast.parse(path.read_text())
        optional = optional_imports(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "fla":
                assert id(node) in optional, (path.name, node.module, "import fla-core only optionally")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith("hf_csa2.kernels"):
                assert id(node) in optional, (path.name, node.module, "import hf_csa2.kernels only optionally")
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in {"torch", "transformers", "__future__", "math", "copy", "typing",
                                                     "dataclasses", "collections"}, (path.name, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1, (path.name, node.module)


def test_every_module_imports_in_either_order():
    """Every module in one fresh process, top layers first, then bottom first: an import cycle
    breaks at least one of the two orders."""
    names = sorted((dotted(p) for p in modules() if p.name != "__main__.py"),
                   key=lambda n: -LAYERS.get(n.split(".")[1] if "." in n else "__init__", 4))
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    for order in (names, names[::-1]):
        proc = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, timeout=300,
                              cwd=PACKAGE.parent)
        assert proc.returncode == 0, proc.stderr[-3000:]
