"""Build examples/gpt_char.py's GPT as a prefill and a decoding step with a growing KV cache, for run.c.

    python examples/generate/build.py --out gen            # train 1500 steps, then build gen/prefill and gen/decode
    cc -std=c99 -O2 examples/generate/run.c ...            # the command this script prints
    ./gen/run gen -p "A graph is" -n 40                    # text, greedily; -t 0.8 -k 10 samples

It trains the character-level GPT on examples/data/tiny_corpus.txt (`--steps 0`: its random
initial weights; nothing is downloaded) and wraps it (the trained modules themselves) in two
inference nn.Graphs with a dynamic dimension each:

  prefill  examples/generate/prefill.py: the prompt, Dim seq from 1 to block_size, in one call
  decode   examples/generate/decode.py: one token after caches of Dim past positions, from 1 to
           block_size - 1; each call's work follows past (the attention reads past + 1 positions)

Two graphs because a Dim's smallest size is 1: the step cannot start from empty caches, so
position 0 (and the rest of the prompt, in one pass) is the prefill's. Each graph is traced, saved
(OUT/saved/prefill, OUT/saved/decode) and built as a shared library with a C API into a folder of
its own, with its weights beside it (OUT/prefill: libgpt_prefill.so, gpt_prefill.h,
weights.safetensors; OUT/decode: libgpt_decode.so, ...: what `flowgen build OUT/saved/decode -o
OUT/decode --target cpu --lib --name gpt_decode` writes). The character vocabulary goes to
OUT/vocab.txt (the characters in token-id order, no separator) so run.c can read a prompt as text.
Both libraries export the same C API names, so run.c opens each with dlopen (RTLD_LOCAL) rather
than linking them: its compile command links neither, only includes the decode build's header.

The signatures, which run.c checks (-1: the dynamic dimension):
  prefill  input 0 the prompt (int64 [1, seq]); output 0 the last position's logits (float32
           [1, vocab]), then the K and V caches of each layer (float32 [1, n_head, seq, head_dim]:
           k_0, v_0, k_1, ...)
  decode   input 0 the token (int64 [1, 1]), input 1 its position (int64 [1], = past), then the
           caches (float32 [1, n_head, past, head_dim]); output 0 the logits, then the caches
           with this position appended ([1, n_head, past + 1, head_dim]) in the inputs' order
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import flowgen as flow
from flowgen.codegen import aot

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # examples/: gpt_char
sys.path.insert(0, str(HERE))          # decode, prefill

import gpt_char  # noqa: E402
from decode import define_decode_step  # noqa: E402
from prefill import define_prefill  # noqa: E402

# The libraries' names (aot.build's `name`): OUT/<part>/lib<name>.so and <name>.h, where run.c looks.
LIBRARY_NAMES = {"prefill": "gpt_prefill", "decode": "gpt_decode"}


class GPTPrefill(flow.nn.Graph):
    """The prompt through the GPT: its last logits and every layer's K/V caches (prefill.py)."""

    def __init__(self, prefill):
        super().__init__()
        self.prefill = prefill

    def build(self, tokens):
        return self.prefill(tokens)


class GPTDecode(flow.nn.Graph):
    """One token through the GPT, its K/V caches in and grown by one position out (decode.py)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def build(self, token, pos, *caches):
        return self.step(token, pos, *caches)


def make_model(steps: int, seed: int = 0, block_size: int = 64, log=None):
    """gpt_char's GPT trained `steps` steps from `seed` on the shipped corpus (0: as initialised),
    in eval mode (no dropout); returns (model, corpus). `block_size`: its longest sequence, the
    most positions the caches hold."""
    corpus = gpt_char.Corpus()
    config = gpt_char.GPTConfig(vocab_size=corpus.vocab_size, block_size=block_size)
    if steps > 0:
        model, _ = gpt_char.train(config, steps, batch=8, use_graph=True, seed=seed, log=log)
    else:
        flow.manual_seed(seed)
        model = gpt_char.define(flow)(config)
    return model.eval(), corpus


def graphs(model) -> dict:
    """The two inference graphs of `model`, traced with their dynamic dimensions:
    {"prefill": GPTPrefill (Dim seq, 1 to block_size), "decode": GPTDecode (Dim past, 1 to
    block_size - 1)}."""
    block_size = model.config.block_size
    prefill, step = define_prefill(flow)(model), define_decode_step(flow)(model)
    seq = flow.Dim("seq", min=1, max=block_size)
    past = flow.Dim("past", min=1, max=block_size - 1)
    prefill_graph, decode_graph = GPTPrefill(prefill), GPTDecode(step)
    prefill_graph.config.dynamic_shapes([{1: seq}])
    decode_graph.config.dynamic_shapes([None, None, *[{2: past}] * (2 * model.config.n_layer)])
    with flow.no_grad():
        prefill_graph(*prefill.example_inputs(2))
        decode_graph(*step.example_inputs(2))
    return {"prefill": prefill_graph, "decode": decode_graph}


def export(model, corpus, out: Path, target: str = "cpu", log=None) -> dict:
    """Trace the prefill and the decoding step of `model`, save them to out/saved/{prefill,decode}
    and build each with --lib into out/prefill and out/decode (plus out/vocab.txt); returns their
    manifests, {"prefill": ..., "decode": ...}."""
    vocab = "".join(corpus.chars)
    if not vocab.isascii():
        raise ValueError("run.c reads a one-byte-per-character vocabulary; the corpus has non-ASCII characters")
    (out / "saved").mkdir(parents=True, exist_ok=True)
    manifests = {}
    for part, graph in graphs(model).items():
        flow.save(graph, out / "saved" / part)
        manifests[part] = aot.build(out / "saved" / part, out / part, target=target, lib=True,
                                    name=LIBRARY_NAMES[part], log=log).manifest
    (out / "vocab.txt").write_text(vocab)
    return manifests


def compile_command(out: Path, binary: Path, compiler: str = "cc") -> list:
    """The command that compiles run.c for the libraries in `out` (export's folder): the decode
    build's header for the C API's types; the libraries are opened at run time (dlopen, -ldl)."""
    return [compiler, "-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", str(HERE / "run.c"),
            f"-I{Path(out).resolve() / 'decode'}", "-o", str(binary), "-ldl", "-lm"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="generate_out", help="where the saved graphs and the builds go")
    parser.add_argument("--steps", type=int, default=1500,
                        help="training steps (about 2 minutes on two cores; 0: random weights)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=64,
                        help="the longest sequence (the most positions the KV caches hold; at least 5)")
    parser.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    out = Path(args.out)
    model, corpus = make_model(args.steps, args.seed, args.block_size, log=print)
    manifests = export(model, corpus, out, args.target, log=print)
    for part, manifest in manifests.items():
        print(f"built {out / part / manifest['library']} (graph {manifest['graph']})")
    print("compile run.c with:")
    print(" ".join(shlex.quote(word) for word in compile_command(out, out / "run")))
    print(f"then: {out / 'run'} {out} -p \"A graph is\" -n 40")
    return manifests


if __name__ == "__main__":
    main()
