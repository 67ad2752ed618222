"""Data-parallel scaling: a cost model of step time vs ranks, and the collective path at world size 1.

    python benchmarks/scaling.py [--out FILE] [--measure-steps N]

1. Model (no hardware needed): weak scaling (fixed batch per GPU) of the example models' training
   step on H100 nodes. Per step:

       T_step(N) = T_fwd + max(T_bwd, T_allreduce(N)) + T_last_bucket(N) + T_update
       T_allreduce ring, flat over N GPUs:   2(N-1)/N * S / bw(slowest link) + 2(N-1) * alpha
       hierarchical (G GPUs per node, M = N/G nodes): reduce-scatter + all-gather in the node over
       NVLink, 2(G-1)/G * S / bw_nvlink, plus a ring over the M nodes of each GPU's 1/G slice,
       2(M-1)/M * (S/G) / bw_nic, with 2(G-1) + 2(M-1) latency terms

   S = gradient bytes (fp32), the all-reduce overlaps the backward pass bucket by bucket except the
   last bucket. Compute per image comes from the measured MobileNetV2 step (README, H100,
   batch 64: 14,850 images/s) scaled by each model's multiply-accumulates, counted here on one
   32x32 image (an assumption: equal efficiency; ResNets' dense convs usually run faster per MAC
   than depthwise ones, so their times are upper bounds).
   Failures: with a per-GPU mean time between failures MTBF, a job of N GPUs fails every MTBF/N;
   checkpointing every tau = sqrt(2 C MTBF/N) (Young/Daly, C = checkpoint write time) loses about
   C/tau + tau/(2 MTBF/N) + R/(MTBF/N) of the time (R = restart time): "goodput".
2. Measured (CPU emulator, this machine): a data-parallel graph at world size 1 (the all-reduce
   steps run, as identities) vs the same graph without them: the overhead of the collective path,
   i.e. the host steps themselves (download, MPI or identity, upload) plus what the step loses
   because the parameter updates can no longer join the kernels that make their gradients.

Prints a table and writes JSON (default benchmarks/results/scaling_model.json).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import flowgen as flow  # noqa: E402

H100 = {
    "bw_nvlink": 450e9,          # bytes/s per GPU, NVLink 4 all-reduce bus bandwidth (one direction)
    "bw_nic": 50e9,              # bytes/s per GPU: one 400 Gb/s NIC per GPU
    "alpha_nvlink": 5e-6,        # s per message step inside a node
    "alpha_nic": 15e-6,          # s per message step between nodes
    "gpus_per_node": 8,
    "mobilenet_images_per_s": 14850.0,   # measured, batch 64 (README)
}
FAILURES = {"mtbf_gpu_hours": 50_000.0, "checkpoint_s": 30.0, "restart_s": 300.0}
BATCH_PER_GPU = 64
BUCKET_BYTES = 25 * 2 ** 20
RANKS = [1, 8, 16, 64, 256, 1024, 4096]


def count_macs(model, shape=(1, 3, 32, 32)) -> int:
    """Multiply-accumulates of one forward pass (convolutions and linear layers)."""
    macs = []

    def conv(m, args, out):
        kh, kw = m.kernel_size
        macs.append(out.numel() * (m.in_channels // m.groups) * kh * kw)

    def linear(m, args, out):
        macs.append(out.numel() * m.in_features)

    for m in model.modules():
        if isinstance(m, flow.nn.Conv2d):
            m.register_forward_hook(conv)
        elif isinstance(m, flow.nn.Linear):
            m.register_forward_hook(linear)
    model.eval()
    with flow.no_grad():
        model(flow.randn(*shape))
    return int(sum(macs))


def allreduce_flat(n: int, nbytes: float, hw) -> float:
    if n == 1:
        return 0.0
    inside = n <= hw["gpus_per_node"]
    bw, alpha = (hw["bw_nvlink"], hw["alpha_nvlink"]) if inside else (hw["bw_nic"], hw["alpha_nic"])
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha


def allreduce_hierarchical(n: int, nbytes: float, hw) -> float:
    g = min(n, hw["gpus_per_node"])
    m = n // g
    inside = 2 * (g - 1) / g * nbytes / hw["bw_nvlink"] + 2 * (g - 1) * hw["alpha_nvlink"] if g > 1 else 0.0
    across = 2 * (m - 1) / m * (nbytes / g) / hw["bw_nic"] + 2 * (m - 1) * hw["alpha_nic"] if m > 1 else 0.0
    return inside + across


def step_time(n: int, compute_s: float, grad_bytes: float, hw, allreduce) -> float:
    forward, backward, update = compute_s / 3, 2 * compute_s / 3, 0.0
    last_bucket = allreduce(n, min(BUCKET_BYTES, grad_bytes), hw)
    return forward + max(backward, allreduce(n, grad_bytes, hw)) + last_bucket + update


def goodput(n: int, step_s: float) -> dict:
    mtbf_job = FAILURES["mtbf_gpu_hours"] * 3600 / n
    c, r = FAILURES["checkpoint_s"], FAILURES["restart_s"]
    tau = math.sqrt(2 * c * mtbf_job)
    lost = c / tau + tau / (2 * mtbf_job) + r / mtbf_job
    return {"job_mtbf_h": mtbf_job / 3600, "checkpoint_every_min": tau / 60, "goodput": max(0.0, 1 - lost)}


def model_rows(hw) -> list:
    reference_macs = None
    rows = []
    for name in ("mobilenet_v2", "resnet18", "resnet50"):
        flow.manual_seed(0)
        model = getattr(flow.models, name)(num_classes=10)
        macs = count_macs(model)
        reference_macs = reference_macs or macs       # mobilenet_v2 first: the measured one
        per_image = macs / reference_macs / hw["mobilenet_images_per_s"]
        compute = per_image * BATCH_PER_GPU
        grad_bytes = 4 * sum(p.numel() for p in model.parameters())
        base = step_time(1, compute, grad_bytes, hw, allreduce_flat)
        for n in RANKS:
            flat = step_time(n, compute, grad_bytes, hw, allreduce_flat)
            hier = step_time(n, compute, grad_bytes, hw, allreduce_hierarchical)
            rows.append({"model": name, "ranks": n, "macs_per_image": macs, "grad_mb": grad_bytes / 2 ** 20,
                         "step_ms_flat_ring": flat * 1e3, "step_ms_hierarchical": hier * 1e3,
                         "images_per_s": n * BATCH_PER_GPU / hier, "scaling_efficiency": base / hier,
                         **goodput(n, hier)})
    return rows


def measure_world_size_one(steps: int) -> dict:
    """Step time of a graph with and without the all-reduce host steps (world size 1, emulator)."""
    def make(wrapped: bool):
        flow.manual_seed(0)
        model = flow.nn.Sequential(flow.nn.Linear(256, 512), flow.nn.ReLU(), flow.nn.Linear(512, 10))
        if wrapped:
            model = flow.nn.parallel.DistributedDataParallel(model)
        optimizer = flow.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss_fn = flow.nn.CrossEntropyLoss()

        class Train(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model, self.loss_fn = model, loss_fn
                self.add_optimizer(optimizer)

            def build(self, x, y):
                loss = self.loss_fn(self.model(x), y)
                loss.backward()
                return loss
        return Train()

    x, y = flow.randn(64, 256), flow.tensor(np.arange(64) % 10)
    result = {}
    for label, wrapped in (("plain", False), ("data_parallel_world_1", True)):
        graph = make(wrapped)
        graph(x, y)
        start = time.perf_counter()
        for _ in range(steps):
            graph(x, y)
        step_ms = (time.perf_counter() - start) / steps * 1e3
        kernels, launches = graph.compiled.program.kernels, graph.compiled.executor.launches
        collectives = [launch for k, launch in zip(kernels, launches) if k.collective is not None]
        start = time.perf_counter()
        for _ in range(steps):
            for launch in collectives:
                launch()
        result[label] = {"step_ms": step_ms, "launches": len(kernels), "host_collectives": len(collectives),
                         "host_collective_ms": (time.perf_counter() - start) / steps * 1e3}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "scaling_model.json"))
    parser.add_argument("--measure-steps", type=int, default=200)
    args = parser.parse_args()
    rows = model_rows(H100)
    print(f"{'model':14} {'ranks':>6} {'grad MB':>8} {'flat ms':>9} {'hier ms':>9} {'images/s':>11} "
          f"{'eff':>6} {'ckpt min':>9} {'goodput':>8}")
    for r in rows:
        print(f"{r['model']:14} {r['ranks']:>6} {r['grad_mb']:>8.1f} {r['step_ms_flat_ring']:>9.2f} "
              f"{r['step_ms_hierarchical']:>9.2f} {r['images_per_s']:>11,.0f} {r['scaling_efficiency']:>6.2f} "
              f"{r['checkpoint_every_min']:>9.1f} {r['goodput']:>8.3f}")
    measured = measure_world_size_one(args.measure_steps)
    for label, m in measured.items():
        print(f"{label:24} {m['step_ms']:.3f} ms/step on the CPU emulator, {m['launches']} launches, "
              f"{m['host_collectives']} host all-reduce steps taking {m['host_collective_ms']:.3f} ms")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"hardware": H100, "failures": FAILURES, "batch_per_gpu": BATCH_PER_GPU,
                   "bucket_bytes": BUCKET_BYTES, "rows": rows, "world_size_1_cpu": measured}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
