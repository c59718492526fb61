"""jaxloom.ray: EasyDeL's `RayDistributedTrainer`, and a launcher that runs training as a supervised
gang of Ray actors (one JAX process each, one global mesh), restarts it from the newest checkpoint
when a worker dies or hangs, and sweeps with Ray Tune."""

from .__about__ import __version__
from .cluster import init_ray, shutdown_ray
from .config import RayDistributedConfig
from .distributed_trainer import RayDistributedTrainer
from .jobs import params_fingerprint, train_from_config
from .launcher import Failure, GangFailedError, LaunchResult, PlacementError, ScalingConfig, launch, probe_gang
from .tune import SweepResult, tune_sweep
from .worker import WorkerContext

__all__ = [
    "Failure",
    "GangFailedError",
    "LaunchResult",
    "RayDistributedConfig",
    "RayDistributedTrainer",
    "PlacementError",
    "ScalingConfig",
    "SweepResult",
    "WorkerContext",
    "__version__",
    "init_ray",
    "launch",
    "params_fingerprint",
    "probe_gang",
    "shutdown_ray",
    "train_from_config",
    "tune_sweep",
]
