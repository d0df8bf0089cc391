"""The compiled path: the reference scheduler and replay's busiest modules,
compiled ahead of time with mypyc into C extensions that sit beside their
sources, and the KV digest's mix, a kernel in C. The same typed Python runs
either way; compiled, replay runs faster, and so do the recorder's KV digests.

    python -m kvtrace.compile            build them in place (needs mypy and a C compiler)
    python -m kvtrace.compile --status   say which path runs, and why
    python -m kvtrace.compile --clean    remove them: the pure path runs

kvtrace runs its pure Python sources when the extensions are not built, when
any source changed since they were (a manifest records each source's hash),
or when ``KVTRACE_PURE=1`` asks for them. ``--status --require`` exits 1
unless the compiled path runs.
"""

from __future__ import annotations

import json
import os
import sys

from kvtrace import compiled
from kvtrace.compiled import (GROUP, KERNELS, MANIFEST, MODULES, ROOT, extension_paths,
                              source_path)


def build(verbose: bool = False) -> None:
    """Compile MODULES with mypyc, and KERNELS, and put the extensions beside
    their sources."""
    try:
        from mypyc.build import mypycify
        import mypy.version
    except ImportError:
        raise SystemExit("python -m kvtrace.compile: needs mypy (pip install mypy)") from None
    from setuptools import Distribution, Extension

    clean()
    build_dir = os.path.join(ROOT, "build", "mypyc")
    cwd = os.getcwd()
    os.chdir(ROOT)   # mypyc names modules from paths relative to here
    try:
        ext = mypycify([os.path.relpath(source_path(m), ROOT) for m in MODULES]
                       + ["--follow-imports=silent"],
                       opt_level="3", group_name=GROUP, target_dir=build_dir, verbose=verbose)
        ext += [Extension(k, [os.path.relpath(source_path(k), ROOT)], extra_compile_args=["-O3"])
                for k in KERNELS]
        dist = Distribution({"name": "kvtrace-compiled", "ext_modules": ext})
        cmd = dist.get_command_obj("build_ext")
        cmd.inplace = True
        cmd.build_temp = os.path.join(build_dir, "temp")
        cmd.ensure_finalized()
        cmd.run()
    finally:
        os.chdir(cwd)
    with open(MANIFEST, "w") as f:
        json.dump({"mypy": mypy.version.__version__, "python": sys.implementation.cache_tag,
                   "sources": compiled.manifest()}, f, indent=1, sort_keys=True)
        f.write("\n")


def clean() -> list[str]:
    """Remove the extensions and the manifest; returns what was removed."""
    gone = [p for m in MODULES + KERNELS for p in extension_paths(m)]
    gone += [p for p in extension_paths(GROUP + "__mypyc")]
    if os.path.exists(MANIFEST):
        gone.append(MANIFEST)
    for p in gone:
        os.remove(p)
    return gone


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvtrace.compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--status", action="store_true", help="say which path runs, and why")
    ap.add_argument("--require", action="store_true",
                    help="with --status: exit 1 unless the compiled path runs")
    ap.add_argument("--clean", action="store_true", help="remove the extensions")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.clean:
        for p in clean():
            print(f"removed {os.path.relpath(p)}")
        return 0
    if args.status:
        import kvtrace.reference   # noqa: F401  (loads the path chosen)
        print(compiled.status())
        return 0 if compiled.COMPILED or not args.require else 1
    build(args.verbose)
    ok, reason = compiled.choose()
    print(f"built: {reason}" if ok else f"the build left the pure path running: {reason}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
