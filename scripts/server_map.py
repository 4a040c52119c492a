"""The server's module map: which module of `margingate/server` imports which, read statically (ast), nothing
imported. Prints markdown: the rooms (subpackages) and the arrows between them, then one line per module with the
server modules it imports (module level or inside a function).

    python scripts/server_map.py                 # the working tree
    python scripts/server_map.py --rev 19229e1   # the tree at a commit (git show), e.g. before the split
"""
from __future__ import annotations

import argparse
import ast
import functools
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "margingate.server"


def sources(rev: str | None) -> dict[str, tuple[str, bool]]:
    """{module name: (its source, whether it is a package's __init__)} for every module under
    margingate/server, at `rev` or in the working tree."""
    folder = PACKAGE.replace(".", "/")
    if rev is None:
        paths = [p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*.py")]
        read = lambda p: (ROOT / p).read_text()  # noqa: E731
    else:
        listing = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, folder], cwd=ROOT, check=True,
                                 capture_output=True, text=True).stdout.split()
        paths = [p for p in listing if p.endswith(".py")]
        read = lambda p: subprocess.run(["git", "show", f"{rev}:{p}"], cwd=ROOT, check=True,  # noqa: E731
                                        capture_output=True, text=True).stdout
    return {module_name(p): (read(p), p.endswith("/__init__.py")) for p in sorted(paths)}


def module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(name: str, source: str, is_package: bool, known: set[str]) -> set[str]:
    """The server modules `source` imports: `from .x import y` -> x (or x.y where y is a module), relative
    imports resolved against `name`."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = (".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                      if node.level else node.module or "")
            modules = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}
            found |= modules
            if len(modules) < len(node.names):  # names defined in the package (or module) itself
                found.add(target)
    return {t for t in found if t in known and t != name and not name.startswith(t + ".")}


def room_of(module: str, packages: set[str]) -> str:
    """The subpackage a module lives in (`api`, `core`, ...; a subpackage's __init__ too), or `top` for the
    top level."""
    rest = [p for p in module.removeprefix(PACKAGE).split(".") if p]
    return rest[0] if len(rest) > 1 or (rest and module in packages) else "top"


def short(module: str) -> str:
    return "__init__" if module == PACKAGE else module.removeprefix(PACKAGE + ".")


def render(srcs: dict[str, tuple[str, bool]]) -> str:
    known, packages = set(srcs), {m for m, (_, package) in srcs.items() if package}
    edges = {m: imports(m, s, package, known) for m, (s, package) in srcs.items()}
    room = functools.partial(room_of, packages=packages)
    rooms: dict[tuple[str, str], int] = defaultdict(int)
    for m, targets in edges.items():
        for t in targets:
            if room(m) != room(t):
                rooms[room(m), room(t)] += 1
    names = sorted({room(m) for m in srcs})
    lines = [f"{len(srcs)} modules in {len(names)} room(s): " + ", ".join(
        f"`{r}` ({sum(room(m) == r for m in srcs)})" for r in names), ""]
    if rooms:
        lines += ["| from room | imports room | imports |", "|---|---|---|"]
        lines += [f"| `{a}` | `{b}` | {n} |" for (a, b), n in sorted(rooms.items())]
        lines.append("")
    lines += ["| module | imports (server modules) |", "|---|---|"]
    for m in sorted(srcs, key=lambda m: (room(m), m)):
        lines.append(f"| `{short(m)}` | {', '.join(f'`{short(t)}`' for t in sorted(edges[m])) or '-'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default=None, help="a git commit (default: the working tree)")
    args = p.parse_args()
    print(render(sources(args.rev)))


if __name__ == "__main__":
    main()
