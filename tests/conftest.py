from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.harness import Cluster


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Start clusters on demand; every one is stopped (and its segment checked gone) after."""
    started: list[Cluster] = []

    def make(**kw: object) -> Cluster:
        cluster = Cluster(tmp_path / f"c{len(started)}", **kw)  # type: ignore[arg-type]
        cluster.tmp_path.mkdir()
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
        assert not os.path.exists(f"/dev/shm{cluster.shm_name}"), \
            f"segment left behind\n{cluster.launcher_log()[-3000:]}"
