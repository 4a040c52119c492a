"""docs/architecture.md's table is the rule: every package under margingate/ has a row, each of its imports
(module level or inside a function) points at a package its row allows, and the packages import one
another without a circle. Read statically (ast), so nothing is imported to check it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "margingate"
ROW = re.compile(r"^\| `(margingate[\w.]*)` \| (\d+) \| (.*) \|$")


def table() -> dict[str, set[str]]:
    """{package: the packages it may import} from docs/architecture.md."""
    rules = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        m = ROW.match(line.strip())
        if m:
            rules[m[1]] = set(re.findall(r"`(margingate[\w.]*)`", m[3]))
    return rules


def package_of(module: str) -> str:
    """margingate.engine.runner -> margingate.engine; margingate.llm -> margingate.llm."""
    parts = module.split(".")
    return ".".join(parts[:2])


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The margingate modules `path` imports, relative imports resolved."""
    name = module_name(path)
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "margingate"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "margingate":
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names if target == "margingate"}
    return found


def graph() -> dict[str, set[str]]:
    """{package: the other packages its modules import}."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = package_of(module_name(path))
        edges.setdefault(source, set())
        edges[source] |= {package_of(t) for t in imports(path)} - {source}
    return edges


def violations(rules: dict[str, set[str]], edges: dict[str, set[str]]) -> list[str]:
    missing = [f"{p} has no row in docs/architecture.md" for p in sorted(edges) if p not in rules]
    wrong = [f"{p} imports {t}, which its row does not allow" for p in sorted(edges) if p in rules
             for t in sorted(edges[p]) if t not in rules[p] and t != "margingate"]
    stale = [f"docs/architecture.md lists {p}, which does not exist" for p in sorted(rules) if p not in edges]
    return missing + wrong + stale


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every package on an import circle, as a path back to itself (depth first)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"
    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_every_package_follows_its_row():
    assert violations(table(), graph()) == []


def test_no_import_circle_between_packages():
    edges = {p: {t for t in ts if t != "margingate"} for p, ts in graph().items()}
    assert cycles(edges) == []


def test_a_wrong_way_import_is_caught():
    """The check itself: a planted import of the server from the kernels, and a package with no row."""
    edges = graph()
    planted = {**edges, "margingate.kernels": edges["margingate.kernels"] | {"margingate.server"},
               "margingate.newcomer": set()}
    found = violations(table(), planted)
    assert "margingate.kernels imports margingate.server, which its row does not allow" in found
    assert "margingate.newcomer has no row in docs/architecture.md" in found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


# --- attribute reach-through: the server reads what it serves from its serving context ----------------------

SERVER = PACKAGE / "server"
THROUGH_ENGINE = re.compile(r"\w+\.\w+\.engine\.\w+")  # two objects deep to the engine, then into its parts


def dotted(node: ast.Attribute) -> str | None:
    """`state.context.engine.draft` for that expression (None: the chain starts at a call or a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def reach_throughs(source: str, name: str) -> list[str]:
    """Where `source` names the facade (`llm`: a name, an argument or an attribute) or reaches through two
    objects into the engine's parts (`state.llm.engine.draft`, `state.context.engine.grammars`)."""
    tree = ast.parse(source, name)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.arg)) and (getattr(node, "id", None) or getattr(node, "arg", None)) == "llm":
            found.append(f"{name}:{node.lineno} names the facade (llm)")
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = dotted(node)
            if chain and ("llm" in chain.split(".")[1:] or THROUGH_ENGINE.search(chain)):
                found.append(f"{name}:{node.lineno} reaches through: {chain}")
    return found


def test_the_server_reaches_neither_the_facade_nor_into_the_engine():
    """What it serves comes from `serving_context.ServingContext` (built from the facade below the server)."""
    found = [f for path in sorted(SERVER.rglob("*.py")) for f in reach_throughs(path.read_text(), path.name)]
    assert found == []


def test_a_reach_through_is_caught():
    planted = "def f(state, llm):\n    a = state.llm.engine.draft\n    b = state.context.engine.grammars.compile(x)\n" \
              "    c = state.engine.load.blocks_free\n    d = state.context.draft\n"
    assert reach_throughs(planted, "p.py") == ["p.py:1 names the facade (llm)",
                                               "p.py:2 reaches through: state.llm.engine.draft",
                                               "p.py:3 reaches through: state.context.engine.grammars.compile"]


# --- the server's rooms: top -> api -> core -> parsers, protocol ---------------------------------------------

#: each room of margingate/server and the rooms it may import ("top": the modules at the top, app.py, routes.py, ...)
SERVER_ROOMS = {"top": {"api", "core", "parsers", "protocol"}, "api": {"core", "parsers", "protocol"},
                "core": {"parsers", "protocol"}, "parsers": set(), "protocol": set()}


def server_room(module: str) -> str:
    """margingate.server.core.jobs -> core; margingate.server.app (or the package itself) -> top."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in SERVER_ROOMS else "top"


def server_arrows() -> dict[str, set[str]]:
    """{server module: the server modules it imports}."""
    return {module_name(p): {t for t in imports(p) if t.startswith("margingate.server")} for p in SERVER.rglob("*.py")}


def room_violations(arrows: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({server_room(m)}) imports {t} ({server_room(t)})" for m in sorted(arrows)
            for t in sorted(arrows[m]) if server_room(t) != server_room(m)
            and server_room(t) not in SERVER_ROOMS[server_room(m)]]


def test_the_server_rooms_point_one_way():
    arrows = server_arrows()
    assert {server_room(m) for m in arrows} == set(SERVER_ROOMS)  # every room exists
    assert all(p.parent == SERVER or p.parent.parent == SERVER for p in SERVER.rglob("*.py"))  # one level of rooms
    assert room_violations(arrows) == []


def test_an_upward_room_import_is_caught():
    planted = {**server_arrows(), "margingate.server.core.jobs": {"margingate.server.api.chat"}}
    assert room_violations(planted) == ["margingate.server.core.jobs (core) imports margingate.server.api.chat (api)"]
