import json
import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives Debian chromium via playwright")
    config.addinivalue_line("markers", "notebooks: executes the lesson notebooks (nbval)")
    config.addinivalue_line("markers", "slow: the whole composition matrix; run with -m slow")
    config.addinivalue_line("markers", "gpu: a lent GPU machine's checks (make test-gpu, -m gpu)")
    config.addinivalue_line("markers", "alone: a wall-time bound on a real server; make test runs "
                            "it after its workers, with the machine to itself")


def pytest_collection_modifyitems(config, items):
    """`slow` and `gpu` tests run only when asked for by marker (`pytest -m slow`, `-m gpu`):
    `make test` stays within CI's time, and the GPU machine's checks run there alone."""
    asked = config.getoption("-m") or ""
    for marker, how in (("slow", "run with -m slow"), ("gpu", "a GPU machine's check: make test-gpu")):
        if marker in asked:
            continue
        skip = pytest.mark.skip(reason=f"{marker}: {how}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
    # the lesson notebooks first: with `make test`'s two workers (pytest-xdist, --dist loadfile),
    # their file is the longest piece of work, so it goes out before the many short ones
    items.sort(key=lambda item: "notebooks" not in item.keywords)


@pytest.fixture(scope="session")
def in_ci() -> bool:
    return os.environ.get("CI") == "true"


@pytest.fixture(scope="module")
def one_thread():
    """In-process simulations on one thread, as every rank runs (launch.py): on a loaded 2-core
    machine torch's default two threads spin against each other (seen: 70x the wall time). A module
    asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_run():
    """`shared_run(cfg)`: launch.run(cfg), run once per configuration for the whole session and
    shared by every test that asks for the same RunConfig (a report is read, never changed: treat
    it as frozen). Ranks are the suite's main cost on CI's 2 cores; a configuration that several
    tests read is paid once."""
    from parallel_mini.runtime.launch import run

    reports: dict = {}

    def shared(cfg):
        key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
        if key not in reports:
            reports[key] = run(cfg)
        return reports[key]

    return shared
