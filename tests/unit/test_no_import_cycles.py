"""No module of pyproxy imports, directly or through others, a module that imports it: an import circle makes
import order matter and pushes imports into functions (clock.py and loader.py had one, over BpfUnavailable). The
layering contracts (pyproject.toml, lint-imports) hold between packages; this holds between modules."""

from __future__ import annotations

import grimp


def test_no_module_of_pyproxy_is_on_an_import_circle() -> None:
    graph = grimp.build_graph("pyproxy")
    circles = sorted({" -> ".join(graph.find_shortest_chain(importer=imported, imported=module) or ())
                      + f" -> {imported}"
                      for module in graph.modules for imported in graph.find_modules_directly_imported_by(module)
                      if graph.chain_exists(importer=imported, imported=module)})
    assert not circles, "import circles:\n" + "\n".join(circles)
