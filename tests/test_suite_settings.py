"""The suite-wide settings of ``tests/conftest.py`` reach the test processes."""

from __future__ import annotations

import os
import sys

import torch


def test_one_intra_op_thread_from_the_environment():
    """conftest sets ``OMP_NUM_THREADS`` (default 1) without importing torch; torch reads it at its first import."""
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_bytecode_caches_are_written():
    assert sys.dont_write_bytecode is False
