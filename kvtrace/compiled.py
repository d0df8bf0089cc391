"""Which path runs: the compiled one (the modules below, compiled with mypyc
into C extensions beside their sources) or the pure Python sources. Decided
once per process, before any of them loads (kvtrace/__init__.py). The pure
path runs when the extensions are not built, when any source changed since
they were (the build's manifest records each source's hash), or when
``KVTRACE_PURE=1`` asks for it. ``python -m kvtrace.compile`` builds them.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys

# The modules compiled, by name. A module here imports the others it needs by
# their names too, so each path runs all of them compiled or all of them pure.
MODULES = (
    "kvtrace.reference.admission",
    "kvtrace.reference.async_output",
    "kvtrace.reference.attention_groups",
    "kvtrace.reference.block_pool",
    "kvtrace.reference.cache_stats",
    "kvtrace.reference.cadence",
    "kvtrace.reference.config",
    "kvtrace.reference.feature",
    "kvtrace.reference.hashing",
    "kvtrace.reference.interface",
    "kvtrace.reference.kv_groups",
    "kvtrace.reference.kv_manager",
    "kvtrace.reference.kv_transfer",
    "kvtrace.reference.output",
    "kvtrace.reference.profiles",
    "kvtrace.reference.queues",
    "kvtrace.reference.request",
    "kvtrace.reference.scheduler",
    "kvtrace.reference.sessions",
    "kvtrace.reference.speculative",
    "kvtrace.reference.state_groups",
    "kvtrace.reference.step",
    "kvtrace.bridge",
    "kvtrace.replay.checks",
    "kvtrace.replay.liveness",
    "kvtrace.trace.validate",
)

# Kernels in C, built beside their sources with the modules above and loaded
# by their callers (ctypes), by name: the KV digest's mix (kv_digest.py).
KERNELS = ("kvtrace.record.vllm._kv_digest",)

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(PACKAGE_DIR)
MANIFEST_NAME = "compiled.json"   # written by the build: the sources it compiled
MANIFEST = os.path.join(PACKAGE_DIR, MANIFEST_NAME)
# The shared library every compiled module's extension loads.
GROUP = "kvtrace._mypyc"


def source_path(module: str, root: str = ROOT) -> str:
    return os.path.join(root, *module.split(".")) + (".c" if module in KERNELS else ".py")


def extension_paths(module: str, root: str = ROOT) -> list[str]:
    base = os.path.join(root, *module.split("."))
    return [base + s for s in importlib.machinery.EXTENSION_SUFFIXES if os.path.exists(base + s)]


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=16).hexdigest()


def manifest(root: str = ROOT) -> dict[str, str]:
    """Each compiled module's and kernel's source, by its hash."""
    return {m: _digest(source_path(m, root)) for m in MODULES + KERNELS}


def choose(root: str = ROOT) -> tuple[bool, str]:
    """Whether the compiled path runs (for the package in ``root``), and why or why not."""
    if os.environ.get("KVTRACE_PURE", "") not in ("", "0"):
        return False, "KVTRACE_PURE is set"
    missing = [m for m in MODULES + KERNELS if not extension_paths(m, root)]
    if len(missing) == len(MODULES + KERNELS):
        return False, "not built (python -m kvtrace.compile builds it)"
    if missing:
        return False, f"partly built: {missing[0]} has no extension (rebuild)"
    try:
        with open(os.path.join(root, "kvtrace", MANIFEST_NAME)) as f:
            built = json.load(f)
    except (OSError, ValueError):
        return False, f"no readable manifest kvtrace/{MANIFEST_NAME} (rebuild)"
    if built.get("python") != sys.implementation.cache_tag:
        return False, f"built for {built.get('python')}, not {sys.implementation.cache_tag} (rebuild)"
    changed = [m for m, h in manifest(root).items() if built.get("sources", {}).get(m) != h]
    if changed:
        return False, f"{changed[0]} changed since the build (rebuild)"
    return True, (f"{len(MODULES)} modules compiled with mypyc {built.get('mypy', '?')}, "
                  f"and {len(KERNELS)} kernel in C")


class _PureSources:
    """Finds the compiled modules' Python sources before their extensions."""

    def find_spec(self, name, path=None, target=None):
        if name in MODULES:
            return importlib.util.spec_from_file_location(name, source_path(name))
        return None


COMPILED, REASON = False, "not decided yet"


def install() -> None:
    """Decide the path for this process, once, before any compiled module loads
    (kvtrace/__init__.py calls it)."""
    global COMPILED, REASON
    COMPILED, REASON = choose()
    if not COMPILED and not any(isinstance(f, _PureSources) for f in sys.meta_path):
        sys.meta_path.insert(0, _PureSources())


def kernel(name: str) -> tuple[str | None, str]:
    """The library built from kernel ``name`` where the compiled path runs (None
    where not), and why not."""
    if not COMPILED:
        return None, f"the pure path runs: {REASON}"
    paths = extension_paths(name)
    return (paths[0], "") if paths else (None, f"{name} is not built")


def status() -> str:
    loaded = [m for m in MODULES if m in sys.modules]
    kinds = {type(sys.modules[m].__loader__).__name__ for m in loaded}
    path = "compiled" if COMPILED else "pure Python"
    return f"kvtrace runs its {path} path: {REASON}" + (f" [loaded by {', '.join(sorted(kinds))}]"
                                                      if loaded else "")


