"""Seed 003's "Save and Load" and "Graph and Deployment", end to end.

1. Train a small classifier for a few steps with a training nn.Graph, checkpointing it with
   `flow.save(graph.state_dict(), dir)` (a fresh graph resumes from `flow.load(dir)`).
2. Wrap the trained model in an inference graph, call it once with example data, and export it
   with `flow.save(graph, MODEL_SAVE_DIR)`: the optimised IR, the weights and the signature.
3. `flowgen build MODEL_SAVE_DIR -o OUT --target cpu` renders OUT/program.cu and compiles it
   into a standalone binary (use `--target cuda`, the default, for a GPU binary).
4. `flowgen run OUT x.npy -o RESULTS` runs it; its output matches the graph's.

    python examples/deploy.py [--target cpu|cuda] [--workdir DIR]
"""
import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import flowgen as flow
import flowgen.nn as nn


def flowgen_cli(*args):
    """Run the `flowgen` command line as a shell user would (`flowgen build ...`)."""
    env = dict(os.environ)
    module = "flowgen_cli.main"
    if importlib.util.find_spec("flowgen_cli") is None:
        # A source checkout that was not `pip install -e .`-ed: the cli/ folder is the package.
        module = "cli.main"
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-m", module, *map(str, args)], check=True, env=env)


def make_data(n=256, seed=0):
    """Two interleaved spirals' worth of toy data: 4 features, 3 classes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = (np.argmax(x[:, :3] + 0.5 * x[:, 3:], axis=1)).astype(np.int64)
    return x, y


class TrainGraph(nn.Graph):
    def __init__(self, model, loss_fn, optimizer):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


class MyGraph(nn.Graph):
    """Seed 003: wrap an eager module in a Graph only to export it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, *input):
        return self.model(*input)


def main(target="cpu", workdir=None, steps=20, batch=32):
    workdir = Path(workdir or tempfile.mkdtemp(prefix="flowgen-deploy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    x, y = make_data()
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    loss_fn = nn.CrossEntropyLoss()
    optimizer = flow.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    graph = TrainGraph(model, loss_fn, optimizer)

    # 1. Train, checkpoint halfway (seed 003: flow.save(graph.state_dict(), CHECKPOINT_SAVE_DIR)).
    checkpoint = workdir / "checkpoint"
    for step in range(steps):
        i = (step * batch) % len(x)
        loss = graph(flow.tensor(x[i:i + batch]), flow.tensor(y[i:i + batch]))
        if step == steps // 2 - 1:
            flow.save(graph.state_dict(), checkpoint)
        if step % 5 == 4:
            print(f"step {step + 1}: loss {float(loss.numpy()):.5f}")
    state = flow.load(checkpoint)
    print(f"checkpoint at step {state['System-Train-TrainStep'].numpy()[0]} holds {sorted(state['model'])}")

    # 2. Export for deployment (seed 003: model.eval(); graph = MyGraph(model); graph(fake); flow.save(graph, dir)).
    model.eval()
    deploy_graph = MyGraph(model)
    example = flow.tensor(x[:8])
    expected = deploy_graph(example).numpy()
    model_dir = workdir / "model"
    flow.save(deploy_graph, model_dir)
    saved = flow.load(model_dir)
    print(f"saved {saved}")

    # 3. Build the standalone program; 4. run it on the same input and compare.
    out = workdir / "build"
    flowgen_cli("build", model_dir, "-o", out, "--target", target)
    np.save(workdir / "x.npy", x[:8])
    flowgen_cli("run", out, workdir / "x.npy", "-o", workdir / "results")
    got = np.load(workdir / "results" / "output_0.npy")
    diff = float(np.abs(got - expected).max())
    print(f"program output vs graph output: max |diff| = {diff:.3g} (predicted classes {got.argmax(1).tolist()})")
    return diff


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    main(args.target, args.workdir)
