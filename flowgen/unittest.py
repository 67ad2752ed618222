"""`flow.unittest`: OneFlow's test helpers under their names, so a project's OneFlow tests run here
with only the import line changed.

`skip_unless_<n>n<d>d()` runs a test only on `n` nodes with `d` devices each. The counts come from
`ONEFLOW_TEST_NODE_NUM` / `ONEFLOW_TEST_DEVICE_NUM` (OneFlow's variables) and otherwise from the
launcher (`flow.env`): a plain process is one node with one device, `python -m
flowgen.distributed.launch --nproc 2` is one node with two.
"""
from __future__ import annotations

import functools
import os
import unittest

from flowgen.distributed import env

TestCase = unittest.TestCase


def node_size() -> int:
    """Nodes this test run spans."""
    return int(os.getenv("ONEFLOW_TEST_NODE_NUM") or env.get_node_size())


def device_num() -> int:
    """Devices (processes) per node in this test run."""
    if os.getenv("ONEFLOW_TEST_DEVICE_NUM"):
        return int(os.environ["ONEFLOW_TEST_DEVICE_NUM"])
    return env.get_world_size() // max(node_size(), 1)


def skip_unless(nodes: int, devices: int):
    """A decorator that skips the test (or class) unless the run has `nodes` x `devices`."""
    if node_size() == nodes and device_num() == devices:
        return lambda test: test
    return unittest.skip(f"only runs when node_size is {nodes} and device_num is {devices}")


skip_unless_1n1d = functools.partial(skip_unless, 1, 1)
skip_unless_1n2d = functools.partial(skip_unless, 1, 2)
skip_unless_1n4d = functools.partial(skip_unless, 1, 4)
skip_unless_2n1d = functools.partial(skip_unless, 2, 1)
skip_unless_2n2d = functools.partial(skip_unless, 2, 2)
skip_unless_2n4d = functools.partial(skip_unless, 2, 4)


def dataset_dir(sub_dir: str | None = None) -> str:
    """Where test datasets live: `ONEFLOW_TEST_DATASET_DIR` (default /dataset), joined with `sub_dir`."""
    base = os.getenv("ONEFLOW_TEST_DATASET_DIR") or "/dataset"
    return base if sub_dir is None else os.path.join(base, sub_dir)
