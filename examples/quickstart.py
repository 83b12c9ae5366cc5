"""Run a small Wan 2.2-shaped pipeline (random weights, built in code) under a memmode and print its ledger."""

import sys
import time

import torch

import memmode_core as memmode
from memmode_core.demo import build_demo_pipeline, demo_call

mode = sys.argv[1] if len(sys.argv) > 1 else "model_group_offload"
pipe = build_demo_pipeline(seed=0)
handle = memmode.apply(pipe, mode)
start = time.perf_counter()
frames = demo_call(pipe, seed=0)
print(f"{mode}: {tuple(frames.shape)} frames in {time.perf_counter() - start:.2f}s")
print(handle.report())
handle.remove()
