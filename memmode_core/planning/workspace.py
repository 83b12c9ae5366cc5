"""Memory a kernel allocates for itself while it runs: the workspace a fake run cannot see.

A dispatch-level count (:class:`memmode_core.planning.live_bytes.LiveBytes`) sees each operation's inputs and
outputs. Some kernels also allocate temporaries of their own, freed before they return, which are on the
device at the same time as everything live — a convolution's unfolded input, a blocked copy of its weight, the
attention kernel's per-thread score tiles. They can dominate a VAE's peak (a 3x3 convolution's unfolded input
is nine times its input), and no fake tensor makes them, so :func:`workspace_bytes` computes them from the
operation's shapes with the rules of the kernel PyTorch will pick on that device.

Rules exist for the CPU kernels in float32 (PyTorch chooses the convolution backend with its own selector,
called on the fake tensors; each rule is checked against the profiler's allocations in
``tests/test_activation_prediction.py``). Elsewhere — an accelerator's libraries (cuBLAS, cuDNN, flash
attention) pick their algorithm and its workspace at run time, oneDNN's reduced-precision kernels convert
through buffers of their own — the size is not modelled: :func:`workspace_bytes` says so with ``None`` rather
than guess 0, the trace names those operations, and ``docs/planner.md`` says what margin to leave.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

aten = torch.ops.aten

#: oneDNN stores activations and weights in blocks of this many channels
_ONEDNN_BLOCK = 16
#: what oneDNN allocates besides its reorders (tens of bytes were seen; a margin)
_ONEDNN_SMALL_BUFFERS = 8192


#: operations whose kernels allocate a workspace of their own
_WITH_WORKSPACE = (aten.convolution.default, aten._scaled_dot_product_flash_attention_for_cpu.default)


def workspace_bytes(func, args: Sequence, kwargs: dict, device: torch.device) -> int | None:
    """Bytes ``func(*args, **kwargs)`` allocates and frees inside its kernel on ``device``: 0 for an operation
    that allocates nothing but its outputs, ``None`` where the kernel has a workspace whose size is not
    modelled (see the module docstring)."""
    if func not in _WITH_WORKSPACE:
        return 0
    reduced = any(isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16) for v in args[:2])
    if device.type != "cpu" or reduced:
        return None
    if func is aten.convolution.default:
        return _cpu_convolution(*args, **kwargs)
    return _cpu_flash_attention(*args[:3])


def _padded(channels: int) -> int:
    return -(-channels // _ONEDNN_BLOCK) * _ONEDNN_BLOCK


def _cpu_convolution(
    input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, *_unused
) -> int | None:
    backend = torch._C._select_conv_backend(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, None
    )
    kind = backend.name
    element = input.element_size()
    batch, in_channels = input.shape[0], input.shape[1]
    kernel = list(weight.shape[2:])
    spatial = len(kernel)
    # one value stands for every spatial dimension (``padding="valid"`` reaches aten as ``[0]``; SigLIP's patches)
    stride, padding, dilation = (list(v) * spatial if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    out_spatial = [
        (input.shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
        for i in range(spatial)
    ]
    input_bytes, weight_bytes = input.numel() * element, weight.numel() * element
    pointwise = all(k == 1 for k in kernel) and all(s == 1 for s in stride) and not any(padding)
    contiguous = input.is_contiguous()
    channels_last = not contiguous and input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last)
    if kind in ("Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d"):
        if kind.startswith("SlowDilated"):  # one sample's input unfolded at a time
            unfolded = in_channels * math.prod(kernel) * math.prod(out_spatial) * element
        else:  # the whole batch's input unfolded (im2col / vol2col), unless the kernel is a plain 1x1 product
            unfolded = 0 if pointwise else batch * in_channels * math.prod(kernel) * math.prod(out_spatial) * element
        # an input that is not contiguous is copied first; a channels-last one makes the kernel copy the weight
        # to channels-last instead (the input itself, for a 1x1 product)
        if channels_last:
            return unfolded + (input_bytes if pointwise else weight_bytes)
        return unfolded + (0 if contiguous else input_bytes)
    if kind == "Empty":
        return 0
    if kind == "Mkldnn" and not transposed:
        # oneDNN reorders the input and the weight into blocks of 16 channels and produces the output in blocks.
        # Contiguous, one group, channels filling the blocks (the large layers of real models): the reorders,
        # or the blocked output where it is larger (a 1x1 layer widening the channels). Otherwise an upper bound
        # (over by 1.8x of the workspace at the median over diffusers' test pipelines, never under): all three at
        # once, plus a contiguous copy of the input, two of a channels-last weight and oneDNN's small buffers.
        out_channels = weight.shape[0]
        blocked_input = batch * _padded(in_channels) * math.prod(input.shape[2:]) * element
        blocked_weight = weight_bytes
        if groups == 1:
            blocked_weight = _padded(out_channels) * _padded(weight.shape[1]) * math.prod(kernel) * element
        blocked_output = batch * _padded(out_channels) * math.prod(out_spatial) * element
        if contiguous and groups == 1 and not in_channels % _ONEDNN_BLOCK and not out_channels % _ONEDNN_BLOCK:
            return max(blocked_input + blocked_weight, blocked_output)
        copies = (0 if contiguous else input_bytes) + (2 * weight_bytes if channels_last else 0)
        return blocked_input + blocked_weight + blocked_output + copies + _ONEDNN_SMALL_BUFFERS
    return None  # a transposed or otherwise unmodelled kernel


def _cpu_flash_attention(query, key, value) -> int:
    """The CPU flash-attention kernel's tiles, one set per thread: the scores of a block of queries against a
    block of keys, their running max and sum, and the block's output accumulator (all in float32), plus a
    reduced-precision copy of the scores for bfloat16/float16 inputs."""
    q_len, kv_len, head_dim = query.shape[-2], key.shape[-2], query.shape[-1]
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    q_block, kv_block = min(q_split, q_len), min(512, kv_len)
    per_thread = (q_block * kv_block + 2 * q_block + q_block * head_dim) * 4
    if query.dtype in (torch.bfloat16, torch.float16):
        per_thread += q_block * kv_block * query.element_size()
    return torch.get_num_threads() * per_thread
