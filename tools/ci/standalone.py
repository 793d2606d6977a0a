#!/usr/bin/env python3
"""Installed alone, tested alone: every distribution under ``packages/*`` built (wheel and
sdist), then each stage family installed from those wheels into a fresh virtual
environment of its own, and checked there.

    python3 tools/ci/standalone.py                 # everything (CI runs this)
    python3 tools/ci/standalone.py --only core,ar  # some combinations
    python3 tools/ci/standalone.py --list          # the plan, nothing run
    python3 tools/ci/standalone.py --no-tests      # build, install, pip check, imports

For each combination (the table ``COMBINATIONS`` below; a distribution it does not name
gets one of its own: itself with its ``test`` extra, if it has one):

1. ``python -m venv`` a fresh environment and ``pip install`` the combination's
   requirements, the workspace's distributions taken from the wheels just built (a
   constraints file pins each to its wheel, so no index can stand in for them), the rest
   from wherever pip's own configuration says (on a CPU machine that configuration must
   offer the CPU ``torch==2.13.0``; see docs/install.md). ``pytest-timeout`` is added so
   that the repository's pytest ``timeout`` applies.
2. ``pip check``.
3. ``standalone_probe.py``: every module of the package under test imported; each one's
   file in the environment, not in ``packages/*/src``; every third-party import in its
   source declared in its metadata.
4. The package's own tests, ``python -P -m pytest packages/X/tests`` with the environment's
   Python, from the repository root (the tests read ``configs/``), with ``-P`` so that no
   source folder comes first on ``sys.path``, and the ``standalone_guard`` plug-in, which
   fails the run if any module was imported from a ``src`` folder after all.

Steps 1-3 of the next combinations run in a thread ahead of the tests (one install at a
time, beside this combination's tests), so the installs cost the run little time.

Prints each step's time, a final table, and exits 1 naming what failed. Logs of every step
are kept in the work directory's ``logs/`` (``--work DIR`` to choose it, ``--keep`` to keep
the environments too).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Combination:
    """One fresh environment: ``requirements`` installed (pip requirement strings naming
    workspace distributions and their extras), then ``package``'s imports and tests checked."""

    name: str
    package: str  # the distribution under test: its modules are imported, its tests run
    requirements: tuple[str, ...]
    # modules of ``package`` not imported here, with why (they need an extra not installed)
    skip_modules: tuple[tuple[str, str], ...] = ()


VLLM_ONLY = ("omni_ar.engines.kv_connector", "needs the vllm extra (vLLM's KV connector API)")
# omni's logits processors for vLLM (and the base they share)
VLLM_PROCESSORS = tuple(
    (f"omni_ar.engines.{name}", "needs the vllm extra (vLLM's logits processor API)")
    for name in ("vllm_grammar", "vllm_carried", "vllm_rows")
)

# The families (the issue's "core alone; core + AR with the transformers engine; core +
# DiT; core + serve + AR; core + Ray"). omni-testing (test support) may come in through a
# package's `test` extra. A distribution under packages/* that no row tests gets a row of
# its own (itself, with its `test` extra if it has one).
COMBINATIONS: tuple[Combination, ...] = (
    Combination("core", "omni-core", ("omni-core[test]",)),
    Combination(
        "ar",
        "omni-ar-stages",
        ("omni-ar-stages[transformers,test]",),
        skip_modules=(VLLM_ONLY, *VLLM_PROCESSORS),
    ),
    Combination("dit", "omni-dit-stages", ("omni-dit-stages[test]",)),
    Combination(
        "serve",
        "omni-serve",
        ("omni-serve[test]", "omni-ar-stages[transformers]"),
    ),
    Combination("ray", "omni-ray", ("omni-ray[test]",)),
    # the speech family brings the AR family (its thinker's requests, ar.postprocess)
    Combination("speech", "omni-speech-stages", ("omni-speech-stages[test]",)),
)


@dataclasses.dataclass(frozen=True)
class Dist:
    name: str
    version: str
    path: Path
    extras: tuple[str, ...]

    @property
    def tests(self) -> Path | None:
        t = self.path / "tests"
        return t if t.is_dir() and any(t.glob("test_*.py")) else None

    @property
    def stem(self) -> str:
        """The file-name form of the name (``omni-core`` -> ``omni_core``)."""
        return re.sub(r"[-_.]+", "_", self.name).lower()


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def discover(repo: Path = REPO) -> list[Dist]:
    """Every distribution under ``packages/*``: a folder with a ``pyproject.toml`` that has
    a ``[project]`` table."""
    found = []
    for pyproject in sorted(repo.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text()).get("project")
        if not project or "name" not in project:
            continue
        found.append(
            Dist(
                name=normalize(project["name"]),
                version=project.get("version", "0"),
                path=pyproject.parent,
                extras=tuple(project.get("optional-dependencies", {})),
            )
        )
    return found


def plan(dists: list[Dist], table: tuple[Combination, ...] = COMBINATIONS) -> list[Combination]:
    """The table's rows (a row naming a distribution that is not under ``packages/*`` stops
    the run), then a row of its own for each distribution that no row tests."""
    names = {d.name for d in dists}
    rows = []
    for c in table:
        missing = [
            r for r in c.requirements if normalize(re.split(r"[\[<>=!~; ]", r)[0]) not in names
        ]
        if missing:
            raise SystemExit(
                f"standalone: combination {c.name!r} names {missing}, not under packages/*"
            )
        rows.append(c)
    tested = {normalize(c.package) for c in rows}
    for d in dists:
        if d.name not in tested:
            req = f"{d.name}[test]" if "test" in d.extras else d.name
            rows.append(Combination(d.name.removeprefix("omni-"), d.name, (req,)))
    return rows


# -- running ------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    combo: Combination
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    failed: str | None = None  # the step that failed, and why
    summary: str = ""  # pytest's last line


def clean_env(venv: Path | None = None) -> dict[str, str]:
    """The environment for commands in ``venv``: no other virtual environment's ``bin`` on
    ``PATH`` (``hatch run`` puts the workspace's there), no ``PYTHONPATH``, no user site."""
    # PYTHONDONTWRITEBYTECODE too: the environments' modules are compiled where they are first
    # imported (see install_combination), so they must be allowed to write their bytecode
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    keep = [
        p
        for p in env.get("PATH", "").split(os.pathsep)
        if p and not (Path(p).parent / "pyvenv.cfg").exists()
    ]
    if venv is not None:
        keep.insert(0, str(venv / "bin"))
        env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join(keep)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def step(log: Path, argv: list[str], **kw) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(map(str, argv)) + "\n").encode())
        f.flush()
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    return rc, time.monotonic() - t0


def tail(log: Path, n: int = 40) -> str:
    lines = log.read_text(errors="replace").splitlines()
    return "\n".join("    " + line for line in lines[-n:])


def failure(what: str, log: Path) -> str:
    """What failed, with the end of its log."""
    return f"{what}; its log ({log}) ends:\n{tail(log)}"


def hatch() -> list[str]:
    exe = shutil.which("hatch")
    return [exe] if exe else [sys.executable, "-m", "hatch"]


def build(dists: list[Dist], out: Path, logs: Path) -> dict[str, Path]:
    """``hatch build`` of each distribution's wheel and sdist into ``out``; the wheels by
    name. Each sdist must hold the ``pyproject.toml`` and the sources."""
    wheels = {}
    for d in dists:
        log = logs / f"build-{d.name}.log"
        rc, dt = step(
            log,
            [*hatch(), "build", "-t", "wheel", "-t", "sdist", str(out)],
            cwd=d.path,
            env=clean_env(),
        )
        if rc:
            raise SystemExit(f"standalone: hatch build of {d.name} failed:\n{tail(log)}")
        wheel = next(out.glob(f"{d.stem}-{d.version}-*.whl"), None)
        sdist = out / f"{d.stem}-{d.version}.tar.gz"
        if wheel is None or not sdist.exists():
            raise SystemExit(f"standalone: hatch build of {d.name} made no wheel or sdist in {out}")
        with tarfile.open(sdist) as t:
            members = {m.split("/", 1)[-1] for m in t.getnames()}
        if "pyproject.toml" not in members or not any(m.startswith("src/") for m in members):
            raise SystemExit(f"standalone: {sdist.name} lacks pyproject.toml or src/")
        wheels[d.name] = wheel
        print(f"  built {wheel.name} and {sdist.name} ({dt:.1f}s)", flush=True)
    return wheels


def install_combination(c: Combination, constraints: Path, work: Path) -> Result:
    """Steps 1-3 for ``c``: its environment made, installed, checked and probed (``failed``
    set if one of them failed)."""
    r = Result(c)
    logs = work / "logs"
    venv = work / f"venv-{c.name}"
    shutil.rmtree(venv, ignore_errors=True)
    env = clean_env(venv)
    py = str(venv / "bin" / "python")

    def fail(what: str, log: Path) -> Result:
        r.failed = failure(what, log)
        return r

    log = logs / f"{c.name}-install.log"
    t0 = time.monotonic()
    # --upgrade-deps: Python 3.11's bundled pip (23.2) rejects an extra of a distribution
    # pinned to a wheel by a constraint ("inconsistent name"); later ones do not
    rc, _ = step(log, [sys.executable, "-m", "venv", "--upgrade-deps", str(venv)], env=clean_env())
    if rc:
        return fail("python -m venv failed", log)
    # --no-compile: pip would byte-compile every module of torch, transformers, diffusers and
    # Ray, most of an install's time (ar here: 89 s without, 161 s with, on a loaded
    # machine). The probe below imports every module of the package, which compiles (and,
    # with bytecode writing allowed, saves) what it and its dependencies import, once,
    # before any test. (Without the bytecode saved, the tests' workers, four at a time,
    # each compiled what they import, and some missed their 120 s ready timeout.)
    pip = [py, "-m", "pip", "install", "--no-compile", "-c", str(constraints)]
    rc, _ = step(log, [*pip, *c.requirements, "pytest-timeout>=2.3"], env=env, cwd=work)
    if rc:
        return fail(f"pip install {' '.join(c.requirements)} failed", log)
    r.times["install"] = time.monotonic() - t0
    print(f"  [{c.name}] installed ({r.times['install']:.0f}s)", flush=True)

    log = logs / f"{c.name}-check.log"
    t0 = time.monotonic()
    rc, _ = step(log, [py, "-m", "pip", "check"], env=env, cwd=work)
    if rc:
        return fail("pip check found broken requirements", log)
    probe = [py, "-P", str(HERE / "standalone_probe.py"), c.package]
    probe += [f"--skip={m}={why}" for m, why in c.skip_modules]
    rc, _ = step(log, probe, env=env, cwd=work)
    r.times["check"] = time.monotonic() - t0
    if rc:
        return fail(f"{c.package}'s modules do not import, or import undeclared distributions", log)
    print(f"  [{c.name}] pip check and imports ({r.times['check']:.0f}s)", flush=True)
    return r


def test_combination(r: Result, dists: dict[str, Dist], work: Path, args) -> Result:
    """Step 4 for an installed combination: its package's tests in its environment."""
    c = r.combo
    venv = work / f"venv-{c.name}"
    tests = dists[normalize(c.package)].tests
    if tests is None or args.no_tests:
        r.summary = "no tests" if tests is None else "tests not run (--no-tests)"
        return r
    log = work / "logs" / f"{c.name}-tests.log"
    # Without ``CI``: a test that CI insists on (vLLM, the packaged model) and that this
    # family alone cannot run skips here, so it is not deselected and runs in the workspace.
    test_env = {k: v for k, v in clean_env(venv).items() if k != "CI"}
    test_env |= {"PYTHONPATH": str(HERE), "OMNI_STANDALONE_REPO": str(REPO)}
    if args.passed:
        test_env["OMNI_STANDALONE_PASSED"] = str(args.passed.resolve())
    py = str(venv / "bin" / "python")
    argv = [py, "-P", "-m", "pytest", "-p", "no:cacheprovider", "-p", "standalone_guard"]
    argv += [str(tests.relative_to(REPO)), *args.pytest_args]
    rc, r.times["tests"] = step(log, argv, env=test_env, cwd=REPO)
    found = re.findall(
        r"^=+ (.+) in [\d.]+s(?: \([\d:]+\))? =+$", log.read_text(errors="replace"), re.M
    )
    r.summary = found[-1] if found else f"pytest exited {rc}"
    if rc:
        r.failed = failure(f"{c.package}'s tests failed ({r.summary})", log)
        return r
    print(f"  [{c.name}] tests: {r.summary} ({r.times['tests']:.0f}s)", flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", help="comma-separated combination names (see --list)")
    ap.add_argument(
        "--list", action="store_true", help="print the distributions and combinations, run nothing"
    )
    ap.add_argument(
        "--no-tests", action="store_true", help="build, install, pip check and imports only"
    )
    ap.add_argument(
        "--work", type=Path, help="work directory (default: a new temporary one, removed after)"
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the work directory and the environments"
    )
    ap.add_argument(
        "--passed",
        type=Path,
        metavar="FILE",
        help="write the node ids of the tests that passed here to FILE (for standalone_done)",
    )
    ap.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = ap.parse_args(argv)

    dists = discover()
    rows = plan(dists)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {c.name for c in rows}
        if unknown:
            ap.error(f"no combination {sorted(unknown)}; there are {[c.name for c in rows]}")
        rows = [c for c in rows if c.name in wanted]
    if args.list:
        print("distributions:", ", ".join(f"{d.name} {d.version}" for d in dists))
        for c in rows:
            print(f"  {c.name:8} installs {' '.join(c.requirements)}; tests {c.package}")
        return 0

    if args.passed:
        args.passed.parent.mkdir(parents=True, exist_ok=True)
        args.passed.write_text("")
    work = args.work or Path(tempfile.mkdtemp(prefix="omni-standalone-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    dist_dir = work / "dist"
    shutil.rmtree(dist_dir, ignore_errors=True)
    dist_dir.mkdir()
    t_all = time.monotonic()
    print(f"standalone: building {len(dists)} distributions into {dist_dir}", flush=True)
    t0 = time.monotonic()
    wheels = build(dists, dist_dir, work / "logs")
    t_build = time.monotonic() - t0
    constraints = work / "constraints.txt"
    constraints.write_text("".join(f"{n} @ {w.as_uri()}\n" for n, w in sorted(wheels.items())))

    results = []
    by_name = {d.name: d for d in dists}
    # One installer runs ahead of the tests: the next combinations install (pip: the
    # network, the disk and one core) while this one's tests run, one install at a time.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="install") as installer:
        installs = [installer.submit(install_combination, c, constraints, work) for c in rows]
        for c, install in zip(rows, installs, strict=True):
            print(f"standalone: [{c.name}] {' '.join(c.requirements)}", flush=True)
            r = install.result()
            if not r.failed:
                r = test_combination(r, by_name, work, args)
            if r.failed:
                print(f"  [{c.name}] FAILED: {r.failed}", flush=True)
            results.append(r)
            if not args.keep:
                shutil.rmtree(work / f"venv-{c.name}", ignore_errors=True)

    total = time.monotonic() - t_all
    print(f"\nstandalone: build {t_build:.0f}s, total {total:.0f}s ({total / 60:.1f} min)")
    head = f"{'combination':12} {'install':>8} {'check':>7} {'tests':>7}  result"
    print(head + "\n" + "-" * len(head))
    for r in results:
        t = [f"{r.times[k]:.0f}s" if k in r.times else "-" for k in ("install", "check", "tests")]
        state = "FAILED" if r.failed else "ok"
        print(f"{r.combo.name:12} {t[0]:>8} {t[1]:>7} {t[2]:>7}  {state}: {r.summary or '-'}")
    bad = [r for r in results if r.failed]
    if bad:
        print(
            "\nstandalone: failed:\n"
            + "\n".join(f"- {r.combo.name}: {r.failed.splitlines()[0]}" for r in bad)
        )
    if not args.keep and args.work is None and not bad:
        shutil.rmtree(work, ignore_errors=True)
    elif bad:
        print(f"logs in {work / 'logs'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
