"""The import graph of ``server``, ``cache_backends``, ``bench`` and ``scripts``: no cycle, the server's packages
import nothing from the benchmarks or the scripts (``bench`` may import the server, never the reverse: what
``kvserve bench`` runs lives in ``server.bench_cmd``), and the planning and block-manager modules import no torch.

The graph is read from the source with :mod:`ast`, not by importing it. A module depends on

* every module it imports, wherever the import stands (a lazy import inside a function is a dependency too);
  ``from pkg import name`` is an import of the submodule ``pkg.name`` when that is a module, else of ``pkg``;
* its parent packages: Python runs ``pkg/__init__.py`` before any ``pkg.x``, so a package whose ``__init__``
  imports its own submodules is a circle with each of them.

Imports under ``if TYPE_CHECKING:`` are left out: they never run.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "cache_backends", "bench", "scripts")
SERVED = ("server", "cache_backends")  # what the package ships to serve: it imports nothing of the two below
TOOLS = ("bench", "scripts")  # the benchmarks and the repository's scripts: they may import the server

TORCH_FREE = (
    "cache_backends.kv_spec",  # what a backend stores and every byte count
    "cache_backends.estimate",  # the estimator's sums (kvserve estimate, advise)
    "cache_backends.geometry",  # a model's attention shape (ModelGeometry)
    "cache_backends.quant_formats",  # the code formats: one row a width (the declarations read it)
    "cache_backends.page_plan",  # tier planning: block tables, plans, pages a sequence needs
    "cache_backends.dca.plan",  # dca's groups of pages and its per-sequence reuse decisions
    "server.engine.step_plan",  # the scheduler's and the runner's plain step records
    "server.engine.sequence",  # a request's state in the engine
    "server.engine.request_state",  # a request's state on the HTTP side
    "server.engine.messages",  # the engine core's messages (the HTTP process reads them)
    "server.engine.block_manager",  # free list, reference counts, the prefix cache's table
    "server.engine.prefix_cache",  # block hashes
    "server.engine.scheduler",  # admission and preemption
    "server.engine.itl_budget",  # the prefill budget bounded by step cost
    "server.engine.prefill_share",  # the prefill budget shared between prefills
    "server.bench_cmd.report_cli",  # kvserve bench's flags: every `kvserve` command line builds its parser
)


def _modules() -> dict[str, Path]:
    """Every module of :data:`PACKAGES`: dotted name → file."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes that stand under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def build_graph() -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """The import graph.

    Returns:
        ``(internal, external)``: for each module, the modules of :data:`PACKAGES` it depends on, and the
        top-level names of the other packages it imports, each with the first line that does it (0: a parent
        package).
    """
    modules = _modules()
    internal: dict[str, dict[str, int]] = {m: {} for m in modules}
    external: dict[str, dict[str, int]] = {m: {} for m in modules}

    def add(src: str, dotted: str, line: int) -> None:
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):  # the longest prefix that is one of our modules
            target = ".".join(parts[:k])
            if target in modules:
                if target != src:
                    internal[src].setdefault(target, line)
                return
        external[src].setdefault(parts[0], line)

    for name, path in modules.items():
        if "." in name and name.rsplit(".", 1)[0] in modules:  # a folder without __init__.py runs nothing
            internal[name][name.rsplit(".", 1)[0]] = 0
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(name, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(name, sub if sub in modules else base, node.lineno)
    return internal, external


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    inside = set(comp)
    edges = [f"    {a} -> {b} ({'parent package' if line == 0 else f'line {line}'})"
             for a in comp for b, line in sorted(graph[a].items()) if b in inside]
    return f"  circle of {len(comp)}: {', '.join(comp)}\n" + "\n".join(edges)


def test_graph_reads_every_module():
    internal, external = build_graph()
    assert "cache_backends.paged" in internal and "server.app" in internal
    assert "torch" in external["cache_backends.paged"]  # the reader sees a module's imports
    assert "server.engine.scheduler" in internal["server.engine.engine"]  # from x import y
    assert internal["server.engine.scheduler"]["server.engine"] == 0  # a module depends on its package
    assert "server.bench_cmd.report" in internal["bench.report"]  # the benchmarks and scripts are read too
    assert "bench.budget" in internal["bench.needle"]  # a lazy import in a function
    assert "bench.quality" in internal["scripts.convert_mha2mla"]


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert "c -> a (line 3)" in _describe(graph, ["a", "b", "c"])


def test_no_import_cycle():
    internal, _ = build_graph()
    cycles = _cycles(internal)
    assert not cycles, f"import cycles in {', '.join(p + '/' for p in PACKAGES)}:\n" + "\n".join(
        _describe(internal, c) for c in cycles)


def _tool_imports(internal) -> list[str]:
    return [f"{src} -> {dst} ({'parent package' if line == 0 else f'line {line}'})"
            for src, deps in sorted(internal.items()) if src.split(".")[0] in SERVED
            for dst, line in sorted(deps.items()) if dst.split(".")[0] in TOOLS]


def test_the_server_imports_nothing_from_bench_or_scripts():
    """``server`` and ``cache_backends`` import no module of ``bench`` or ``scripts``, lazily in a function
    included: the server does not depend on its benchmarks (``kvserve bench``'s code is ``server.bench_cmd``)."""
    internal, _ = build_graph()
    found = _tool_imports(internal)
    assert not found, "the server imports the benchmarks or scripts:\n" + "\n".join(f"  {f}" for f in found)


def test_the_tool_import_check_finds_a_planted_import():
    graph = {"server.cli": {"bench.report": 74, "server": 0}, "bench.report": {"server.bench_cmd.report": 7},
             "cache_backends.x": {"scripts.make_gguf": 3}}
    assert _tool_imports(graph) == ["cache_backends.x -> scripts.make_gguf (line 3)",
                                    "server.cli -> bench.report (line 74)"]


def test_kvserve_bench_runs_without_importing_bench():
    """At run time too (an import by name, ``importlib``, would escape the graph above): ``kvserve``'s parser,
    the app and ``kvserve bench``'s run load no module of ``bench`` or ``scripts``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = ("import sys, server.cli, server.app, server.bench_cmd.report; server.cli.build_parser(); "
            "tools = sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'scripts')); "
            "assert not tools, tools")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"the server loads the benchmarks:\n{proc.stderr[-2000:]}"


@pytest.mark.parametrize("module, table", [("cache_backends.quant", {"cache_backends.quant_formats"}),
                                           ("cache_backends.attention", set()),
                                           ("cache_backends.quant_formats", set())])
def test_kernels_are_leaves(module, table):
    """The quantization and attention kernels import no backend (nothing of ours but their package's face and, for
    the quantization kernels, the code formats' table, itself a leaf)."""
    internal, _ = build_graph()
    assert set(internal[module]) == {"cache_backends"} | table, f"{module} imports {sorted(internal[module])}"


def _torch_path(internal, external, start: str) -> list[str] | None:
    """The import chain from ``start`` to a module that imports torch, or ``None`` (breadth first)."""
    parent = {start: None}
    queue = [start]
    while queue:
        m = queue.pop(0)
        if "torch" in external[m]:
            chain = [m]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for nxt in internal[m]:
            if nxt not in parent:
                parent[nxt] = m
                queue.append(nxt)
    return None


@pytest.mark.parametrize("module", TORCH_FREE)
def test_planning_imports_no_torch_statically(module):
    internal, external = build_graph()
    assert module in internal, f"{module} is not a module of {PACKAGES}"
    chain = _torch_path(internal, external, module)
    assert chain is None, f"{module} imports torch through: {' -> '.join(chain)} -> torch"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_planning_imports_no_torch_when_run(module):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = (f"import sys, {module}; heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"importing {module} loads torch:\n{proc.stderr[-2000:]}"
