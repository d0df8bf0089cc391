"""The tests are where the docs say: every test file that README.md, docs/,
bench/, .ci/, kvtrace/, traces/ or a test names by its path under tests/ is
there, and so is the test a name after ``::`` points to. Every folder of tests
is a package (a helper is imported as ``tests.mini_traces`` from any folder)
and is named in tests/README.md; no test file sits in tests/ itself."""

from __future__ import annotations

import re

from tests._paths import REPO, TESTS

NAMED = re.compile(r"\btests/((?:[\w-]+/)*[\w-]+\.py)(?:::(\w+))?")
WHERE = ("README.md", "docs", "bench", ".ci", "kvtrace", "traces", "tests")


def _texts():
    """(file, its text) for each text file of the places that name tests."""
    for top in WHERE:
        path = REPO / top
        files = [path] if path.is_file() else sorted(
            f for f in path.rglob("*") if f.is_file() and "__pycache__" not in f.parts
            and (f.suffix in (".md", ".py", ".sh", ".toml") or f.parent.name == ".ci"))
        for f in files:
            yield f, f.read_text(errors="replace")


def _named() -> list[tuple[str, str, str | None]]:
    """(where, the test file, the test or None) for each test a text names."""
    return [(f"{f.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}", m[1], m[2])
            for f, text in _texts() for m in NAMED.finditer(text)]


def _missing(named) -> list[str]:
    bad = []
    for where, file, test in named:
        path = TESTS / file
        if not path.is_file():
            bad.append(f"{where}: {file} is not under tests/")
        elif test and not re.search(rf"^(?:async )?def {test}\b|^class {test}\b", path.read_text(),
                                    re.M):
            bad.append(f"{where}: {file} has no test {test}")
    return bad


def test_every_test_the_docs_and_the_code_name_is_there():
    named = _named()
    assert len({file for _, file, _ in named}) > 30   # the scan sees the docs' names
    assert _missing(named) == []


def test_the_scan_sees_a_test_that_moved():
    named = [("x.md:1", "test_gone.py", None), ("x.md:2", "house/test_test_paths.py", "test_no"),
             ("x.md:3", "house/test_test_paths.py", "test_the_scan_sees_a_test_that_moved")]
    assert _missing(named) == ["x.md:1: test_gone.py is not under tests/",
                               "x.md:2: house/test_test_paths.py has no test test_no"]


def _folders():
    return sorted({p.parent for p in TESTS.rglob("test_*.py") if "stubs" not in p.parts})


def test_every_folder_of_tests_is_a_package_named_in_the_readme():
    readme = (TESTS / "README.md").read_text()
    folders = _folders()
    assert TESTS not in folders, "a test file in tests/ itself: tests/README.md says where it goes"
    for folder in folders:
        for package in [folder, *folder.relative_to(TESTS).parents]:
            assert (TESTS / package / "__init__.py").is_file(), f"{package} has no __init__.py"
        assert f"`{folder.relative_to(TESTS)}/`" in readme, f"tests/README.md does not name {folder}"
