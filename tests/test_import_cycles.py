"""No module of flowtrain imports itself through others (docs/concepts.md, "The map").

The graph is grimp's (import-linter's own library, the graph ``lint-imports`` checks the layers
on), built from the source: every ``import`` counts, at module level, inside functions and under
``if TYPE_CHECKING:``; relative imports are resolved, and ``from package import name`` imports
the submodule ``name`` where there is one, else the package's ``__init__``. So a package whose
``__init__`` imports its submodules, and a submodule that takes a name from that ``__init__``,
are a cycle too: such a submodule imports the name from the module that defines it. Importing
``a.b`` also runs ``a/__init__.py``; that implicit step is not an edge (it would put every
module in a cycle with the package ``__init__`` that imports it), the ``__init__``'s own imports
are.
"""

from __future__ import annotations

import textwrap

import grimp
import networkx as nx


def import_graph(package: str) -> tuple[nx.DiGraph, grimp.ImportGraph]:
    imports = grimp.build_graph(package, cache_dir=None)
    graph = nx.DiGraph()
    graph.add_nodes_from(imports.modules)
    graph.add_edges_from((m, i) for m in imports.modules for i in imports.find_modules_directly_imported_by(m))
    return graph, imports


def cycles(package: str) -> list[str]:
    """One line per group of modules that import one another, each import of one cycle through
    them named with its line."""
    graph, imports = import_graph(package)
    found = []
    groups = [sorted(c) for c in nx.strongly_connected_components(graph)
              if len(c) > 1 or any(graph.has_edge(m, m) for m in c)]
    for group in sorted(groups):
        steps = []
        for a, b in nx.find_cycle(graph.subgraph(group)):
            lines = ", ".join(f"l.{d['line_number']}" for d in imports.get_import_details(importer=a, imported=b))
            steps.append(f"{a} -> {b} ({lines})")
        found.append(f"{', '.join(group)}: " + "; ".join(steps))
    return found


def test_no_module_of_flowtrain_imports_itself_through_others():
    found = cycles("flowtrain")
    assert not found, "import cycles:\n" + "\n".join(found)


def test_imports_inside_functions_and_for_types_only_count(tmp_path, monkeypatch):
    """The check sees the cycles it is there for: through an import inside a function, one
    under ``if TYPE_CHECKING:``, and a submodule taking a name from its package's ``__init__``."""
    files = {
        "__init__.py": "from .c import C\nfrom .e import E\n",
        "a.py": "def f():\n    from .b import g\n    return g\n",
        "b.py": "from . import a\n\ndef g():\n    return a\n",
        "c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .d import D\n\nclass C: ...\n",
        "d.py": "from .c import C\n\nclass D(C): ...\n",
        "e.py": "from . import C\n\nclass E(C): ...\n",
    }
    root = tmp_path / "cyclic"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = cycles("cyclic")
    assert [line.split(":")[0] for line in found] == ["cyclic, cyclic.e", "cyclic.a, cyclic.b", "cyclic.c, cyclic.d"]
    assert "cyclic.e -> cyclic (l.1)" in found[0]
    assert "cyclic.a -> cyclic.b (l.2)" in found[1] and "cyclic.c -> cyclic.d (l.4)" in found[2]
