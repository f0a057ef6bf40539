import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives Debian chromium via playwright")
    config.addinivalue_line("markers", "notebooks: executes the lesson notebooks (nbval)")


@pytest.fixture(scope="session")
def in_ci() -> bool:
    return os.environ.get("CI") == "true"
