"""Mutation testing of the fault-path modules with Cosmic Ray: `hatch run mutate [MODULE...]`.

Cosmic Ray mutates a file on disk, runs a test command, and restores the file. So that
the working tree is never mutated (other runs, editors and the tests of the tree itself
keep seeing the real source), each module gets a scratch copy of the tree (tracked and
untracked files, as git lists them) under the work folder, and the test command runs
there with every `packages/*/src` and `tools/*/src` of the copy first on `PYTHONPATH`:
ahead of the workspace's editable installs, in the test process and in every worker
process it starts, so a mutant is what the pipeline's own processes run too.

The modules and the tests that cover each are in `tools/mutate/modules.toml`. A mutant
is killed when its tests fail (or time out); one that they pass survives, and the
report lists it as `path:line  operator  - original / + mutated`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import queue
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import attrs
from cosmic_ray.commands import init as cr_init
from cosmic_ray.mutating import mutate_and_test
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkItem, WorkResult

ROOT = Path(__file__).resolve().parents[2]
MODULES_FILE = Path(__file__).with_name("modules.toml")

# Cosmic Ray's full operator set makes every `a | b` in an annotation eleven mutants and
# every comparison seven. The kept set is one plausible slip per operator: the boundary
# (< for <=), the negation (== for !=), the neighbouring arithmetic (+ for -), plus every
# number off by one, `not` added to each condition, exceptions, loops, booleans, breaks.
KEPT_BINARY = {
    "Add_Sub",
    "Sub_Add",
    "Mul_Div",
    "Div_Mul",
    "FloorDiv_Mul",
    "Mod_FloorDiv",
    "Pow_Mul",
    "LShift_RShift",
    "RShift_LShift",
    "BitAnd_BitOr",
    "BitXor_BitAnd",
}
KEPT_COMPARISON = {
    "Lt_LtE",
    "LtE_Lt",
    "Gt_GtE",
    "GtE_Gt",
    "Eq_NotEq",
    "NotEq_Eq",
    "Is_IsNot",
    "IsNot_Is",
    "In_NotIn",
    "NotIn_In",
}
DROPPED = {"core/VariableReplacer", "core/VariableInserter"}
NO_MUTATE = "pragma: no mutate"


@dataclass(frozen=True)
class Module:
    name: str
    path: str
    tests: tuple[str, ...]


def load_modules() -> dict[str, Module]:
    data = tomllib.loads(MODULES_FILE.read_text())["modules"]
    return {
        name: Module(name, entry["path"], tuple(entry["tests"])) for name, entry in data.items()
    }


def kept(operator: str) -> bool:
    if operator in DROPPED:
        return False
    for family, keep in (
        ("core/ReplaceBinaryOperator_", KEPT_BINARY),
        ("core/ReplaceComparisonOperator_", KEPT_COMPARISON),
    ):
        if operator.startswith(family):
            return operator.removeprefix(family) in keep
    return True


def covering_tests(module: Module, root: Path) -> list[str]:
    """The module's test files that exist under `root` (globs expanded, sorted)."""
    found: list[str] = []
    for pattern in module.tests:
        for match in sorted(glob.glob(pattern, root_dir=root)):
            if match not in found:
                found.append(match)
    return found


def copy_tree(dest: Path) -> None:
    """A fresh copy of the working tree's files (tracked and untracked, not ignored)."""
    if dest.exists():
        shutil.rmtree(dest)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def tests_command(tree: Path, tests: list[str], basetemp: Path) -> str:
    """The shell-free command Cosmic Ray runs for each mutant, in `tree`."""
    paths = sorted(str(p) for p in tree.glob("packages/*/src")) + sorted(
        str(p) for p in tree.glob("tools/*/src")
    )
    pytest = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--basetemp={basetemp}",
        *tests,
    ]
    inner = f"cd {shlex.quote(str(tree))} && exec " + shlex.join(pytest)
    return shlex.join(
        ["env", "PYTHONPATH=" + os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE=1"]
        + ["bash", "-c", inner]
    )


def line_of(item: WorkItem) -> int:
    return item.mutations[0].start_pos[0]


def diff_lines(diff: str | None) -> tuple[str, str]:
    """The removed and added source lines of a one-mutation diff."""
    old, new = [], []
    for line in (diff or "").splitlines():
        if line.startswith("-") and not line.startswith("---"):
            old.append(line[1:].strip())
        elif line.startswith("+") and not line.startswith("+++"):
            new.append(line[1:].strip())
    return " / ".join(old), " / ".join(new)


def prepare(module: Module, work: Path, fresh: bool, jobs: int) -> tuple[Path, list[Path]]:
    """The module's session database and one scratch tree per job; initialised unless resumed."""
    base = work / module.name
    session = base / "session.sqlite"
    trees = [base / f"tree-{i}" for i in range(jobs)]
    if fresh or not session.exists():
        session.unlink(missing_ok=True)
    for tree in trees:  # anew even when resuming: an interrupted run may leave a mutant
        copy_tree(tree)
    if not session.exists():
        with use_db(str(session)) as db:
            cwd = Path.cwd()
            os.chdir(trees[0])  # Cosmic Ray records paths relative to the current folder
            try:
                cr_init([Path(module.path)], db, {})
            finally:
                os.chdir(cwd)
            source = (trees[0] / module.path).read_text().splitlines()
            for item in list(db.pending_work_items):
                mutation = item.mutations[0]
                text = source[mutation.start_pos[0] - 1]
                if not kept(mutation.operator_name) or NO_MUTATE in text:
                    db.set_result(
                        item.job_id,
                        WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="filtered"),
                    )
    return session, trees


def baseline(command: str) -> float:
    """Seconds the unmutated tests take; exits if they fail."""
    start = time.monotonic()
    done = subprocess.run(shlex.split(command), capture_output=True, text=True)
    took = time.monotonic() - start
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-4000:] + done.stderr[-2000:])
        sys.exit(f"the tests fail without any mutation (exit {done.returncode}): fix them first")
    return took


def run(module: Module, work: Path, fresh: bool, timeout: float | None, jobs: int) -> None:
    session, trees = prepare(module, work, fresh, jobs)
    tests = covering_tests(module, trees[0])
    if not tests:
        sys.exit(f"{module.name}: none of its tests exist: {', '.join(module.tests)}")
    commands = {
        tree: tests_command(tree, tests, work / module.name / f"pytest-{tree.name}")
        for tree in trees
    }
    print(f"== {module.name}: {module.path}\n   tests: {' '.join(tests)}", flush=True)
    took = baseline(commands[trees[0]])
    limit = timeout or max(30.0, 3 * took)
    print(f"   baseline {took:.1f} s, per-mutant timeout {limit:.0f} s, {jobs} job(s)", flush=True)
    free: queue.Queue[Path] = queue.Queue()
    for tree in trees:
        free.put(tree)

    def one(item: WorkItem) -> WorkResult:
        tree = free.get()
        try:
            mutations = [attrs.evolve(m, module_path=tree / m.module_path) for m in item.mutations]
            return mutate_and_test(mutations=mutations, test_command=commands[tree], timeout=limit)
        finally:
            free.put(tree)

    with use_db(str(session), WorkDB.Mode.open) as db:
        pending = list(db.pending_work_items)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(one, item): item for item in pending}
            for done, future in enumerate(as_completed(futures), 1):
                item, result = futures[future], future.result()
                db.set_result(item.job_id, result)  # from this thread only: sqlite
                outcome = (result.test_outcome or result.worker_outcome).value
                if result.output == "timeout":
                    outcome = "killed (timeout)"
                print(
                    f"   [{done}/{len(pending)} {time.monotonic() - started:.0f}s] "
                    f"line {line_of(item)} {item.mutations[0].operator_name}: {outcome}",
                    flush=True,
                )
    report(module, work)


def report(module: Module, work: Path) -> bool:
    """Print the module's score and its survivors; False when it has no session."""
    session = work / module.name / "session.sqlite"
    if not session.exists():
        return False
    counts: collections.Counter[str] = collections.Counter()
    survivors: list[tuple[int, str, str, str]] = []
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            if result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                old, new = diff_lines(result.diff)
                op = item.mutations[0].operator_name.removeprefix("core/")
                survivors.append((line_of(item), op, old, new))
            elif result.test_outcome == TestOutcome.KILLED:
                counts["killed"] += 1
                if result.output == "timeout":
                    counts["timeout"] += 1
            else:
                counts["other"] += 1  # incompetent, no mutation possible, worker error
        counts["pending"] = sum(1 for _ in db.pending_work_items)
    tested = counts["killed"] + counts["survived"]
    score = f"{100 * counts['killed'] / tested:.1f}%" if tested else "-"
    print(
        f"## {module.name} ({module.path}): {tested} mutants, {counts['killed']} killed "
        f"({counts['timeout']} by timeout), {counts['survived']} survived, score {score}"
        + (f", {counts['pending']} not run yet" if counts["pending"] else "")
        + (f", {counts['other']} incompetent" if counts["other"] else "")
    )
    for line, op, old, new in sorted(survivors):
        print(f"   {module.path}:{line}  {op}  - {old}  + {new}")
    return True


def main(argv: list[str] | None = None) -> None:
    modules = load_modules()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE", help="default: all of them")
    parser.add_argument("--list", action="store_true", help="the modules and their tests")
    parser.add_argument("--report", action="store_true", help="print the last results only")
    parser.add_argument(
        "--resume", action="store_true", help="go on with an interrupted session (same copy)"
    )
    parser.add_argument("--timeout", type=float, help="per-mutant seconds (default 3x baseline)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="mutants tested at once, each in its own copy"
    )
    parser.add_argument("--work", type=Path, default=ROOT / ".mutate", help="work folder")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if m not in modules]
    if unknown:
        parser.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(modules)}")
    chosen = [modules[m] for m in args.modules] or list(modules.values())
    if args.list:
        for m in chosen:
            print(f"{m.name:20} {m.path}\n{'':20} {' '.join(covering_tests(m, ROOT))}")
        return
    if args.report:
        for m in chosen:
            if not report(m, args.work):
                print(f"## {m.name}: not run")
        return
    for m in chosen:
        run(m, args.work, fresh=not args.resume, timeout=args.timeout, jobs=args.jobs)


if __name__ == "__main__":
    main()
