"""What N ranks need an accelerator for (docs/distributed.md), run where there are at least two CUDA devices: one
rank per GPU (NCCL), as ``memmode run --nproc`` starts them. Skipped, visibly, elsewhere: the CPU lane of
``tests/test_ranks.py`` runs everything else.

- **Ring attention** (``ContextParallelConfig(ring_degree=N)``) needs an attention backend that returns the
  log-sum-exp of each block (cuDNN's, flash); under group offload with ``pinned`` (one page-locked copy for the
  machine) every rank gives what the same ranks give without memmode, bit for bit.
- **One pinned copy, page-locked by each rank**: two gloo ranks on one GPU place the same transformer with
  ``pinned``; each rank's mappings of the shared files are page-locked (``cudaHostRegister`` with
  ``cudaHostRegisterReadOnly``), and the outputs are the single process's.
- **Tensor parallelism** (``TensorParallelConfig``) shards each ``Linear`` weight into a ``DTensor`` on the
  devices: a full load keeps it exact; a placement that would copy a shard's bytes is refused, typed, before
  anything is touched, as for FSDP2.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_bit_equal
from rank_models import transformer_inputs, wan_transformer
from ranks import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices, one per rank (found {GPUS})")
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device: cudaHostRegister of a shared mapping")

#: the attention backend ring attention runs on (it returns the log-sum-exp); cuDNN's ships with PyTorch
RING_BACKEND = "_native_cudnn"


def device_forward(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    inputs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in transformer_inputs(torch.bfloat16).items()
    }
    with torch.no_grad():
        return model(**inputs)[0].float().cpu()


def ring(rank: int, world: int) -> dict:
    """The same bfloat16 transformer with ring attention, without memmode and under group offload + pinned."""
    from diffusers import ContextParallelConfig

    import memmode_core as memmode

    device = torch.device("cuda", torch.cuda.current_device())
    outputs = {}
    for mode in (None, "model_group_offload"):
        model = wan_transformer(torch.bfloat16, heads=4)
        model.set_attention_backend(RING_BACKEND)
        if mode is None:
            model.to(device)
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=world))
        handle = None if mode is None else memmode.apply(model, mode, device=device, storage="pinned")
        outputs[mode] = device_forward(model, device)
        if handle is not None:
            outputs["pinned shared"] = hasattr(handle.runtime.session, "store")
            handle.remove()
    return outputs


@two_gpus
def test_ring_attention_under_group_offload_with_one_pinned_copy_is_exact():
    for rank, result in enumerate(run_ranks(2, ring, accelerator=True)):
        assert_bit_equal(result["model_group_offload"], result[None], f"rank {rank}")
        assert result["pinned shared"], "the ranks of one machine page-lock one shared copy"


def tensor_parallel(rank: int, world: int) -> dict:
    from diffusers.models._modeling_parallel import TensorParallelConfig

    import memmode_core as memmode

    device = torch.device("cuda", torch.cuda.current_device())
    results = {}
    model = wan_transformer(torch.bfloat16, heads=4).to(device)
    model.enable_parallelism(config=TensorParallelConfig(tp_degree=world))
    results["alone"] = device_forward(model, device)
    handle = memmode.apply(model, "model_full_load", device=device)
    results["full load"] = device_forward(model, device)
    handle.remove()
    try:
        memmode.apply(model, "model_group_offload", device=device, storage="pinned")
        results["offload"] = "accepted"
    except memmode.IncompatibleModeError as exc:
        results["offload"] = str(exc)
    results["still runs"] = torch.equal(device_forward(model, device), results["alone"])
    return results


@two_gpus
def test_tensor_parallel_full_load_is_exact_and_offloading_a_shard_is_refused_typed():
    for rank, result in enumerate(run_ranks(2, tensor_parallel, accelerator=True)):
        assert_bit_equal(result["full load"], result["alone"], f"rank {rank}")
        assert "DTensor" in result["offload"] and result["still runs"], result["offload"]


def shared_pinned_on_cuda(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import memmode_core as memmode

    model = wan_transformer(torch.bfloat16, heads=4)
    handle = memmode.apply(model, "model_group_offload", device="cuda:0", storage="pinned")
    output = device_forward(model, torch.device("cuda:0"))
    session = handle.runtime.session
    locked = [flat.is_pinned() for flat, _ in session._mapped.values()]
    dist.barrier()
    handle.remove()
    return {"output": output, "locked": locked, "folder": str(session.store.folder)}


@one_gpu
def test_ranks_on_one_gpu_page_lock_their_mappings_of_one_shared_copy():
    model = wan_transformer(torch.bfloat16, heads=4).to("cuda:0")
    expected = device_forward(model, torch.device("cuda:0"))
    del model
    for rank, result in enumerate(run_ranks(2, shared_pinned_on_cuda)):
        assert_bit_equal(result["output"], expected, f"rank {rank}")
        assert result["locked"] and all(result["locked"]), "each rank page-locked its shared mappings"
        assert result["folder"].startswith("/dev/shm/")
