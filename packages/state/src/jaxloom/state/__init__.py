"""jaxloom.state: the train state, checkpoints that survive anything, and Hugging Face export."""

from .__about__ import __version__
from .checkpoint import CheckpointConfig, CheckpointCorruptError, CheckpointManager, CheckpointSaveError, Restored
from .convert import convert_checkpoint
from .lock import DirectoryLock, DirectoryLockedError, LeaseLostError, StoreLease
from .export import save_pretrained
from .shared import check_shared_directory
from .step_names import newest_generation, parse_step_name, step_folders, step_name
from .serialization import from_jsonable, load_json, save_json, to_jsonable
from .train_state import TrainState, abstract_state, convert_model_to_state, state_shardings

__all__ = [
    "DirectoryLock",
    "DirectoryLockedError",
    "CheckpointConfig",
    "CheckpointCorruptError",
    "CheckpointManager",
    "CheckpointSaveError",
    "LeaseLostError",
    "Restored",
    "StoreLease",
    "TrainState",
    "__version__",
    "abstract_state",
    "check_shared_directory",
    "convert_checkpoint",
    "convert_model_to_state",
    "from_jsonable",
    "parse_step_name",
    "load_json",
    "newest_generation",
    "save_json",
    "save_pretrained",
    "state_shardings",
    "step_folders",
    "step_name",
    "to_jsonable",
]
