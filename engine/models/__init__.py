"""Architectures, one module each, found by the GGUF's `general.architecture` name."""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import UnsupportedModel
from ..gguf_file import GGUFError, GGUFFile
from .base import BaseModel, KVGeometry

_NOT_ARCHITECTURES = {"base"}


def supported_architectures() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_ARCHITECTURES)


class UnsupportedArchitecture(UnsupportedModel, GGUFError):
    """A GGUF file whose architecture no module here implements."""


def _architecture_module(gguf: GGUFFile):
    arch = gguf.architecture
    module_name = arch.replace("-", "_")
    if module_name in _NOT_ARCHITECTURES or module_name not in supported_architectures():
        raise UnsupportedArchitecture(
            f"{gguf.path.name}: architecture {arch!r} is not supported; supported: "
            + ", ".join(supported_architectures())
        )
    return importlib.import_module(f"{__name__}.{module_name}")


def model_args(gguf: GGUFFile):
    """The architecture's arguments from metadata alone (no weights are read). Asked of the
    module's `Model` class, the one name every architecture module defines."""
    return _architecture_module(gguf).Model.args_from_gguf(gguf)


def kv_geometry(gguf: GGUFFile) -> KVGeometry:
    """The KV-cache geometry from metadata alone (no weights are read)."""
    return model_args(gguf).kv_geometry()


def load_model(gguf: GGUFFile) -> BaseModel:
    """Build the model the file's `general.architecture` names."""
    return _architecture_module(gguf).Model.from_gguf(gguf)
