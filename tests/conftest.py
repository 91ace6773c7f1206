import pytest

from gcs_emulator import GcsEmulator


@pytest.fixture(scope="session")
def gcs_emulator():
    """A running fake-gcs-server with a bucket; the env points gcsfs and tensorstore at it."""
    emulator = GcsEmulator().start()
    yield emulator
    emulator.stop()
