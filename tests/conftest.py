import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives Debian chromium via playwright")
    config.addinivalue_line("markers", "notebooks: executes the lesson notebooks (nbval)")
    config.addinivalue_line("markers", "slow: the whole composition matrix; run with -m slow")


def pytest_collection_modifyitems(config, items):
    """`slow` tests run only when asked for by marker (`pytest -m slow`): `make test` stays
    within CI's time."""
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def in_ci() -> bool:
    return os.environ.get("CI") == "true"
