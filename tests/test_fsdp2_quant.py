"""qfloat8 (and qfloat4) on a transformer sharded with FSDP2 (``fully_shard``) over two CPU ranks (gloo).

The supported order is the one VideoX-Fun's scripts use: convert on whole weights (per-channel
scales need whole rows, NVFP4's tensor scale the whole tensor), shard, then apply the mode — FSDP2
all-gathers the packed uint8 payload like any parameter. Quantizing weights that are already
sharded is refused before anything is touched, and the sharded model still runs afterwards; so is
FSDP1, whose flat parameters cannot hold packed tensors.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from helpers import sqnr_db
from rank_models import forward, shard, wan_transformer

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORLD = 2
#: modes applied after convert -> fully_shard
SUPPORTED = ("model_full_load_and_qfloat8_preconverted", "model_full_load_and_qfloat8", "model_full_load_and_qfloat4")


def build_transformer():
    """The Wan transformer in bfloat16 (see ``rank_models``)."""
    return wan_transformer(torch.bfloat16)


def refusal(action) -> str:
    """``"IncompatibleModeError: <message>"`` if ``action`` raised it; anything else is a failure."""
    from memmode_core import IncompatibleModeError

    try:
        action()
    except IncompatibleModeError as exc:
        return f"IncompatibleModeError: {exc}"
    except Exception as exc:  # the test reports it: a crash instead of a refusal
        return f"crashed: {type(exc).__name__}: {exc}"
    return "accepted"


def worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    results: dict = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import memmode_core as memmode
        from memmode_core import quantization
        from memmode_qfloat8 import convert

        mesh = init_device_mesh("cpu", (WORLD,))

        # supported: convert on whole weights, shard, install the forward
        for mode in SUPPORTED:
            model = build_transformer()
            if mode.endswith("qfloat4"):
                memmode.convert("qfloat4", model)
            else:
                convert(model)
            shard(model, mesh)
            payload = model.blocks[0].attn1.to_q.weight_packed
            results[f"{mode} payload"] = (type(payload).__name__, payload.dtype)
            handle = memmode.apply(model, mode)
            results[mode] = forward(model)
            results[f"{mode} summary"] = handle.quantized["module"].as_dict()
            handle.remove()

        # refused: quantizing weights that are already sharded
        model = build_transformer()
        shard(model, mesh)
        before = forward(model)
        for mode in (
            "model_full_load_and_qfloat8",
            "model_cpu_offload_and_qfloat4",
            "model_full_load_and_qfloat8_preconverted",
        ):
            results[f"refused {mode}"] = refusal(lambda mode=mode: memmode.apply(model, mode))
        results["refused convert"] = refusal(lambda: convert(model))
        results["untouched"] = not quantization.is_quantized(model)
        results["still runs"] = torch.equal(forward(model), before)

        # refused: FSDP1, whose flat parameters cannot hold packed tensors
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)), device_id=torch.device("cpu")
        )
        results["refused fsdp1"] = refusal(lambda: memmode.apply(wrapped, "model_full_load_and_qfloat8"))
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def test_qfloat8_on_an_fsdp2_sharded_transformer(tmp_path):
    import memmode_core as memmode

    expected = {}
    for quantizer in ("qfloat8", "qfloat4"):
        unsharded = build_transformer()
        memmode.apply(unsharded, f"model_full_load_and_{quantizer}")
        expected[quantizer] = forward(unsharded)

    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=worker, args=(rank, str(tmp_path / "store"), str(tmp_path))) for rank in range(WORLD)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=180)
    for process in processes:
        if process.is_alive():
            process.kill()
            pytest.fail("an FSDP2 rank did not finish in 180 s")
    assert [p.exitcode for p in processes] == [0] * WORLD

    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert "error" not in results, results.get("error")
        for mode in SUPPORTED:
            assert results[f"{mode} payload"] == ("DTensor", torch.uint8)
            reference = expected["qfloat4" if mode.endswith("qfloat4") else "qfloat8"]
            assert sqnr_db(reference, results[mode]) >= 40, (rank, mode)
            summary = results[f"{mode} summary"]
            assert summary["packed_layers"] == 0 and summary["already_packed_layers"] == 20
        for key in ("refused model_full_load_and_qfloat8", "refused model_cpu_offload_and_qfloat4", "refused convert"):
            assert results[key].startswith("IncompatibleModeError"), (rank, key, results[key])
            assert "already sharded" in results[key] and "convert" in results[key]
        preconverted = results["refused model_full_load_and_qfloat8_preconverted"]
        assert preconverted.startswith("IncompatibleModeError") and "holds no qfloat8 layer" in preconverted
        assert results["untouched"] and results["still runs"]
        assert results["refused fsdp1"].startswith("IncompatibleModeError") and "FSDP1" in results["refused fsdp1"]
