"""`launch`: run a job as a gang of Ray actors, one JAX process each, and supervise it.

    result = launch(job, cfg_path, scaling=ScalingConfig(num_workers=2, devices_per_worker=2, max_failures=2))

`job(ctx, *args)` runs in every worker after `jax.distributed.initialize` (actor 0 is the
coordinator), so the workers form one global mesh. The driver watches them: when any worker dies
(SIGKILL, OOM, node loss), raises, or stops reporting progress for `progress_timeout_s`, the whole
gang is torn down and started again, up to `max_failures` times. A job that resumes from its newest
checkpoint (the trainer does, with `resume_if_possible`) then continues where it was.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from jaxloom.core.schema import NonNegativeInt, PositiveFloat, PositiveInt, config
from jaxloom.state.lock import OWNER_ENV

from .cluster import init_ray
from .worker import GangWorker, ProgressBoard

log = logging.getLogger("jaxloom.ray")

_TICK_S = 1.0  # the driver wakes at least this often (to see a stop request), and at once on a worker's end


class GangFailedError(RuntimeError):
    """The gang failed more than `max_failures` times: `message` says how the last attempt failed, and
    `failures` (also `.failures`) holds what happened each time."""

    def __init__(self, message: str, failures: list[Failure]):
        super().__init__(message)
        self.failures = failures

    def __reduce__(self):  # Ray and Tune copy and pickle errors: keep both arguments
        return type(self), (str(self), self.failures)


class PlacementError(ValueError):
    """The gang cannot be placed on the cluster: it asks for more than the cluster has (at once), or the
    resources did not become free within `startup_timeout_s`. The message gives both sides' numbers."""


@config
class ScalingConfig:
    """How to run the gang: Ray Train's names where the meaning is the same (`num_workers`, `use_gpu`,
    `resources_per_worker`, `placement_strategy`; `max_failures` as in its `FailureConfig`).

    Attributes:
      num_workers: JAX processes (Ray actors), one placement-group bundle each.
      use_gpu: each worker gets GPUs (one unless `resources_per_worker` says `GPU`) and runs JAX on CUDA.
      resources_per_worker: Ray resources per actor, e.g. `{"CPU": 1}` or `{"CPU": 8, "GPU": 1}`.
      placement_strategy: how the gang's placement group lays the workers over nodes: 'PACK' (few nodes),
        'SPREAD', 'STRICT_PACK' (one node), 'STRICT_SPREAD' (one worker per node). The gang is placed all
        or nothing.
      wait_for_resources: on a cluster that grows (an autoscaler), wait up to `startup_timeout_s` for a
        gang larger than the cluster instead of failing at once.
      devices_per_worker: on CPU, simulated devices per worker (None: one).
      platform: JAX platform for the workers (None: 'cuda' with `use_gpu`, else 'cpu').
      max_failures: gang restarts allowed before giving up (0: none).
      progress_timeout_s: a worker that reports no step for this long is taken as hung.
      report_interval_s: workers report progress (rank 0: metrics) at most this often, and on every
        checkpoint; the driver reads the board as often. At least 3 reports fit in `progress_timeout_s`.
      startup_timeout_s: allowed from start to the first step (includes compilation).
      heartbeat_timeout_s: JAX coordination heartbeat; a silent peer aborts the others after it.
      env: extra environment variables for the workers.
      storage_path: as Ray's `RunConfig.storage_path`: where runs write. A relative `save_directory`
        (also the one chosen when none is given) goes under it; an absolute one stays. It must be a
        directory every node mounts (NFS, a shared volume): each process checks before step 1 that it
        sees it, so a restart on another node finds the checkpoints. It holds run directories (logs,
        reports), so it is a mounted path, not a URI: to keep checkpoints in an object store, set the
        training argument `checkpoint_directory=gs://bucket/path`.
    """

    num_workers: PositiveInt = 1
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    wait_for_resources: bool = False
    devices_per_worker: PositiveInt | None = None
    platform: Literal["cpu", "gpu", "cuda", "tpu"] | None = None
    max_failures: NonNegativeInt = 0
    progress_timeout_s: PositiveFloat = 120.0
    report_interval_s: PositiveFloat = 2.0
    startup_timeout_s: PositiveFloat = 300.0
    heartbeat_timeout_s: PositiveInt = 10
    env: dict[str, str] | None = None
    storage_path: str | None = None

    def __post_init__(self) -> None:
        if self.storage_path is not None and ("://" in self.storage_path or not self.storage_path.strip()):
            raise ValueError(
                f"storage_path = {self.storage_path!r}; expected a directory every node mounts (NFS, a shared "
                "volume); for checkpoints in an object store, set checkpoint_directory=gs://bucket/path instead"
            )
        gpus = (self.resources_per_worker or {}).get("GPU", 0)
        if gpus and not self.use_gpu:
            raise ValueError(f"resources_per_worker asks for GPU={gpus} but use_gpu is false; set use_gpu=true")
        if self.use_gpu and self.platform == "cpu":
            raise ValueError("use_gpu=true with platform='cpu'; leave platform unset (cuda) or set use_gpu=false")
        if self.progress_timeout_s < 3 * self.report_interval_s:
            raise ValueError(
                f"progress_timeout_s={self.progress_timeout_s} with report_interval_s={self.report_interval_s}: "
                "a healthy worker would look hung; expected progress_timeout_s >= 3 × report_interval_s"
            )
        if any(v < 0 for v in (self.resources_per_worker or {}).values()):
            raise ValueError(f"resources_per_worker = {self.resources_per_worker}; expected amounts >= 0")
        if not self.bundle:
            raise ValueError(
                f"resources_per_worker = {self.resources_per_worker} gives a worker no resources; expected at "
                "least one amount > 0 (a placement group reserves something for each worker)"
            )

    @property
    def bundle(self) -> dict[str, float]:
        """One worker's Ray resources: `resources_per_worker` (CPU 1 by default), GPU 1 with `use_gpu`."""
        bundle = {"CPU": 1.0, **(self.resources_per_worker or {})}
        if self.use_gpu:
            bundle.setdefault("GPU", 1.0)
        return {k: float(v) for k, v in bundle.items() if v}

    @property
    def worker_platform(self) -> str:
        return self.platform or ("cuda" if self.use_gpu else "cpu")

    @classmethod
    def from_items(cls, items: list[str]) -> ScalingConfig:
        """`items` like `["num_workers=2", "max_failures=1"]` (the CLI's `--ray ...`) → a config; unknown
        keys are errors."""
        import yaml

        known = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for item in items:
            key, sep, raw = item.partition("=")
            if not sep or key not in known:
                raise ValueError(f"--ray {item!r}; expected key=value with key in {sorted(known)}")
            values[key] = yaml.safe_load(raw)
        return cls(**values)


@dataclasses.dataclass
class Failure:
    """One failed gang attempt: which `attempt`, which `rank` (None when unknown), the `kind` ('died',
    'error', 'hung'), the `message`, when the driver noticed (`detected_at`) and how long the next gang
    took to its first step (`restart_to_first_step_s`)."""

    attempt: int
    rank: int | None
    kind: str  # 'died', 'error', 'hung', or 'input' (deterministic: not retried)
    message: str
    detected_at: float  # time.time() on the driver
    restart_to_first_step_s: float | None = None  # filled once the next gang makes its first step


@dataclasses.dataclass
class LaunchResult:
    """What `launch` returns: every rank's return value (`results`; `.result` is rank 0's), how many gang
    `attempts` it took, the `failures` on the way, the wall time `wall_s`, and the `signal` that stopped
    it when the driver received one."""

    results: list[Any]  # what `job` returned, per rank
    attempts: int
    failures: list[Failure]
    wall_s: float
    signal: int | None = None

    @property
    def result(self) -> Any:
        return self.results[0]


def launch(
    job, *args: Any, scaling: ScalingConfig | None = None, on_report: Callable[[dict], Any] | None = None, **kwargs: Any
) -> LaunchResult:
    """Run `job(ctx, *args, **kwargs)` on `scaling.num_workers` actors as one JAX process group;
    restart the whole gang on any failure (up to `scaling.max_failures`). `job` and its arguments
    travel to the workers with Ray's serializer. Starts a local loopback cluster if Ray is not up.

    `on_report(report)` is called on the driver with each of rank 0's reports (its newest metrics, `step`
    and `checkpoint_dir`; every `report_interval_s` and after each checkpoint). By default, inside a Ray
    Tune trial or Ray Train worker, they go to `ray.tune.report`, so Tune's results and schedulers see
    the run as it trains."""
    import ray

    scaling = scaling or ScalingConfig()
    on_report = on_report if on_report is not None else _session_reporter()
    init_ray()
    # Every gang of this launch owns the run directory in turn: a restarted gang takes over its lock.
    token = f"ray-launch-{uuid.uuid4().hex}"
    scaling = dataclasses.replace(scaling, env={**(scaling.env or {}), OWNER_ENV: token})
    t0, failures = time.time(), []
    with _StopOnSignal() as stop:
        for attempt in range(scaling.max_failures + 1):
            try:
                outcome = _run_gang(ray, job, args, kwargs, scaling, attempt, failures, stop, on_report)
            except PlacementError as e:
                if not failures:
                    raise
                last = failures[-1]
                raise GangFailedError(
                    f"the gang failed ({last.kind} on rank {last.rank}: {last.message}) and cannot be placed "
                    f"again on what is left of the cluster: {e}. The newest complete checkpoint is kept: run "
                    "again when the cluster has the resources, and the job resumes from it",
                    failures,
                ) from e
            if not isinstance(outcome, Failure):
                return LaunchResult(outcome, attempt + 1, failures, time.time() - t0, stop.signum)
            failures.append(outcome)
            _give_up_or_log(outcome, attempt, scaling, failures, t0, stop)
    last = failures[-1]
    raise GangFailedError(
        f"the gang failed {len(failures)} time(s), more than max_failures="
        f"{scaling.max_failures}; last: {last.kind} on rank {last.rank}: {last.message}",
        failures,
    )


def _session_reporter() -> Callable[[dict], Any] | None:
    """`ray.tune.report` when this process is a Ray Tune trial (or a Ray Train worker), else None."""
    try:
        from ray.train._internal.session import get_session
    except ImportError:  # pragma: no cover - Ray without its train/tune libraries
        return None
    if get_session() is None:
        return None
    from ray import tune

    return lambda report: tune.report({k: v for k, v in report.items() if v is not None})


class _StopOnSignal:
    """SIGINT/SIGTERM to the driver (main thread only): the first asks the gang to stop (every rank
    finishes the same step, saves a checkpoint and returns); later ones are ignored until it has."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handler(self, signum, _frame) -> None:
        if self.requested:
            log.warning("signal %d again: the gang is saving its final checkpoint; waiting for it", signum)
            return
        log.warning("signal %d: asking the gang to finish its step, save a checkpoint and stop", signum)
        self.requested, self.signum = True, signum

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _give_up_or_log(outcome: Failure, attempt: int, scaling: ScalingConfig, failures, t0: float, stop) -> None:
    """After a failed attempt: raise when a restart cannot help (input errors) or was not wanted (the
    driver is stopping); otherwise log it (and the restart to come)."""
    if stop.requested:
        raise GangFailedError(
            f"the gang failed while stopping (rank {outcome.rank}, {outcome.kind}): {outcome.message}; "
            "not restarted, as a stop was requested. The newest complete checkpoint is kept.",
            failures,
        )
    if outcome.kind == "input":
        raise GangFailedError(
            f"the job failed on rank {outcome.rank} with an input error, which a restart would only repeat "
            f"(not retried): {outcome.message}",
            failures,
        )
    log.error(
        "gang attempt %d failed (%s, rank %s) after %.1f s: %s",
        attempt,
        outcome.kind,
        outcome.rank,
        outcome.detected_at - t0,
        outcome.message.splitlines()[0] if outcome.message else "",
    )
    if attempt < scaling.max_failures:
        log.warning(
            "restarting the gang (%d of %d restarts); the job resumes from its newest checkpoint",
            attempt + 1,
            scaling.max_failures,
        )


def _place(ray, scaling: ScalingConfig, attempt: int, stop):
    """The gang's placement group, ready (every bundle reserved), or PlacementError: at once when the
    cluster can never hold it, after `startup_timeout_s` when its resources stay busy (or at once when
    the driver is asked to stop while it waits)."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    bundle, n, strategy = scaling.bundle, scaling.num_workers, scaling.placement_strategy
    if not scaling.wait_for_resources:
        problem = never_fits(_alive(ray), bundle, n, strategy)
        if problem:
            raise PlacementError(problem)
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=f"jaxloom-gang-{attempt}")
    deadline = time.time() + scaling.startup_timeout_s
    while not pg.wait(timeout_seconds=max(1, min(_TICK_S, deadline - time.time()))):
        # A node that died a moment ago (a restart after a node loss) counts until Ray marks it dead:
        # look again each second, and fail as soon as what is alive can never hold the gang.
        problem = None if scaling.wait_for_resources else never_fits(_alive(ray), bundle, n, strategy)
        if time.time() < deadline and not stop.requested and not problem:
            continue
        remove_placement_group(pg)
        if stop.requested:
            raise GangFailedError("stopped while waiting for the cluster to place the gang", [])
        if problem:
            raise PlacementError(problem)
        raise PlacementError(
            f"the gang ({n} workers × {_amounts(bundle)}, placement_strategy={strategy}) could not be placed "
            f"within startup_timeout_s={scaling.startup_timeout_s} s; free now: "
            f"{_amounts({k: v for k, v in ray.available_resources().items() if k in bundle})}"
        )
    nodes = placement_group_table(pg).get("bundles_to_node_id", {})
    log.info(
        "gang attempt %d placed (%s) on %d node(s): %s",
        attempt,
        strategy,
        len(set(nodes.values())),
        ", ".join(f"rank {r} on {str(nodes.get(r, '?'))[:12]}" for r in range(n)),
    )
    return pg


def _alive(ray) -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def never_fits(nodes: list[dict[str, float]], bundle: dict[str, float], n: int, strategy: str) -> str | None:
    """Why `n` bundles `bundle` can never be placed with `strategy` on alive `nodes` (their total
    resources), or None when they can (once the resources are free)."""
    capacity = [int(min((res.get(k, 0.0) + 1e-9) // v for k, v in bundle.items())) for res in nodes]
    if strategy == "STRICT_PACK":
        ok, need = any(c >= n for c in capacity), f"one node with {_amounts({k: v * n for k, v in bundle.items()})}"
    elif strategy == "STRICT_SPREAD":
        ok, need = sum(c >= 1 for c in capacity) >= n, f"{n} nodes each with {_amounts(bundle)}"
    else:
        ok, need = sum(capacity) >= n, f"{n} × {_amounts(bundle)} over its nodes"
    if ok:
        return None
    have = "; ".join(f"node {i}: {_amounts({k: res.get(k, 0.0) for k in bundle})}" for i, res in enumerate(nodes))
    return (
        f"the gang cannot be placed: num_workers={n} with placement_strategy={strategy} needs {need}; the cluster "
        f"has {len(nodes)} node(s) ({have or 'none alive'}). Ask for fewer workers or resources per worker, "
        "another placement_strategy, or add nodes (wait_for_resources=true waits for an autoscaler)"
    )


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in resources.items())


def _start(ray, scaling: ScalingConfig, pg, attempt: int):
    """The progress board and the workers of one gang attempt, in placement group `pg` (rank r in bundle
    r); each worker gets exactly its bundle's resources (Ray sets CUDA_VISIBLE_DEVICES to its GPUs)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    settings = {
        "platform": scaling.worker_platform,
        "devices": scaling.devices_per_worker,
        "env": scaling.env,
        "heartbeat_timeout_s": scaling.heartbeat_timeout_s,
        "report_interval_s": scaling.report_interval_s,
        "init_timeout_s": min(int(scaling.startup_timeout_s), 300),
    }
    resources = dict(scaling.bundle)
    options = {
        "num_cpus": resources.pop("CPU", 0),
        "num_gpus": resources.pop("GPU", 0),
        "resources": resources or None,
        "max_restarts": 0,
        "max_concurrency": 2,
    }

    def bundle(r: int):
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)

    # The board lives beside rank 0, in its bundle: on a node the gang was just placed on (a node that
    # died a moment ago may not be known dead yet to the scheduler), and it goes with the gang.
    board = ray.remote(ProgressBoard).options(num_cpus=0, scheduling_strategy=bundle(0)).remote()
    worker_cls = ray.remote(GangWorker)
    workers = [
        worker_cls.options(**options, scheduling_strategy=bundle(r)).remote(
            r, scaling.num_workers, attempt, board, settings
        )
        for r in range(scaling.num_workers)
    ]
    return board, workers


def probe_gang(scaling: ScalingConfig | None = None) -> list[dict[str, Any]]:
    """Place the gang `scaling` describes exactly as `launch` would and return what each rank's worker
    sees, without starting JAX: its `node_id`, `gpu_ids` (Ray's), `CUDA_VISIBLE_DEVICES` and
    `JAX_PLATFORMS`. For checking a cluster (or a config) before a long run; the gang is released
    afterwards. PlacementError as in `launch`."""
    import ray

    scaling = scaling or ScalingConfig()
    init_ray()
    from ray.util.placement_group import remove_placement_group

    pg = _place(ray, scaling, 0, _StopOnSignal())
    board, workers = None, []
    try:
        board, workers = _start(ray, scaling, pg, 0)
        return ray.get([w.visible.remote() for w in workers], timeout=scaling.startup_timeout_s)
    finally:
        for w in [*workers, board]:
            if w is not None:
                ray.kill(w, no_restart=True)
        remove_placement_group(pg)


def _run_gang(ray, job, args, kwargs, scaling: ScalingConfig, attempt: int, failures: list[Failure], stop, on_report):
    from ray.util.placement_group import remove_placement_group

    pg = _place(ray, scaling, attempt, stop)  # all or nothing; outside any placement group of a caller (Tune's)
    board, workers, started = None, [], time.time()
    try:
        board, workers = _start(ray, scaling, pg, attempt)
        coordinator = ray.get(workers[0].coordinator_address.remote(), timeout=scaling.startup_timeout_s)
        refs = [w.run.remote(coordinator, job, args, kwargs) for w in workers]
        return _supervise(ray, refs, board, scaling, attempt, started, failures, stop, on_report)
    except ray.exceptions.GetTimeoutError:
        return Failure(attempt, 0, "hung", f"workers did not start within {scaling.startup_timeout_s} s", time.time())
    except ray.exceptions.RayActorError as e:
        return Failure(attempt, 0, "died", str(e), time.time())
    finally:
        for w in [*workers, board]:
            if w is not None:
                ray.kill(w, no_restart=True)
        remove_placement_group(pg)  # a restart places the gang again, on the nodes alive then


def _supervise(ray, refs, board, scaling, attempt: int, started: float, failures: list[Failure], stop, on_report):
    """Wait for the gang: a worker's end (its result, error or death) wakes the driver at once; the board
    is read every `report_interval_s` without blocking on it (beats, hangs, rank 0's reports); a stop
    request is seen within a second. Returns the results, or the attempt's Failure."""
    pending, results, first_step_seen, stop_sent = list(refs), {}, False, False
    asked, asked_at, answered_at = board.snapshot.remote(), time.time(), None
    while pending:
        if stop.requested and not stop_sent:  # the workers read it from their next beats
            board.request_stop.remote()
            stop_sent = True
        done, pending = ray.wait(pending, num_returns=1, timeout=min(_TICK_S, scaling.report_interval_s))
        if done and pending:  # whatever else ended meanwhile
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            done += more
        errors = []
        for ref in done:
            rank = refs.index(ref)
            try:
                results[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                errors.append(Failure(attempt, rank, "died", _last_line(e), time.time()))
            except ray.exceptions.RayTaskError as e:
                kind = "input" if _deterministic(e) else "error"
                errors.append(Failure(attempt, rank, kind, _last_line(e), time.time()))
        if errors:
            # A death is the cause; the survivors' collective errors are its echo. Let them surface briefly.
            more, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0) if pending else ([], [])
            for ref in more:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    errors.append(Failure(attempt, refs.index(ref), "died", _last_line(e), time.time()))
                except ray.exceptions.RayTaskError:
                    pass
            return min(errors, key=lambda f: (f.kind != "died", f.detected_at))
        if asked is not None and ray.wait([asked], timeout=0)[0]:
            beats, reports, first_step_ago = ray.get(asked)
            asked, answered_at = None, time.time()
            for report in reports:
                if on_report is not None:
                    on_report(report)
            if first_step_ago is not None and not first_step_seen:
                first_step_seen = True
                _note_restart_time(failures, attempt, first_step_ago)
            hung = _hung_rank(beats, scaling, time.time() - started, {refs.index(r) for r in pending})
            if hung is not None:
                rank, age, step = hung
                return Failure(
                    attempt,
                    rank,
                    "hung",
                    f"rank {rank} made no progress for {age:.1f} s (last step "
                    f"{step}; limit {scaling.progress_timeout_s} s)",
                    time.time(),
                )
        elif asked is not None:
            # The board starts with the gang (a process of its own): as long as the workers may take.
            limit = scaling.startup_timeout_s if answered_at is None else max(scaling.progress_timeout_s, 30.0)
            if time.time() - asked_at > limit:
                return Failure(attempt, None, "hung", f"the progress board did not answer in {limit:g} s", time.time())
        if asked is None and time.time() - (answered_at or 0.0) >= scaling.report_interval_s:
            asked, asked_at = board.snapshot.remote(), time.time()
    # What rank 0 reported since the board was last read, and when training began if the gang was done
    # before the board was read after its first step.
    try:
        _, reports, first_step_ago = ray.get(board.snapshot.remote(), timeout=30)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        log.warning("the progress board did not answer at the end; its last reports are not passed on")
    else:
        for report in reports:
            if on_report is not None:
                on_report(report)
        if first_step_ago is not None and not first_step_seen:
            _note_restart_time(failures, attempt, first_step_ago)
    return [results[r] for r in range(len(refs))]


def _note_restart_time(failures: list[Failure], attempt: int, first_step_ago: float) -> None:
    """The time from the failure's detection to the first step of the gang that followed it (`ago`:
    seconds since that step, by the board's clock)."""
    if failures and failures[-1].restart_to_first_step_s is None:
        failures[-1].restart_to_first_step_s = max(0.0, time.time() - first_step_ago - failures[-1].detected_at)
        log.warning(
            "gang attempt %d: training resumed %.1f s after the failure was detected",
            attempt,
            failures[-1].restart_to_first_step_s,
        )


def _hung_rank(beats: dict, scaling: ScalingConfig, since_start: float, running: set[int]):
    for rank in sorted(running):
        if rank not in beats or beats[rank][2] != "step":  # still starting (joining, compiling)
            if since_start > scaling.startup_timeout_s:
                return rank, since_start, None
            continue
        age, step, _ = beats[rank]
        if age > scaling.progress_timeout_s:
            return rank, age, step
    return None


def _deterministic(e: BaseException) -> bool:
    """Whether a job's error would recur on a restart: bad input or settings (`ValueError`, `TypeError`),
    not a death, a hang, a collective's failure or I/O."""
    cause = getattr(e, "cause", None)
    return isinstance(cause, ValueError | TypeError) and not isinstance(cause, OSError) and not _collective(cause)


def _collective(cause: BaseException) -> bool:
    text = str(cause).lower()
    return any(word in text for word in ("gloo", "collective", "coordination", "heartbeat", "barrier", "nccl"))


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)\b(: .*)?$")
_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def _last_line(e: BaseException) -> str:
    """What a worker's error says, from a Ray error's text (the worker's traceback): the exception line itself
    (not the notes after it, such as jaxloom's "training stopped during step N", which are appended), where it
    was raised (the innermost `file:line, in function`), then those notes."""
    lines = [ln.rstrip() for ln in str(e).strip().splitlines() if ln.strip()]
    found = [i for i, ln in enumerate(lines) if _EXCEPTION_LINE.match(ln.strip())]
    if not found:
        return lines[-1] if lines else type(e).__name__
    at = found[-1]
    frame = next((m for ln in reversed(lines[:at]) if (m := _FRAME_LINE.match(ln))), None)
    where = f" (at {frame.group(1)}:{frame.group(2)}, in {frame.group(3)})" if frame else ""
    notes = " ".join(ln.strip() for ln in lines[at + 1 :])
    return lines[at].strip() + where + (f"; {notes}" if notes else "")
