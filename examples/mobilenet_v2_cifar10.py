"""Seed 003: train MobileNetV2 on CIFAR-10 in eager mode, then with an nn.Graph.

The reference script (OneFlow's "Static Graph Interface: nn.Graph" tutorial)
with `import flowgen as flow`:

* eager: forward, `loss.backward()`, `optimizer.step()` on flowgen's NumPy reference;
* graph: `GraphMobileNetV2` (an `nn.Graph` with `add_optimizer` and
  `loss.backward()` in `build`) compiled to CUDA C++ and run on the GPU, or on
  flowgen's CPU emulator when the model is on "cpu";
* with `--verbose`, `print(graph)` before and after the first call (the module
  structure, about 1,900 lines for MobileNetV2), and the checkpoint of
  `graph.state_dict()` saved with `flow.save` and restored with `flow.load`.

Data: `--data DIR` reads CIFAR-10 in its standard python-pickle layout
(`DIR/data_batch_1..5`, `DIR/test_batch`, or the same under
`DIR/cifar-10-batches-py/`). Nothing is downloaded: without `--data` a synthetic
10-class set of 32x32 images (class-dependent colour and stripe pattern plus
noise) is used, and the script says so.

As in the reference script, `model.classifer = ...` (sic) only *adds* a module:
the model keeps its 1000-way `model.classifier` head, so the loss starts near
ln(1000) = 6.9 like the tutorial's output. `--fix-classifier` replaces the real
head with a 10-way one instead.

    python examples/mobilenet_v2_cifar10.py --mode both --steps 20 --width-mult 0.25
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import time

import numpy as np

import flowgen as flow
import flowgen.nn as nn
from flowgen.models import mobilenet_v2
from flowgen.utils.data import DataLoader, Dataset


# ---------------------------------------------------------------- data
class CIFAR10(Dataset):
    """Images (N, 3, 32, 32) uint8 and labels; samples are `ToTensor()`-style floats in [0, 1]."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, source: str):
        self.images = np.ascontiguousarray(images, dtype=np.uint8)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.source = source

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        return (flow.tensor(self.images[index].astype(np.float32) / 255.0), int(self.labels[index]))


def _cifar_dir(root: str) -> str:
    for d in (root, os.path.join(root, "cifar-10-batches-py")):
        if os.path.isfile(os.path.join(d, "data_batch_1")):
            return d
    raise FileNotFoundError(f"--data {root}: no CIFAR-10 python batches (data_batch_1..5, test_batch) found there "
                            f"or in {os.path.join(root, 'cifar-10-batches-py')}")


def load_cifar10(root: str, train: bool = True) -> CIFAR10:
    d = _cifar_dir(root)
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    images, labels = [], []
    for name in names:
        path = os.path.join(d, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CIFAR-10 batch {path} is missing")
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], dtype=np.int64))
    return CIFAR10(np.concatenate(images), np.concatenate(labels), f"CIFAR-10 from {d}")


def synthetic_cifar10(n: int = 5000, seed: int = 0) -> CIFAR10:
    """10 learnable classes: each has its own colour and stripe direction/frequency; noise on top."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    colours = np.array([[0.9, 0.2, 0.2], [0.2, 0.9, 0.2], [0.2, 0.2, 0.9], [0.9, 0.9, 0.2], [0.9, 0.2, 0.9],
                        [0.2, 0.9, 0.9], [0.6, 0.6, 0.6], [0.9, 0.5, 0.1], [0.4, 0.1, 0.6], [0.1, 0.4, 0.3]],
                       np.float32)
    yy, xx = np.mgrid[0:32, 0:32].astype(np.float32)
    angle = labels * (np.pi / 10)
    freq = 0.25 + 0.05 * (labels % 3)
    phase = rng.uniform(0, 2 * np.pi, size=n)
    proj = (np.cos(angle)[:, None, None] * xx + np.sin(angle)[:, None, None] * yy)
    stripes = 0.5 + 0.5 * np.sin(freq[:, None, None] * proj + phase[:, None, None])      # (n, 32, 32)
    images = colours[labels][:, :, None, None] * (0.4 + 0.6 * stripes[:, None])             # (n, 3, 32, 32)
    images += rng.normal(0, 0.12, size=images.shape)
    images = (np.clip(images, 0, 1) * 255).astype(np.uint8)
    return CIFAR10(images, labels, f"synthetic 10-class 32x32 images (n={n})")


def make_dataset(args) -> CIFAR10:
    if args.data:
        return load_cifar10(args.data, train=True)
    print("No --data DIR given: using a SYNTHETIC 10-class dataset of 32x32 images "
          "(class-dependent colour and stripes + noise). Nothing is downloaded.")
    return synthetic_cifar10(args.synthetic_size)


# ---------------------------------------------------------------- model
def make_model(args, device):
    flow.manual_seed(args.seed)
    model = mobilenet_v2(width_mult=args.width_mult).to(device)
    if args.fix_classifier:
        model.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(model.last_channel, 10))
    else:
        # As in the reference script: the misspelt attribute adds a module that forward() never uses.
        model.classifer = nn.Sequential(nn.Dropout(0.2), nn.Linear(model.last_channel, 10))
    model.to(device)
    model.train()
    return model


def _report(batch, loss, batch_size, size):
    current = batch * batch_size
    if batch % 5 == 0:
        print(f"loss: {loss:>7f}  [{current:>5d}/{size:>5d}]")


def train_eager(args, device, dataset):
    print("==== eager mode ====")
    model = make_model(args, device)
    loss_fn = nn.CrossEntropyLoss().to(device)
    optimizer = flow.optim.SGD(model.parameters(), lr=args.lr)
    train_dataloader = DataLoader(dataset, args.batch_size, shuffle=True)
    losses, times = [], []
    for t in range(args.epochs):
        print(f"Epoch {t+1}\n-------------------------------")
        size = len(train_dataloader.dataset)
        for batch, (x, y) in enumerate(train_dataloader):
            if args.steps is not None and batch >= args.steps:
                break
            start = time.perf_counter()
            x = x.to(device)
            y = y.to(device)

            # Compute prediction error
            pred = model(x)
            loss = loss_fn(pred, y)

            # Backpropagation
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)

            losses.append(float(loss.numpy()))
            _report(batch, loss, args.batch_size, size)
    return {"losses": losses, "step_times": times, "model": model}


def train_graph(args, device, dataset):
    print("==== graph mode ====")
    model = make_model(args, device)
    loss_fn = nn.CrossEntropyLoss().to(device)
    optimizer = flow.optim.SGD(model.parameters(), lr=args.lr)
    train_dataloader = DataLoader(dataset, args.batch_size, shuffle=True, drop_last=True)

    class GraphMobileNetV2(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.loss_fn = loss_fn
            self.add_optimizer(optimizer)

        def build(self, x, y):
            y_pred = self.model(x)
            loss = self.loss_fn(y_pred, y)
            loss.backward()
            return loss

    graph_mobile_net_v2 = GraphMobileNetV2()
    if args.debug is not None:
        graph_mobile_net_v2.debug(args.debug)
    if args.print_graph:
        print(graph_mobile_net_v2)

    losses, times = [], []
    for t in range(args.epochs):
        print(f"Epoch {t+1}\n-------------------------------")
        size = len(train_dataloader.dataset)
        for batch, (x, y) in enumerate(train_dataloader):
            if args.steps is not None and batch >= args.steps:
                break
            start = time.perf_counter()
            x = x.to(device)
            y = y.to(device)
            loss = graph_mobile_net_v2(x, y)
            losses.append(float(loss.numpy()))
            times.append(time.perf_counter() - start)
            if len(losses) == 1:
                compiled = graph_mobile_net_v2.compiled
                print(f"(compiled in {times[0]:.1f} s: {compiled.num_launches} kernel launches, "
                      f"{compiled.memory.arena_bytes / 2**20:.1f} MiB arena; "
                      f"{', '.join(f'{k} {v:.2f} s' for k, v in compiled.timings.items())})")
                if args.print_graph:
                    print(graph_mobile_net_v2)
            _report(batch, loss, args.batch_size, size)

        # Save the latest state after each epoch (optimizer state and step counter included).
        if args.checkpoint_dir:
            shutil.rmtree(args.checkpoint_dir, ignore_errors=True)  # Clear previous state
            flow.save(graph_mobile_net_v2.state_dict(), args.checkpoint_dir)
            print(f"saved checkpoint to {args.checkpoint_dir}")

    if args.checkpoint_dir:
        # Restore it, as when resuming after an interruption.
        state_dict = flow.load(args.checkpoint_dir)
        graph_mobile_net_v2.load_state_dict(state_dict)
        step = state_dict["System-Train-TrainStep"].numpy()[0]
        print(f"restored checkpoint from {args.checkpoint_dir} (step {step})")
    return {"losses": losses, "step_times": times, "model": model, "graph": graph_mobile_net_v2}


def deploy(args, device, model, dataset):
    """Seed 003's deployment story: the trained model as an inference graph, saved with
    flow.save(graph, dir), built into a standalone program, whose logits must equal the graph's."""
    import subprocess

    from flowgen.codegen import aot

    print("==== deployment ====")
    model.eval()

    class GraphMobileNetV2Infer(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            return self.model(x)

    graph = GraphMobileNetV2Infer()
    x, _ = next(iter(DataLoader(dataset, args.batch_size)))
    logits = graph(x.to(device)).numpy()
    os.makedirs(args.deploy_dir, exist_ok=True)
    saved, out, results = (os.path.join(args.deploy_dir, name) for name in ("saved", "out", "results"))
    flow.save(graph, saved)
    target = "cuda" if device.type == "cuda" else "cpu"
    arch = "sm_90"
    if target == "cuda":
        from flowgen.runtime.cuda_driver import CudaContext

        arch = CudaContext.get().arch
    build = aot.build(saved, out, target=target, arch=arch, log=lambda line: print(f"  build: {line}"))
    np.save(os.path.join(args.deploy_dir, "x.npy"), x.numpy())
    run = subprocess.run([str(build.binary), "--input", os.path.join(args.deploy_dir, "x.npy"), "--out", results],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the deployed program failed: {run.stderr}")
    program_logits = np.load(os.path.join(results, "output_0.npy"))
    diff = float(np.abs(program_logits - logits).max())
    print(f"standalone program {build.binary}: max |logits - graph logits| = {diff:.2e}")
    model.train()
    return {"graph_logits": logits, "program_logits": program_logits, "binary": build.binary}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["eager", "graph", "both"], default="both")
    p.add_argument("--data", default=None, help="directory with CIFAR-10 python batches (no download)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="at most this many batches per epoch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--width-mult", type=float, default=1.0, help="MobileNetV2 width multiplier (0.25 for quick runs)")
    p.add_argument("--fix-classifier", action="store_true",
                   help="train a 10-way model.classifier instead of the reference script's model.classifer (sic)")
    p.add_argument("--synthetic-size", type=int, default=5000)
    p.add_argument("--checkpoint-dir", default="./GraphMobileNetV2")
    p.add_argument("--verbose", dest="print_graph", action="store_true",
                   help="print the graph's structure before and after its first call (about 1,900 lines)")
    p.add_argument("--debug", type=int, default=None, help="nn.Graph debug level (0-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deploy-dir", default=None,
                   help="after graph training, save the model as an inference graph and build a standalone program here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = args.device or ("cuda" if flow.cuda.is_available() else "cpu")
    DEVICE = flow.device(device)
    print("Using {} device".format(DEVICE))
    dataset = make_dataset(args)
    print(f"data: {dataset.source}")
    if not args.fix_classifier:
        print("note: as in the reference script, `model.classifer` (sic) adds an unused module; the 1000-way "
              "`model.classifier` head is the one trained (--fix-classifier trains a 10-way head)")
    results = {}
    if args.mode in ("eager", "both"):
        results["eager"] = train_eager(args, DEVICE, dataset)
    if args.mode in ("graph", "both"):
        results["graph"] = train_graph(args, DEVICE, dataset)
        if args.deploy_dir:
            results["deploy"] = deploy(args, DEVICE, results["graph"]["model"], dataset)
    for mode in ("eager", "graph"):
        t = results[mode]["step_times"] if mode in results else []
        if t:
            steady = t[1:] or t
            print(f"{mode}: {len(t)} steps, first {t[0]:.2f} s, then {np.median(steady):.3f} s/step (median)")
    return results


if __name__ == "__main__":
    main()
