"""Sessions: `demo` (the main job), `tests` (each part in its own venv, then the meta-package and
cross-package tests), `docs` (the site), `bench`, `lint`.

    python3 -m pip install nox uv && python3 -m nox -s demo
    python3 -m pip install nox uv && python3 -m nox -s tests
"""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent / "tools"))
import parts  # noqa: E402

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True

# XLA's CPU compiler without LLVM's optimisations: the tests' programs are tiny, so compiling is most of their time
# and running them barely moves (measured: the models target's sharded, expert-parallel, scanned-MoE and loss modules
# took 350 s with LLVM's -O2 and 197 s without, every case passing). Tests that start processes with their own
# XLA_FLAGS (one or two devices) append these.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA's older CPU fusion emitters, where the session's jaxlib still has them (0.10; 0.12 removed the flag, and an
# unknown flag aborts every process, so each session asks its own jaxlib first: `test_env`). Programs compile faster
# with them and some run slower (a scatter, the embedding's gradient, becomes a loop). Two clean-clone runs on this
# machine, one with the flag everywhere and one without (test time summed over each target's cases): models 505 vs
# 534 s, generation 119 vs 132, trainer 1,612 vs 1,796 (its cases that run hundreds of steps slower, the rest
# faster), but ray 461 vs 442 and the meta target's wall time 688 vs 598 s (its examples and process runs train
# longer than they compile). So: the targets where compiling is most of the time.
FAST_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FAST_EMITTER_TARGETS = {"models", "generation", "trainer"}
HUGEPAGES = "glibc.malloc.hugetlb=1"
# Many simulated devices on one CPU; never a GPU in tests.
TEST_ENV = {
    "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}",
    "JAXLOOM_TEST_XLA_FLAGS": TEST_XLA_FLAGS,
    "JAX_PLATFORMS": "cpu",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "PYTHONHASHSEED": "0",
    # glibc's malloc asks for transparent huge pages (what the `jaxloom` program does for itself: jaxloom.core.host):
    # XLA's CPU runtime maps a step's temporaries afresh every step; faulting them in 4 KiB at a time cost the
    # bench's 18-layer CPU Llama ~14 % of its tokens/s (docs/performance.md). Read at process start: set here.
    "GLIBC_TUNABLES": HUGEPAGES,
    # JAX's persistent compilation cache, shared by every target, test, worker and subprocess of one `nox -s tests`
    # (a CI run starts it empty): the same tiny model's steps compile once, not once per test and per `jaxloom
    # train` subprocess. Every program gets a file: the many small ones (a digest, a cast, a sampler step) took 50 ms
    # each to compile and load in a few ms; a `jaxloom train` subprocess took 7.1-7.6 s with them against 7.8-9.2 s
    # without. No size limit: with one, JAX takes a lock and reads every entry's size and access time on each write
    # (the cache reaches ~2,600 entries in a run), and the generation target took 109 s against 82 s with an empty
    # cache. Without it an entry read while another process writes it fails to load and is compiled again (JAX warns).
    "JAX_COMPILATION_CACHE_DIR": str(Path(__file__).resolve().parent / ".nox" / "jax-compilation-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    # Python's compiled bytecode written and reused (an empty value turns the setting off: some images set it).
    # Without it every process compiles the ~1,300 modules it imports from source again: 5 of a `jaxloom train`
    # subprocess's 7 seconds of imports, in each test's subprocess, each xdist worker and each Ray worker.
    "PYTHONDONTWRITEBYTECODE": "",
}
TARGETS = (*parts.PARTS, parts.META)
# Parts whose tests compare against transformers' PyTorch models. Torch is installed from a local CPU
# wheel only: a plain `torch` requirement would download a multi-GB CUDA build.
NEEDS_TORCH = {"models", "state", "generation", "trainer"}
# Targets whose tests run side by side (pytest-xdist, a worker per core up to 4). Not ray: its modules on two
# workers (`--dist loadfile`, a local cluster each) took 268 s against 364 s serial in one measurement, but 368 s
# against 360 s in the clean-clone runs (its Ray workers compile as much as they wait, and the launcher module
# alone holds one worker ~290 s), with the hang-detection case near its time limit.
PARALLEL = {"models", "state", "generation", "trainer", parts.META}
# Targets whose cases mostly wait (subprocess runs joined over gloo, store servers, outages and leases timed
# in seconds): one worker more than the cores. The meta target kept 2 cores 74 % busy with a worker per core.
WAITING = {parts.META}
XDIST = "pytest-xdist>=3.5"
# Each target's slowest cases, printed at its end: the suite's time (35 minutes at most) is watched case by case.
DURATIONS = ["--durations=15", "--durations-min=10"]
# Targets with cases marked `alone` (pyproject's markers): run after the rest, without xdist.
ALONE = {parts.META}
# DPOTrainer's numbers are compared with TRL's DPOTrainer (test-only; installed next to the local CPU torch).
NEEDS_TRL = {"trainer"}
TRL = "trl==1.16.0"
# LoRA / QLoRA adapters are read and written against PEFT itself (test-only; after the CPU torch, like TRL).
NEEDS_PEFT = {"models", "trainer"}
PEFT = "peft>=0.17"
TORCH_WHEELS = "/opt/wheels/torch-2.13.0+cpu-*.whl"
# Lint and format check (ruff, settings in pyproject.toml); the meta target runs them, so CI does.
LINT_DEPS = ("ruff>=0.6",)
# The type check (mypy, settings in pyproject.toml) over every part's sources; the meta target runs it.
TYPE_DEPS = ("mypy>=1.10",)
# The documentation site (mkdocs.yml); the meta target builds it too, so CI checks it.
DOCS_DEPS = ("mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26")


def test_env(session: nox.Session, target: str) -> dict[str, str]:
    """`TEST_ENV`, with `FAST_EMITTERS` added to the XLA flags for `FAST_EMITTER_TARGETS` when the session's jaxlib
    takes the flag."""
    import subprocess

    if target not in FAST_EMITTER_TARGETS:
        return dict(TEST_ENV)
    probe = subprocess.run(
        [str(Path(session.bin) / "python"), "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": FAST_EMITTERS, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        check=False,
    )
    if probe.returncode:
        session.log(f"this jaxlib does not take {FAST_EMITTERS}: the tests compile with its default emitters")
        return dict(TEST_ENV)
    return {
        **TEST_ENV,
        "XLA_FLAGS": f"{TEST_ENV['XLA_FLAGS']} {FAST_EMITTERS}",
        "JAXLOOM_TEST_XLA_FLAGS": f"{TEST_XLA_FLAGS} {FAST_EMITTERS}",
    }


def install_parts(session: nox.Session, names: list[str], extra: str = "test") -> None:
    """Install local parts (not editable: the real wheel layout) and rebuild them every time, since
    uv would otherwise reuse a wheel it built earlier from the same folder."""
    args = [f"./packages/{n}[{extra}]" for n in names]
    if session.venv_backend == "uv":
        for n in names:
            args += ["--reinstall-package", f"jaxloom-{n}" if n != parts.META else parts.META]
    session.install(*args)


# Every part on the Python the project is developed on, then a smoke run on the newest Python, where pip
# resolves the newest JAX: a user there gets it, so a few steps, a checkpoint and a resume run on it too.
SMOKE = "py312-smoke"


def _python_312() -> str:
    """A Python 3.12 interpreter: one on PATH that runs, else a pyenv install (its `python3.12` shim fails
    unless 3.12 is pyenv's selected version, and uv cannot download interpreters here)."""
    import shutil
    import subprocess

    candidates = [shutil.which("python3.12") or ""]
    candidates += sorted(glob.glob(str(Path.home() / ".pyenv/versions/3.12*/bin/python3.12")), reverse=True)
    candidates += sorted(glob.glob("/usr/local/bin/python3.12")) + sorted(glob.glob("/usr/bin/python3.12"))
    for exe in filter(None, candidates):
        try:
            if subprocess.run([exe, "-c", "import sys"], capture_output=True, timeout=30).returncode == 0:
                return exe
        except (OSError, subprocess.TimeoutExpired):
            continue
    return "3.12"  # let nox report it missing


SMOKE_PYTHON = _python_312()


@nox.session
@nox.parametrize(
    "python,target",
    [("3.11", t) for t in TARGETS] + [(SMOKE_PYTHON, SMOKE)],
    ids=[f"target='{t}'" for t in (*TARGETS, SMOKE)],
)
def tests(session: nox.Session, target: str) -> None:
    """One part in a venv holding only the parts it declares (an undeclared import fails), then its tests.
    The `jaxloom` target installs everything and also runs the cross-package tests in tests/. The
    `py312-smoke` target installs the trainer's closure on Python 3.12 with the newest JAX and runs
    tests/smoke (train, checkpoint, resume)."""
    start = time.perf_counter()
    if target == SMOKE:
        install_parts(session, parts.closure("trainer"))
        session.run("python", "-c", "import jax, sys; print('python', sys.version.split()[0], 'jax', jax.__version__)")
        session.run("pytest", "tests/smoke", *session.posargs, env=test_env(session, target))
        session.log(f"tests({target}) took {time.perf_counter() - start:.1f} s")
        return
    install_parts(session, parts.closure(target) if target != parts.META else [*parts.PARTS, parts.META])
    if target in NEEDS_TORCH:
        wheels = sorted(glob.glob(TORCH_WHEELS))
        if wheels:
            session.install(wheels[-1])
            if target in NEEDS_TRL:  # after torch: TRL must not pull a CUDA build of it
                session.install(TRL)
            if target in NEEDS_PEFT:  # after torch, for the same reason
                session.install(PEFT)
        else:
            session.warn(f"no local CPU torch wheel ({TORCH_WHEELS}): parity tests against transformers will skip")
    paths = [f"packages/{target}/tests"]
    if target == parts.META:
        session.install(
            "uv", "hatchling", "nox", *LINT_DEPS, *TYPE_DEPS, *DOCS_DEPS
        )  # venvs, wheels, docs, checks, demo
        lint(session)
        typed = typecheck_started(session)  # beside the tests, which mostly wait on subprocesses and servers
        paths.append("tests")
    paths = [p for p in paths if Path(p).is_dir()]
    if not paths:
        session.log(f"{target}: no tests yet")
    else:
        # Exit code 5 (no tests collected) is not a failure for a placeholder part.
        skip = ["--ignore=tests/smoke"] if target == parts.META else []  # the smoke run is its own target
        workers = []
        if target in PARALLEL and (os.cpu_count() or 1) > 1:  # compiles are single-threaded: 2 cores, 2 tests
            session.install(XDIST)
            count = min(4, os.cpu_count() or 1) + (1 if target in WAITING else 0)
            # worksteal: a worker that runs out takes queued cases from a busy one (no idle tail behind a long case)
            workers = ["-n", str(count), "--dist", "worksteal"]
        env = test_env(session, target)
        if workers and target in ALONE:  # the cases marked `alone` after the others, with no worker beside them
            session.run("pytest", *paths, *skip, *workers, *DURATIONS, "-m", "not alone", *session.posargs, env=env)
            session.run("pytest", *paths, *skip, "-m", "alone", *session.posargs, env=env)
        else:
            session.run("pytest", *paths, *skip, *workers, *DURATIONS, *session.posargs, env=env, success_codes=[0, 5])
    if target == parts.META:
        typed()
    session.log(f"tests({target}) took {time.perf_counter() - start:.1f} s")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job: a small Llama trained on the bundled corpus with the bundled tokenizer, on CPU.
    Extra arguments are `key=value` overrides: `nox -s demo -- max_training_steps=50`."""
    install_parts(session, parts.closure("trainer"), extra="test")
    out = next((a.split("=", 1)[1] for a in session.posargs if a.startswith("save_directory=")), "jaxloom-runs/demo")
    code = run_demo(session, out)
    session.log(f"outputs in {out}/: report.md, loss.png, metrics.jsonl, tensorboard/, checkpoints/")
    if code == 4:
        session.log(f"{out} was already complete: raise max_training_steps=... to continue it")
    if code:
        raise SystemExit(code)  # nox itself then exits with jaxloom's code (4: finished; 130: interrupted; ...)


def run_demo(session: nox.Session, out: str) -> int:
    """`jaxloom train save_directory=OUT *posargs` in the session's environment, its output streamed; returns
    its exit code (nox's `session.run` returns True, not the code, and fails on any code it does not expect)."""
    import subprocess

    cmd = [str(Path(session.bin) / "jaxloom"), "train", f"save_directory={out}", *session.posargs]
    env = {**os.environ, **{k: v for k, v in session.env.items() if v is not None}}
    env.update(PATH=os.pathsep.join([session.bin, env.get("PATH", "")]), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    session.log(" ".join(cmd[1:]))
    return subprocess.run(cmd, env=env, check=False).returncode


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks as ratios against bare JAX measured in the same run (tools/bench/run.py), and the peer rows
    (TRL, PEFT) when a local CPU torch wheel exists. CPU by default; the GPU rows run when JAX sees a GPU
    (install jax[cuda] into the session). Checkpoint formats and stores: tools/bench/storage_rows.py."""
    # Byte-compiled as pip installs do by default (uv does not): start-up times must not include
    # compiling every imported module from source, which PYTHONDONTWRITEBYTECODE would repeat per run.
    session.env["UV_COMPILE_BYTECODE"] = "1"
    install_parts(session, parts.closure("ray"), extra="test")  # the trainer's closure (and generation), and ray
    wheels = sorted(glob.glob(TORCH_WHEELS))
    if wheels:
        session.install(wheels[-1])
        session.install(TRL, "peft")
    session.run("python", "tools/bench/run.py", env={"TF_CPP_MIN_LOG_LEVEL": "3", **session.env})


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs, API reference from docstrings) into site/, warnings as errors.
    Fails first if a public name lacks a docstring or a docstring leaves out an argument."""
    install_parts(session, [*parts.PARTS, parts.META], extra="test")
    session.install(*DOCS_DEPS)
    session.run("python", "tools/check_docstrings.py")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})
    session.log("site built in site/ (open site/index.html, or `mkdocs serve`)")


@nox.session(python="3.11", name="lint")
def lint_session(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree, and the type check (also part of `nox -s tests`)."""
    install_parts(session, [*parts.PARTS, parts.META])
    session.install(*LINT_DEPS, *TYPE_DEPS)
    lint(session)
    typecheck(session)


def lint(session: nox.Session) -> None:
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def typecheck_started(session: nox.Session):
    """`typecheck` started in the background (about 20 s of one core); returns the function that waits for it and
    fails the session, printing mypy's report, when it finds anything."""
    import subprocess
    import tempfile

    report = tempfile.TemporaryFile(mode="w+")
    command = [str(Path(session.bin) / "mypy"), *sorted(glob.glob("packages/*/src/jaxloom"))]
    proc = subprocess.Popen(command, stdout=report, stderr=subprocess.STDOUT, text=True)

    def wait() -> None:
        code = proc.wait()
        report.seek(0)
        text = report.read().strip()
        if code:
            session.error(f"mypy (exit {code}):\n{text}")
        session.log(text.splitlines()[-1] if text else "mypy: no output")

    return wait


def typecheck(session: nox.Session) -> None:
    """mypy over the installed parts' sources (the venv has every dependency, so types resolve)."""
    session.run("mypy", *sorted(glob.glob("packages/*/src/jaxloom")))
