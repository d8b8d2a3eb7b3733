"""The shape of the test suite itself: test modules share helpers through non-test modules
(tests/models.py, tests/families.py, tests/tp_harness.py ...), never by importing each other, and
the registry of test families (tests/families.py) is consistent with itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from families import FAMILIES, QUANT_BOUNDS, families, family

TESTS = Path(__file__).resolve().parent


def _imported_modules(source: str) -> set[str]:
    """Top-level names of every module ``source`` imports, at module level or inside a function
    (``from x.y import z`` → ``x``; relative imports are left out: tests/ is no package)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def _test_module_imports(tests_dir: Path) -> dict[str, list[str]]:
    """Test module → the test modules (``test_*``) it imports, for those that import any."""
    found = {}
    for path in sorted(tests_dir.glob("test_*.py")):
        imported = sorted(m for m in _imported_modules(path.read_text()) if m.startswith("test_"))
        if imported:
            found[path.name] = imported
    return found


def test_no_test_module_imports_another():
    assert _test_module_imports(TESTS) == {}, (
        "a test module imports another test module (importing it re-collects nothing but runs "
        "its module code and couples the files): move the shared helper into a non-test module "
        "(tests/models.py, tests/families.py, tests/graph_doubles.py, tests/tp_harness.py)")


def test_the_import_check_sees_nested_and_from_imports(tmp_path):
    (tmp_path / "test_a.py").write_text("import os\nfrom models import x\n")
    (tmp_path / "test_b.py").write_text("def f():\n    from test_a import g\n")
    (tmp_path / "test_c.py").write_text("import test_a.sub as t, json\n")
    (tmp_path / "helpers.py").write_text("import test_a\n")  # not a test module: not checked
    assert _test_module_imports(tmp_path) == {"test_b.py": ["test_a"], "test_c.py": ["test_a"]}


# ----- the registry of test families --------------------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_is_consistent(name):
    fam = family(name)
    assert fam.kind in {"causal", "encoder"} and fam.positions in {"rotary", "learned", "alibi"}
    assert set(fam.quant_bits) <= set(QUANT_BOUNDS)
    assert set(fam.inject) | set(fam.checkpoint) <= {1, 2}
    if fam.tp_even or fam.uneven_heads or 2 in fam.inject:  # facts of a TP=2 split
        assert fam.tp
    assert not (fam.tp_even and fam.uneven_heads)
    if fam.graph_step:  # the captured decode step is checked on an injected model
        assert 1 in fam.inject
    # causal families share each bound, but for test_moe.py's bf16 one (an MoE family's own,
    # measured and explained in its row: test_moe.py's docstring)
    assert set(fam.tolerances) <= {"moe_bf16"} or fam.kind == "encoder"


def test_selections_keep_registry_order_and_match_every_criterion():
    assert families() == list(FAMILIES)
    assert families(core=True) == ["llama", "gpt2"]  # what the docstrings call the core pair
    at_tp2 = families(inject=2, uneven_heads=True)  # a number: a member of the tuple field
    assert at_tp2 == [n for n in FAMILIES if 2 in FAMILIES[n].inject and FAMILIES[n].uneven_heads]
    assert "llama-7heads" in at_tp2
    with_bits = families(quant_bits=True)  # a bool on a tuple field: any / none
    assert with_bits == [n for n in FAMILIES if FAMILIES[n].quant_bits]
    assert families(quant_bits=False) == [n for n in FAMILIES if n not in with_bits]
    types = ("bloom", "falcon")  # a collection on a scalar field: one of them
    assert families(model_type=types) == [n for n in FAMILIES if FAMILIES[n].model_type in types]
    assert families(kind="encoder") == ["bert"] and "bert" not in families(kind="causal")


def test_bad_selections_are_named():
    with pytest.raises(TypeError, match="no field injected"):
        families(injected=True)
    with pytest.raises(ValueError, match="selects no family"):
        families(kind="encoder", quant_bits=8)
    with pytest.raises(KeyError, match="no test family 'llama2'.*llama, gpt2"):
        family("llama2")
