"""Differential fuzzer of dynamic dimensions: tests/program_fuzzer.py's random programs, in eval
mode, as a graph whose input's batch axis is a flow.Dim, against a graph compiled for each size.

For each program (its input [B, ...]): the model is called eagerly at batch B and at smaller
sizes; where eager runs at a size (a program may tie the batch to a parameter's shape), the
dynamic graph (one compile, Dim("batch", 1, B)) must equal a graph compiled for exactly that size
(the same kernels but for the fitted sizes, so to float32 rounding) or be refused by
codegen/dynamic.py with its DynamicShapeError (what cannot follow a size). Anything else -- a
number apart, another exception, a second compile (but the variant of a batch of 1) -- is a
failure, printed with the program. With --saved, a program that passes is also saved
(flow.save: its renderings, and a program per size of 1 where the kernels differ), loaded and
run at the same sizes (SavedGraph.run: the programs `flowgen build` fits), against the same
exact graphs. With --train, the programs' training steps instead: a graph with a dynamic batch
trained at a run of sizes against the same graph without dynamic_shapes (a variant compiled per
size, on the same state), the losses of every step and then the parameters, the target's batch
axis tied to the input's (graph against eager training is program_fuzzer.py's, with its rules for
float32 rounding that training amplifies, such as Adam's first step on a gradient that is zero
but for rounding):

    FLOWGEN_CPU_KERNELS=native python tests/dynamic_fuzzer.py --count 200 [--seed 0] [--saved | --train] [--cuda]

--cuda runs the graphs on the cuda device: the cuda target's kernels, whose launch grids follow the
sizes (FLOWGEN_EMULATE_CUDA=1 runs them on the CPU emulator where there is no GPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("FLOWGEN_CPU_KERNELS", "native")

import flowgen as flow  # noqa: E402
from flowgen.codegen.dynamic import DynamicShapeError  # noqa: E402
from flowgen.errors import TraceError  # noqa: E402
from graphs import FirstOutput, InferGraph  # noqa: E402
from program_fuzzer import _backward, _optimizer, _out_and_aux, generate, loss_fn, model_class  # noqa: E402


DEVICE = "cpu"   # the graphs' device (--cuda)


def check(seed: int, saved: bool = False) -> str:
    """"ok", "refused: ...", "skipped: ..." or "FAILED: ..." for program `seed` (`saved`: its saved
    form too)."""
    program = generate(seed)
    if program.dtype != "float32" or len(program.input_shape) < 2:
        return "skipped: float64"
    flow.manual_seed(seed)
    model = FirstOutput(model_class(program)()).eval()   # its auxiliary loss dropped
    rng = np.random.default_rng(seed)
    valid = {}   # the batch sizes eager runs at (a program may tie its batch to a parameter's shape)
    for size in range(1, program.input_shape[0] + 6):
        x = flow.tensor(rng.standard_normal((size, *program.input_shape[1:])).astype(np.float32))
        try:
            model(x)
        except Exception:
            continue
        valid[size] = x
    lo = hi = program.input_shape[0]   # the run of sizes eager takes around the program's own
    while lo - 1 in valid:
        lo -= 1
    while hi + 1 in valid:
        hi += 1
    try:
        batch = flow.Dim("batch", min=lo, max=hi)
    except ValueError:
        return "skipped: eager runs at too few batch sizes"
    model.to(DEVICE)
    graph = InferGraph(model)
    graph.config.dynamic_shapes([{0: batch}])
    sizes = [valid[hi].to(DEVICE), valid[lo].to(DEVICE), valid[(lo + hi) // 2].to(DEVICE), valid[hi - 1].to(DEVICE)]
    compiled = {}   # one variant for the sizes from 2 up, one for a batch of 1
    try:
        wants = [InferGraph(model)(x).numpy() for x in sizes]
    except TraceError as error:
        return _skipped_for_a_cpu_tensor(error)
    for x, want in zip(sizes, wants):
        try:
            got = graph(x).numpy()
        except DynamicShapeError as error:
            return f"refused: {str(error)[:400]}"
        if compiled.setdefault(x.shape[0] == 1, graph.compiled) is not graph.compiled:
            return f"FAILED: compiled again at batch {x.shape[0]}"
        verdict = _compare(got, want, f"batch {x.shape[0]}")
        if verdict:
            return verdict
    if saved:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                flow.save(graph, os.path.join(tmp, "saved"))
            except DynamicShapeError as error:
                return f"refused: {str(error)[:400]}"
            loaded = flow.load(os.path.join(tmp, "saved"))
            for x, want in zip(sizes, wants):
                verdict = _compare(loaded.run(x.numpy())[0], want, f"saved, batch {x.shape[0]}")
                if verdict:
                    return verdict
    return "ok"


def check_training(seed: int) -> str:
    """check() for program `seed`'s training step (--train)."""
    program = generate(seed)
    if program.dtype != "float32" or len(program.input_shape) < 2:
        return "skipped: float64"
    flow.manual_seed(seed)
    probe = model_class(program)().eval()
    rng = np.random.default_rng(seed)
    targets = {}   # size -> the target at that batch (its shape from eager's output there)
    for size in range(2, program.input_shape[0] + 6):
        x = rng.standard_normal((size, *program.input_shape[1:])).astype(np.float32)
        try:
            out, _ = _out_and_aux(probe(flow.tensor(x)))
        except Exception:
            continue
        shape = (out.shape[0],) if program.target.startswith("labels:") else tuple(out.shape)
        if program.target.startswith("labels:"):
            target = rng.integers(0, int(program.target.split(":")[1]), shape).astype(np.int64)
        else:
            target = rng.standard_normal(shape).astype(np.float32)
        targets[size] = (x, target)
    sizes = sorted(targets)
    if len(sizes) < 4 or sizes[-1] - sizes[0] + 1 != len(sizes) or \
            any(targets[n][1].shape[1:] != targets[sizes[0]][1].shape[1:] or targets[n][1].shape[0] != n for n in sizes):
        return "skipped: the batch does not run a range of sizes, or the target does not follow it on axis 0"
    batch = flow.Dim("batch", min=sizes[0], max=sizes[-1])
    order = [sizes[-1], sizes[0], sizes[len(sizes) // 2], sizes[-1] - 1, sizes[0]]

    def train(dynamic):
        flow.manual_seed(seed)
        model = model_class(program)().to(DEVICE)
        opt, loss_of = _optimizer(program, model.parameters()), loss_fn(program)

        def step(x, target):
            out, aux = _out_and_aux(model(x))
            loss = loss_of(out, target)
            _backward(loss, aux)
            return loss

        class Train(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.add_optimizer(opt)

            def build(self, x, target):
                return step(x, target)

        graph = Train()
        if dynamic:
            graph.config.dynamic_shapes([{0: batch}, {0: batch}])
        losses = [graph(*(flow.tensor(a).to(DEVICE) for a in targets[n])).numpy() for n in order]
        return losses, [p.numpy() for p in model.parameters()]

    try:
        got, got_params = train(True)
    except DynamicShapeError as error:
        return f"refused: {str(error)[:400]}"
    except TraceError as error:
        return _skipped_for_a_cpu_tensor(error)
    want, want_params = train(False)
    for k, (a, b) in enumerate(zip(got, want)):
        verdict = _compare(np.asarray(a), np.asarray(b), f"training step {k} (batch {order[k]})")
        if verdict:
            return verdict
    for k, (a, b) in enumerate(zip(got_params, want_params)):
        verdict = _compare(a, b, f"parameter {k} after training")
        if verdict:
            return verdict
    return "ok"


def _skipped_for_a_cpu_tensor(error) -> str:
    """The verdict of a program whose forward makes a tensor on the cpu (a graph on the cuda
    device refuses it, as PyTorch would: --cuda); any other TraceError is raised again."""
    if "was used in a graph running on" not in str(error):
        raise error
    return "skipped: forward makes a cpu tensor"


def _compare(got, want, where: str) -> str:
    """"" when `got` equals `want` to float32 rounding, else the failure."""
    scale = float(np.nanmax(np.abs(want))) if want.size and np.isfinite(want).any() else 1.0
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1.0), equal_nan=True):
        diff = np.nanmax(np.abs(got - want)) if got.shape == want.shape else f"shape {got.shape} vs {want.shape}"
        return f"FAILED: {where}: largest difference {diff} (scale {scale:.3g})"
    return ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--saved", action="store_true", help="also save, load and run each program that passes")
    parser.add_argument("--train", action="store_true", help="the programs' training steps instead of inference")
    parser.add_argument("--cuda", action="store_true", help="the graphs on the cuda device (the cuda target's kernels)")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = "cuda" if args.cuda else "cpu"
    tally = {}
    failures = []
    for seed in range(args.seed, args.seed + args.count):
        try:
            verdict = check_training(seed) if args.train else check(seed, args.saved)
        except Exception as error:
            verdict = f"FAILED: {type(error).__name__}: {str(error)[:300]}"
            traceback.print_exc()
        kind = verdict.split(":")[0] if not verdict.startswith("skipped") else verdict
        tally[kind] = tally.get(kind, 0) + 1
        if kind == "FAILED":
            failures.append((seed, verdict))
            print(f"seed {seed}: {verdict}\n{generate(seed).source()}", flush=True)
    print(f"{args.count} programs from seed {args.seed}: {tally}")
    for seed, verdict in failures:
        print(f"  seed {seed}: {verdict}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
