"""`TrainerProtocol`: what every jaxloom trainer offers (EasyDeL's `BaseTrainerProtocol`)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TrainerProtocol(Protocol):
    """EasyDeL's `BaseTrainerProtocol`: what every trainer offers (`BaseTrainer` satisfies it)."""

    arguments: Any
    dataset_train: Any
    dataset_eval: Any

    @property
    def model(self) -> Any: ...
    @property
    def model_state(self) -> Any: ...
    @property
    def mesh(self) -> Any: ...
    @property
    def dtype(self) -> Any: ...
    @property
    def param_dtype(self) -> Any: ...
    @property
    def optimizer(self) -> Any: ...
    @property
    def scheduler(self) -> Any: ...

    def configure_model(self) -> Any:
        """Build the model state, its shardings and the optimizer."""

    def configure_dataloaders(self) -> Any:
        """Create the data loaders."""

    def configure_functions(self) -> Any:
        """Compile the train and eval steps."""

    def train(self) -> Any:
        """Run the training loop; returns the outcome."""

    def evaluate(self) -> dict[str, float]:
        """Metrics over the evaluation data."""

    def save_pretrained(self, path: Any, *, to_hf: bool = True) -> Any:
        """Write the model to `path` where it can be loaded again (a Hugging Face directory with `to_hf`)."""
