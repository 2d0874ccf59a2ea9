"""Shared pytest setup: markers, and which backends this machine can run."""

import importlib

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU and cupy (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def cpu_backend_available() -> bool:
    from cyllm.errors import CyllmError
    try:
        importlib.import_module("cyllm.backends.cpu")
        return True
    except (ImportError, CyllmError):
        return False


HOST_BACKENDS = ["numpy"] + (["cpu"] if cpu_backend_available() else [])


@pytest.fixture(params=HOST_BACKENDS)
def host_backend(request):
    return request.param


@pytest.fixture(scope="session")
def default_model_file():
    """The real default model (SmolLM2-135M-Instruct GGUF), fetched once into the user cache."""
    from cyllm.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def default_model(default_model_file):
    """The default model loaded once per test session on the fastest host backend."""
    import cyllm
    return cyllm.load(default_model_file, backend=HOST_BACKENDS[-1])


def require_cuda():
    """cupy, or a skip of the calling test module when cupy or a GPU is missing."""
    cp = pytest.importorskip("cupy")
    try:
        n_gpu = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver, or a driver too old
        n_gpu = 0
    if n_gpu < 1:
        pytest.skip("no CUDA GPU visible", allow_module_level=True)
    return cp


def cuda_available() -> bool:
    """cupy imports and sees a GPU (tests marked cuda run only then)."""
    try:
        import cupy as cp
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device
        return False
