"""Build the GPT of examples/gpt_char.py as a decoding step with a KV cache, for examples/generate/run.c.

    python examples/generate/build.py --out gen            # train 1500 steps, then build gen/build
    cc -std=c99 -O2 examples/generate/run.c ...            # the command this script prints
    ./gen/run gen/build -p "A graph is" -n 40              # text, greedily; -t 0.8 -k 10 samples

It trains the character-level GPT on examples/data/tiny_corpus.txt (`--steps 0`: its random
initial weights; nothing is downloaded), wraps it in the decoding step of
examples/generate/decode.py (the trained modules themselves), traces that as an inference
nn.Graph, saves it (OUT/saved) and builds it as a shared library with a C API (OUT/build: what
`flowgen build OUT/saved -o OUT/build --target cpu --lib` writes), and writes the character
vocabulary beside it (OUT/build/vocab.txt: the characters in token-id order, no separator) so
run.c can read a prompt as text.

The graph's signature, which run.c checks: input 0 the token (int64 [1, 1]), input 1 its position
(int64 [1]), then the K and V caches of each layer (float32 [1, n_head, block_size, head_dim]);
output 0 the logits (float32 [1, vocab]), then the updated caches in the inputs' order.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np

import flowgen as flow
from flowgen.codegen import aot

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # examples/: gpt_char
sys.path.insert(0, str(HERE))          # decode

import gpt_char  # noqa: E402
from decode import define_decode_step  # noqa: E402


class GPTDecode(flow.nn.Graph):
    """One token through the GPT, its K/V caches in and out (examples/generate/decode.py)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def build(self, token, pos, *caches):
        return self.step(token, pos, *caches)


def make_model(steps: int, seed: int = 0, block_size: int = 64, log=None):
    """gpt_char's GPT trained `steps` steps from `seed` on the shipped corpus (0: as initialised),
    in eval mode (no dropout); returns (model, corpus). `block_size`: its longest sequence, the
    capacity of the decoding step's caches."""
    corpus = gpt_char.Corpus()
    config = gpt_char.GPTConfig(vocab_size=corpus.vocab_size, block_size=block_size)
    if steps > 0:
        model, _ = gpt_char.train(config, steps, batch=8, use_graph=True, seed=seed, log=log)
    else:
        flow.manual_seed(seed)
        model = gpt_char.define(flow)(config)
    return model.eval(), corpus


def export(model, corpus, out: Path, target: str = "cpu", log=None) -> dict:
    """Trace the decoding step of `model`, save it to out/saved and build it with --lib into
    out/build (plus vocab.txt); returns the build's manifest."""
    step = define_decode_step(flow)(model)
    graph = GPTDecode(step)
    with flow.no_grad():
        graph(flow.tensor(np.zeros((1, 1), np.int64)), flow.tensor(np.zeros(1, np.int64)), *step.empty_caches())
    out.mkdir(parents=True, exist_ok=True)
    flow.save(graph, out / "saved")
    manifest = aot.build(out / "saved", out / "build", target=target, lib=True, log=log).manifest
    vocab = "".join(corpus.chars)
    if not vocab.isascii():
        raise ValueError("run.c reads a one-byte-per-character vocabulary; the corpus has non-ASCII characters")
    (out / "build" / "vocab.txt").write_text(vocab)
    return manifest


def compile_command(manifest: dict, build: Path, binary: Path, compiler: str = "cc") -> list:
    """The command that compiles run.c against the library in `build`."""
    build = build.resolve()
    return [compiler, "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", str(HERE / "run.c"), f"-I{build}",
            f'-DFLOWGEN_MODEL_HEADER="{manifest["header"]}"', f"-L{build}", f"-l{manifest['name']}",
            f"-Wl,-rpath,{build}", "-lm", "-o", str(binary)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="generate_out", help="where the saved graph and the build go")
    parser.add_argument("--steps", type=int, default=1500,
                        help="training steps (about 2 minutes on two cores; 0: random weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64, help="the longest sequence (the KV cache's capacity)")
    parser.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    out = Path(args.out)
    model, corpus = make_model(args.steps, args.seed, args.block_size, log=print)
    manifest = export(model, corpus, out, args.target, log=print)
    print(f"built {out / 'build' / manifest['library']} (graph {manifest['graph']}); compile run.c with:")
    print(" ".join(shlex.quote(word) for word in compile_command(manifest, out / "build", out / "run")))
    return manifest


if __name__ == "__main__":
    main()
