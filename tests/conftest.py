"""Test set-up: one intra-op thread per process, so CPU matmuls are reproducible across runs."""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
