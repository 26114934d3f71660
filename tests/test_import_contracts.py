"""Import contracts between the rooms of the package.

The router process holds two rooms: the data plane (pdserve/router: HTTP front, tokenizer pool,
registry and health, policies, KV index, retries, auth) and the control plane (pdserve/control:
controller, scaling policy, role switch, rollout, fleets), over the torch-free shared layer
(pdserve/common, pdserve/protocol and the server's HTTP pieces). The planner's simulators and step
costs (pdserve/planner) run the router's policies offline. None of these loads torch, the engine or
the model: the router's footprint is its imports (with torch it took ~300 MB resident, without
~100 MB; tests/router/test_router_memory_e2e.py measures the real process). Two checks: a fresh
interpreter that walks the router's real start-up path, and a static walk over every import in each
room's modules, including those inside functions, which start-up alone may not reach. Imports
between the rooms flow one way: the data plane wires the control plane in only in its app factory,
and no package imports another that imports it back."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve

PKG = Path(pdserve.__file__).parent
FORBIDDEN = ("torch", "pdserve.engine", "pdserve.model")

# What the `pdserve router` process runs: cli.main's router branch (bind_socket, create_router_app,
# run_uvicorn), a request's path through the handlers, and a tokenizer pool process's start.
_ROUTER_PATH = r"""
import json, sys
from pdserve.cli import build_parser
from pdserve.config import load_config
from pdserve.router.gateway import create_router_app
from pdserve.router import tokenizer_pool
from pdserve.server.serving import bind_socket, run_uvicorn
import pdserve.launch, pdserve.protocol, pdserve.chat_content, pdserve.server.openai_api
import pdserve.control.local_fleet, pdserve.control.k8s_fleet   # the fleets `serve` and Kubernetes give it
from pdserve import SamplingParams

build_parser().parse_args(["router", "--model", "tiny-qwen2"])
config = load_config(None, {"model.name": "tiny-qwen2", "router.encoder_workers": 0})
app = create_router_app(config)                 # loads the router's own tokenizer
tokenizer_pool._init("tiny-qwen2")              # what each pool process runs at start
assert tokenizer_pool._encode_chat([{"role": "user", "content": "hi"}])
SamplingParams(max_tokens=3).validate(100)
bad = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in %r))
print(json.dumps(bad))
""" % (FORBIDDEN,)


def test_the_router_start_up_path_loads_no_torch_engine_or_model():
    out = subprocess.run([sys.executable, "-c", _ROUTER_PATH], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"the router path imported {loaded[:10]}"


def test_the_offline_api_still_imports_from_pdserve():
    """Users import the offline API from pdserve; the names the engine and the router share live in
    pdserve.common, where both import them."""
    code = (
        "from pdserve import LLM, SamplingParams\n"
        "from pdserve.common.outputs import RequestOutput, TokenLogprob\n"
        "from pdserve.common.errors import EngineDeadError, InvalidParam, RequestFailed\n"
        "from pdserve.common.sampling import check_prompt\n"
        "from pdserve.common.detokenizer import IncrementalDetokenizer\n"
        "from pdserve.common.tokenizer import DEFAULT_MODEL, TokenizerWrapper, default_gguf_path, load_gguf_tokenizer\n"
        "from pdserve.server.serving import bind_socket, run_uvicorn\n"
        "import pdserve.common.sampling as s\n"
        "assert SamplingParams is s.SamplingParams\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


# ---------------------------------------------------------------- static import graph


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """Every module imported anywhere in `tree` (functions included), except under TYPE_CHECKING."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return  # a package's lazy names (pdserve.LLM): imported only when asked for; see LAZY
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules or full in LAZY:
                    out.add(LAZY.get(full, full))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


# `from pdserve import LLM` runs pdserve.__getattr__, which imports the engine.
LAZY = {"pdserve.LLM": "pdserve.engine.llm"}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: _imports(ast.parse(p.read_text()), set(files)) for name, p in files.items()}


def _reach(graph: dict[str, set[str]], roots: list[str]) -> dict[str, str]:
    """Each module reachable from `roots`, with the module that imports it (to print the chain)."""
    seen = {r: "" for r in roots}
    todo = list(roots)
    while todo:
        m = todo.pop()
        for dep in graph.get(m, ()):
            # `import a.b.c` runs a and a.b too: their __init__ modules count.
            for i in range(dep.count(".") + 1):
                name = ".".join(dep.split(".")[: i + 1])
                if name not in seen:
                    seen[name] = m
                    todo.append(name)
    return seen


def _chain(seen: dict[str, str], m: str) -> str:
    out = [m]
    while seen.get(out[-1]):
        out.append(seen[out[-1]])
    return " <- ".join(out)


# The torch-free rooms: each one's modules, walked with everything they import.
ROOMS = {
    "data plane": ("pdserve.router.",),
    "control plane": ("pdserve.control.",),
    "shared layer": (
        "pdserve.common.",
        "pdserve.protocol",
        "pdserve.server.openai_api",
        "pdserve.server.internal_api",
        "pdserve.server.serving",
        "pdserve.chat_content",
        "pdserve.server.errors",
        "pdserve.server.metrics",
    ),
    "planner's simulators": (
        "pdserve.planner.simulate",
        "pdserve.planner.pd_simulate",
        "pdserve.planner.step_costs",
    ),
}


@pytest.mark.parametrize("room", ROOMS)
def test_no_torch_free_room_imports_the_engine_the_model_or_torch_anywhere(room):
    graph = _graph()
    roots = sorted(m for m in graph if m.startswith(ROOMS[room]))
    assert roots, f"no module in the {room}"
    seen = _reach(graph, roots)
    bad = [_chain(seen, m) for m in sorted(seen) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"the {room} imports:\n" + "\n".join(bad)


def test_the_data_plane_wires_the_control_plane_in_only_in_its_app_factory():
    """router/gateway.py builds the router's app and installs the controller and the admin routes of
    rollouts and role switches; no other data-plane module imports the control plane, and the
    control plane names the router's classes for types only (no package cycle, below)."""
    graph = _graph()
    bad = {
        m: sorted(d for d in deps if _unit(d) == "pdserve.control")
        for m, deps in graph.items()
        if _unit(m) == "pdserve.router" and m != "pdserve.router.gateway"
    }
    assert not any(bad.values()), bad
    back = {
        m: sorted(d for d in deps if _unit(d) == "pdserve.router")
        for m, deps in graph.items()
        if _unit(m) == "pdserve.control"
    }
    assert not any(back.values()), back


def test_the_common_layer_imports_nothing_above_it():
    """pdserve.common is the bottom layer: the engine and the router import it, never the reverse."""
    graph = _graph()
    bad = {
        m: sorted(d for d in deps if d.startswith("pdserve.") and not d.startswith("pdserve.common"))
        for m, deps in graph.items()
        if m == "pdserve.common" or m.startswith("pdserve.common.")
    }
    assert not any(bad.values()), bad


def test_every_tiny_model_uses_the_default_tokenizer_name_rule():
    """The router resolves a built-in name to its tokenizer without pdserve.model: by the prefix."""
    from pdserve.common.tokenizer import DEFAULT_MODEL, TINY_PREFIX
    from pdserve.model.arch import TINY_CONFIGS
    from pdserve.model.loader import DEFAULT_MODEL as LOADER_DEFAULT

    assert DEFAULT_MODEL == LOADER_DEFAULT
    assert all(name.startswith(TINY_PREFIX) for name in TINY_CONFIGS)


def _unit(module: str) -> str | None:
    """What a module belongs to for layering: its subpackage (pdserve.engine) or, at the top, itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pdserve" and len(parts) > 1 else None


def test_no_import_cycle_between_packages():
    """Imports between pdserve's packages (and top-level modules) flow one way: a cycle shows as the
    chain of units and, for each step, a module that makes it. Imports inside functions count;
    TYPE_CHECKING ones do not (they never run)."""
    why: dict[tuple[str, str], str] = {}
    for m, deps in _graph().items():
        for d in deps:
            a, b = _unit(m), _unit(d)
            if a and b and a != b:
                why.setdefault((a, b), m)
    edges: dict[str, set[str]] = {}
    for a, b in why:
        edges.setdefault(a, set()).add(b)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v) :] + [v]
            if v not in state and (found := visit(v)):
                return found
        state[u] = 2
        stack.pop()
        return None

    for unit in sorted(edges):
        if unit not in state and (cycle := visit(unit)):
            steps = [f"{a} -> {b} (in {why[(a, b)]})" for a, b in zip(cycle, cycle[1:])]
            raise AssertionError("import cycle:\n" + "\n".join(steps))
