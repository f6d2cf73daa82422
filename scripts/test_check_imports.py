#!/usr/bin/env python3
"""Tests of check-imports.py on small fake workspaces in a temporary
directory: circles it must find, and trees it must pass.

Run: python3 scripts/test_check_imports.py
"""

import io
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "check-imports.py"


def workspace(files: dict[str, str]) -> tempfile.TemporaryDirectory:
    """A workspace of one crate `a` holding `files` (paths under a/src)."""
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    (root / "Cargo.toml").write_text('[workspace]\nmembers = ["a"]\n')
    (root / "a").mkdir()
    (root / "a/Cargo.toml").write_text('[package]\nname = "a"\nversion = "0.1.0"\n')
    for rel, text in files.items():
        path = root / "a/src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp


def run(files: dict[str, str]) -> tuple[int, str]:
    """Exit status and stdout of the script on a workspace of `files`."""
    with workspace(files) as root:
        p = subprocess.run(
            [sys.executable, str(SCRIPT), root], capture_output=True, text=True, check=False
        )
        return p.returncode, p.stdout


class CheckImports(unittest.TestCase):
    def test_two_files_importing_each_other_are_a_circle(self):
        code, out = run(
            {
                "lib.rs": "mod x;\nmod y;\n",
                "x.rs": "use crate::y::Y;\npub struct X;\n",
                "y.rs": "pub struct Y;\nfn f() -> crate::x::X { crate::x::X }\n",
            }
        )
        self.assertEqual(code, 1, out)
        self.assertIn("a/src/x.rs", out)
        self.assertIn("a/src/y.rs", out)

    def test_a_circle_of_three_through_super_and_a_child_name(self):
        code, out = run(
            {
                "lib.rs": "mod core;\n",
                # mod.rs names its child `fault` (an edge), fault.rs names
                # `super::Error`, defined in mod.rs (an edge back).
                "core/mod.rs": "mod fault;\nmod vm;\npub struct Error;\n"
                "fn f() { fault::serve(); }\n",
                "core/fault.rs": "use super::vm::Vm;\npub fn serve() {}\n",
                "core/vm.rs": "pub struct Vm(super::Error);\n",
            }
        )
        self.assertEqual(code, 1, out)
        for f in ("core/mod.rs", "core/fault.rs", "core/vm.rs"):
            self.assertIn(f"a/src/{f}", out)

    def test_one_way_imports_pass(self):
        code, out = run(
            {
                # The root re-exports its children and they use each other
                # one way; a `mod x;` declaration alone is no edge back.
                "lib.rs": "mod x;\nmod y;\npub use x::X;\npub use y::{self, Y};\n",
                "x.rs": "use crate::y::Y;\npub struct X(Y);\n",
                "y.rs": """\
                    //! Mentions crate::x::X in a comment only.
                    pub struct Y;
                    const S: &str = "crate::x::X";
                    /* nested /* crate::x::X */ comment */
                    fn c() -> char { '"' }
                    fn l<'a>(s: &'a str) -> &'a str { s }
                    #[cfg(test)]
                    mod tests {
                        use super::*;
                        use crate::x::X;
                        fn g() -> X { crate::x::X(Y) }
                    }
                """,
            }
        )
        self.assertEqual((code, out), (0, ""))

    def test_a_use_of_the_root_from_a_child_it_reexports_is_a_circle(self):
        code, out = run(
            {
                "lib.rs": "pub mod op;\npub use op::Op;\npub const PAGE: u64 = 4096;\n",
                "op.rs": "pub struct Op;\nfn f() -> u64 { crate::PAGE }\n",
            }
        )
        self.assertEqual(code, 1, out)
        self.assertIn("a/src/lib.rs", out)

    def test_a_path_resolves_to_the_deepest_file(self):
        # crate::m::n::N is m/n.rs, not m/mod.rs: no circle with m/mod.rs.
        code, out = run(
            {
                "lib.rs": "mod m;\nmod z;\n",
                "m/mod.rs": "pub mod n;\nuse crate::z::Z;\n",
                "m/n.rs": "pub struct N;\n",
                "z.rs": "pub struct Z(crate::m::n::N);\n",
            }
        )
        self.assertEqual((code, out), (0, ""))

    def test_an_alias_bound_by_use_is_followed(self):
        code, out = run(
            {
                "lib.rs": "mod a;\nmod b;\n",
                "a.rs": "use crate::b as other;\npub struct A;\n",
                "b.rs": "use crate::a;\nfn f() -> a::A { a::A }\n",
            }
        )
        self.assertEqual(code, 1, out)

    def test_check_returns_the_number_of_circles(self):
        mod = load()
        with workspace({"lib.rs": "mod x;\n", "x.rs": "pub struct X;\n"}) as root:
            self.assertEqual(mod.check(Path(root), out=io.StringIO()), 0)


def load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = mod
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    unittest.main()
