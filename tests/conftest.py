"""Fixtures shared by the test modules (helpers that are plain functions live in ``tests/helpers.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import twohosts
from tests.cases import CaseLaunches, Cases, worker_groups
from tests.helpers import SHARED_MNIST


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups from the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (``make test``): the groups of ``tests.cases.worker_groups``,
    those with the most tests that read cases first (``--no-loadscope-reorder`` hands them out in this order:
    the longest first)."""
    if config.getoption("loadgroup", False):  # pytest-xdist sets it in its workers for --dist loadgroup
        groups = worker_groups(items)
        for group, members in groups.items():
            for item in members:
                item.add_marker(pytest.mark.xdist_group(group))
        reading = {g: sum(1 for i in m if i.get_closest_marker("cases")) for g, m in groups.items()}
        items[:] = [i for g in sorted(groups, key=lambda g: -reading[g]) for i in groups[g]]


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory) -> Path | None:
    """A torchvision root holding real MNIST: the shared copy when present, else a download, else None."""
    if (SHARED_MNIST / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").exists():
        return SHARED_MNIST
    cache = tmp_path_factory.mktemp("mnist")
    try:
        from torchvision import datasets

        datasets.MNIST(str(cache), train=True, download=True)
        datasets.MNIST(str(cache), train=False, download=True)
    except Exception as err:  # no data and no network
        print(f"MNIST is absent and could not be downloaded: {err}")
        shutil.rmtree(cache, ignore_errors=True)
        return None
    return cache


@pytest.fixture
def two_hosts():
    """hostA and hostB as network namespaces joined by one link (``tests/twohosts.py``); always torn
    down. Skipped, with the reason, unless root with ``ip`` and ``unshare``."""
    twohosts.require()
    with twohosts.two_hosts() as hosts:
        yield hosts


@pytest.fixture(scope="session")
def case_launches(request, tmp_path_factory) -> CaseLaunches:
    """The session's many-case launches (``tests/cases.py``), gathered from the collected tests."""
    return CaseLaunches(tmp_path_factory.mktemp("cases"), request.session.items)


@pytest.fixture
def cases(request, case_launches) -> Cases:
    """The results of the cases this test declares with ``@pytest.mark.cases(...)``."""
    declared = [c for marker in request.node.iter_markers("cases") for c in marker.args]
    return Cases(case_launches, declared)
