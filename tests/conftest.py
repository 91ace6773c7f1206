import os

import pytest

from gcs_emulator import GcsEmulator


@pytest.fixture(scope="session", autouse=True)
def target_cache(tmp_path_factory):
    """Trained toy targets are cached per test session, never in the user's ~/.cache."""
    path = str(tmp_path_factory.mktemp("target_cache"))
    old = os.environ.get("PPGD_TPU_CACHE")
    os.environ["PPGD_TPU_CACHE"] = path
    yield path
    if old is None:
        os.environ.pop("PPGD_TPU_CACHE", None)
    else:
        os.environ["PPGD_TPU_CACHE"] = old


@pytest.fixture(scope="session")
def gcs_emulator():
    """A running fake-gcs-server with a bucket; the env points gcsfs and tensorstore at it."""
    emulator = GcsEmulator().start()
    yield emulator
    emulator.stop()
