#!/usr/bin/env python3
"""Find files that import each other, directly or in a circle, in every
crate of the workspace; print each circle with its files and exit 1 if
there is one.

For every crate root (a package's src/lib.rs, src/main.rs, src/bin/*.rs,
tests/*.rs, benches/*.rs, examples/*.rs, build.rs and the paths its
Cargo.toml names) the script walks the `mod x;` tree to map module paths to
files, then draws an edge A -> B when file A names a path into file B:

- `use` declarations (nested `{...}` trees, `self`, globs, `as` aliases);
- paths in code: `crate::a::B`, `super::B`, `self::a::B`, a child module's
  name (`engine::reserve`) and a name a `use` bound to a module
  (`use super::index; index::Snap`).

A path resolves to the deepest module on it that is a file:
`crate::core::vm::Vm` is core/vm.rs; `super::Error` from core/fault.rs is
core/mod.rs, where `Error` is defined or re-exported. A parent's `mod x;`
declaration alone is no edge. Comments, string literals and
`#[cfg(test)] mod ...` (inline or a file) are ignored: a test module may
`use super::*`.

Usage: check-imports.py [WORKSPACE_DIR]   (default: the repository root)
Python 3.11+, standard library only.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


# ---------------------------------------------------------------- lexing


def strip(src: str) -> str:
    """`src` with comments blanked and string/char literal contents blanked
    (quotes kept), every newline kept so offsets and lines stay valid."""
    out = list(src)
    n = len(src)
    i = 0

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif (m := re.compile(r'(?:b|c|br|cr)?r(#*)"').match(src, i)) and (
            i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")
        ):
            close = '"' + m.group(1)
            j = src.find(close, m.end())
            j = n if j < 0 else j
            blank(m.end(), j)
            i = j + len(close)
        elif c == '"' or (
            c in "bc"
            and src.startswith('"', i + 1)
            and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_"))
        ):
            start = i + (1 if c == '"' else 2)
            j = start
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            blank(start, j)
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\'', '\u{..}') or a lifetime ('a).
            m = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F_]*\}|x..|.)|[^\\'\n])'").match(src, i)
            if m:
                blank(i + 1, m.end() - 1)
                i = m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def matching_brace(text: str, open_at: int) -> int:
    """Offset just past the `}` closing the `{` at `open_at`."""
    depth = 0
    for k in range(open_at, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return len(text)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# ------------------------------------------------------------ module tree

ATTRS = r"((?:\s*#\s*\[[^\]]*\])*)"
VIS = r"(?:pub\s*(?:\([^)]*\))?\s*)?"
MOD_RE = re.compile(ATTRS + r"\s*" + VIS + r"\bmod\s+(" + IDENT + r")\s*([;{])")
CFG_TEST_RE = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")
PATH_ATTR_RE = re.compile(r'#\s*\[\s*path\s*=\s*"([^"]*)"\s*\]')


@dataclass
class InlineMod:
    path: tuple[str, ...]
    start: int
    end: int


@dataclass
class SourceFile:
    path: Path
    module: tuple[str, ...]
    raw: str
    text: str  # stripped, with #[cfg(test)] modules blanked
    inline: list[InlineMod] = field(default_factory=list)


@dataclass
class Crate:
    name: str
    root: Path
    files: dict[Path, SourceFile] = field(default_factory=dict)
    # module path -> file holding it (inline modules map to their file)
    modules: dict[tuple[str, ...], Path] = field(default_factory=dict)


def child_dir(file: Path, is_root: bool) -> Path:
    """The directory a file's `mod x;` children live in."""
    if is_root or file.name == "mod.rs":
        return file.parent
    return file.parent / file.stem


def load_module(crate: Crate, file: Path, module: tuple[str, ...], is_root: bool) -> None:
    if file in crate.files or not file.is_file():
        return
    raw = file.read_text(encoding="utf-8", errors="replace")
    text = strip(raw)
    sf = SourceFile(file, module, raw, text)
    crate.files[file] = sf
    crate.modules[module] = file

    # Blank #[cfg(test)] modules (inline bodies, file declarations).
    chars = list(text)
    for m in MOD_RE.finditer(text):
        if CFG_TEST_RE.search(m.group(1)):
            end = matching_brace(text, m.end() - 1) if m.group(3) == "{" else m.end()
            for k in range(m.start(), end):
                if chars[k] != "\n":
                    chars[k] = " "
    sf.text = text = "".join(chars)

    # Inline modules: their ranges and their `mod x;` children.
    opened = [
        (m.group(2), m.end() - 1, matching_brace(text, m.end() - 1))
        for m in MOD_RE.finditer(text)
        if m.group(3) == "{"
    ]
    for name, start, end in opened:
        # Nested inline modules get the names of those around them.
        outer = tuple(o[0] for o in opened if o[1] < start and end <= o[2])
        sf.inline.append(InlineMod(outer + (name,), start, end))
    spans = sf.inline
    for s in spans:
        crate.modules[module + s.path] = file

    base = child_dir(file, is_root)
    for m in MOD_RE.finditer(text):
        if m.group(3) != ";":
            continue
        name = m.group(2)
        rel = ()
        for s in sf.inline:
            if s.start < m.start() < s.end and len(s.path) > len(rel):
                rel = s.path
        attr = PATH_ATTR_RE.search(raw[m.start() : m.start() + len(m.group(1))])
        d = base.joinpath(*rel)
        if attr:
            target = (file.parent.joinpath(*rel) / attr.group(1)).resolve()
        elif (d / f"{name}.rs").is_file():
            target = d / f"{name}.rs"
        else:
            target = d / name / "mod.rs"
        load_module(crate, target, module + rel + (name,), False)


# ------------------------------------------------------------------ paths

USE_RE = re.compile(r"(?<![A-Za-z0-9_])use\s+([^;]*);")
PATH_RE = re.compile(
    r"(?<![A-Za-z0-9_$:])(" + IDENT + r")((?:\s*::\s*(?:" + IDENT + r"|\*|\{))+)"
)


def use_tree(tree: str) -> list[tuple[list[str], str | None]]:
    """Expand a `use` tree into (path segments, bound name) pairs; the bound
    name is None for a glob."""
    toks = re.findall(IDENT + r"|::|[{},*]", tree)
    pos = 0
    out: list[tuple[list[str], str | None]] = []

    def peek() -> str | None:
        return toks[pos] if pos < len(toks) else None

    def one(prefix: list[str]) -> None:
        nonlocal pos
        segs = list(prefix)
        while True:
            t = peek()
            if t == "{":
                pos += 1
                while peek() not in (None, "}"):
                    start = pos
                    one(segs)
                    if peek() == ",":
                        pos += 1
                    if pos == start:
                        pos += 1
                pos += 1
                return
            if t == "*":
                pos += 1
                out.append((segs, None))
                return
            if t is None or not re.fullmatch(IDENT, t):
                return
            pos += 1
            if not (t == "self" and segs):
                segs.append(t)
            if peek() == "::":
                pos += 1
                continue
            bound = segs[-1] if segs else None
            if peek() == "as":
                pos += 1
                bound = peek()
                pos += 1
            out.append((segs, bound))
            return

    while pos < len(toks):
        start = pos
        one([])
        if peek() == ",":
            pos += 1
        if pos == start:
            pos += 1
    return out


def module_at(sf: SourceFile, offset: int) -> tuple[str, ...]:
    rel: tuple[str, ...] = ()
    for s in sf.inline:
        if s.start < offset < s.end and len(s.path) > len(rel):
            rel = s.path
    return sf.module + rel


def walk(
    crate: Crate,
    here: tuple[str, ...],
    segs: list[str],
    aliases: dict[str, tuple[str, ...]],
) -> tuple[tuple[str, ...] | None, bool]:
    """The deepest module of this crate that `segs`, seen from module
    `here`, runs through (None when the path leaves the crate), and whether
    every segment was a module."""
    head, rest = segs[0], segs[1:]
    if head == "crate":
        mod: tuple[str, ...] = ()
    elif head == "self":
        mod = here
    elif head == "super":
        mod = here[:-1]
        while rest and rest[0] == "super":
            mod, rest = mod[:-1], rest[1:]
    elif here + (head,) in crate.modules:
        mod = here + (head,)
    elif head in aliases:
        mod = aliases[head]
    else:
        return None, False
    for s in rest:
        if mod + (s,) not in crate.modules:
            return mod, False
        mod = mod + (s,)
    return mod, True


def resolve(
    crate: Crate,
    here: tuple[str, ...],
    segs: list[str],
    aliases: dict[str, tuple[str, ...]],
) -> Path | None:
    """The file of the deepest module named by `segs` seen from module
    `here`, or None when the path leaves the crate."""
    mod, _ = walk(crate, here, segs, aliases) if segs else (None, False)
    return None if mod is None else crate.modules.get(mod)


@dataclass
class Edge:
    src: Path
    dst: Path
    line: int
    what: str


def file_edges(crate: Crate, sf: SourceFile) -> list[Edge]:
    edges: list[Edge] = []
    text = sf.text
    # Names `use` binds to modules of this crate, per module scope.
    aliases: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = {}
    uses = list(USE_RE.finditer(text))
    use_spans = [(m.start(), m.end()) for m in uses]
    # Two passes so `use a; use a::b;` resolves in any order.
    for _ in range(2):
        for m in uses:
            here = module_at(sf, m.start())
            scope = aliases.setdefault(here, {})
            for segs, bound in use_tree(m.group(1)):
                if not segs or bound is None:
                    continue
                mod, exact = walk(crate, here, segs, scope)
                if mod is not None and exact:
                    scope[bound] = mod
    for m in uses:
        here = module_at(sf, m.start())
        scope = aliases.get(here, {})
        for segs, _ in use_tree(m.group(1)):
            target = resolve(crate, here, segs, scope)
            if target is not None and target != sf.path:
                edges.append(Edge(sf.path, target, line_of(text, m.start()), "use " + "::".join(segs)))
    for m in PATH_RE.finditer(text):
        if any(a <= m.start() < b for a, b in use_spans):
            continue
        tail = re.sub(r"\s+", "", m.group(2)).rstrip(":{*")
        segs = [m.group(1)] + [x for x in tail.split("::") if x and x not in "{*"]
        here = module_at(sf, m.start())
        target = resolve(crate, here, segs, aliases.get(here, {}))
        if target is not None and target != sf.path:
            edges.append(Edge(sf.path, target, line_of(text, m.start()), "::".join(segs)))
    return edges


# ----------------------------------------------------------------- cycles


def strongly_connected(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    out: list[list[Path]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        # Iterative Tarjan.
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def shortest_cycle(graph: dict[Path, set[Path]], comp: list[Path]) -> list[Path]:
    """One shortest circle through the component's first file."""
    members = set(comp)
    start = comp[0]
    prev: dict[Path, Path] = {}
    queue = [start]
    seen = {start}
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if nxt not in seen:
                seen.add(nxt)
                prev[nxt] = node
                queue.append(nxt)
    return [start]


# -------------------------------------------------------------- workspace


def crate_roots(pkg: Path) -> list[tuple[str, Path]]:
    roots: list[Path] = []
    for p in ("src/lib.rs", "src/main.rs", "build.rs"):
        roots.append(pkg / p)
    for d in ("src/bin", "tests", "benches", "examples"):
        dirp = pkg / d
        if dirp.is_dir():
            roots.extend(sorted(dirp.glob("*.rs")))
            roots.extend(sorted(dirp.glob("*/main.rs")))
    manifest = tomllib.loads((pkg / "Cargo.toml").read_text())
    for key in ("lib", "bin", "test", "bench", "example"):
        entries = manifest.get(key, [])
        for e in [entries] if isinstance(entries, dict) else entries:
            if "path" in e:
                roots.append(pkg / e["path"])
    seen: set[Path] = set()
    out = []
    for r in roots:
        r = r.resolve()
        if r.is_file() and r not in seen:
            seen.add(r)
            out.append((r.relative_to(pkg.resolve()).as_posix(), r))
    return out


def workspace_packages(root: Path) -> list[Path]:
    manifest = tomllib.loads((root / "Cargo.toml").read_text())
    ws = manifest.get("workspace")
    if ws is None:
        return [root]
    pkgs = []
    for member in ws.get("members", []):
        pkgs.extend(sorted(p for p in root.glob(member) if (p / "Cargo.toml").is_file()))
    if "package" in manifest:
        pkgs.insert(0, root)
    return pkgs


def check(root: Path, out=sys.stdout) -> int:
    """Print every circle under the workspace at `root`; return how many."""
    root = root.resolve()
    found = 0
    for pkg in workspace_packages(root):
        for label, file in crate_roots(pkg):
            crate = Crate(f"{pkg.relative_to(root).as_posix() or '.'}:{label}", file)
            load_module(crate, file, (), True)
            graph: dict[Path, set[Path]] = {f: set() for f in crate.files}
            edges: dict[tuple[Path, Path], Edge] = {}
            for sf in crate.files.values():
                for e in file_edges(crate, sf):
                    graph[e.src].add(e.dst)
                    edges.setdefault((e.src, e.dst), e)
            for comp in strongly_connected(graph):
                found += 1
                rel = lambda p: p.relative_to(root).as_posix()  # noqa: E731
                cyc = shortest_cycle(graph, comp)
                print(f"circle in {crate.name}: {len(comp)} files", file=out)
                print("  " + " -> ".join(rel(p) for p in cyc), file=out)
                for a in comp:
                    for b in sorted(graph[a]):
                        if b in comp:
                            e = edges[(a, b)]
                            print(f"    {rel(a)}:{e.line} -> {rel(b)}  ({e.what})", file=out)
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    n = check(root)
    if n:
        print(f"{n} import circle(s): no two files may import each other", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
