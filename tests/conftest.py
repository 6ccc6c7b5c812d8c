"""Fixtures shared by the test modules (helpers that are plain functions live in ``tests/helpers.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import twohosts
from tests.cases import CaseLaunches, Cases
from tests.helpers import SHARED_MNIST


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
