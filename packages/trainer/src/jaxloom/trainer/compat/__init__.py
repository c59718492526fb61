"""The compatibility layer: other projects' documented surfaces over jaxloom's trainer core, kept apart from it —
EasyDeL's `BaseTrainer` members (`ReferenceSurface`, mixed into the core trainer), EasyDeL's trainer protocol
(`BaseTrainerProtocol`) and RedCo's `Deployer`. The core (`jaxloom.trainer.trainer`) never needs these names."""

from .deployer import Deployer
from .protocol import BaseTrainerProtocol, TrainerProtocol
from .surface import ReferenceSurface

__all__ = ["BaseTrainerProtocol", "Deployer", "ReferenceSurface", "TrainerProtocol"]
