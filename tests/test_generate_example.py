"""examples/generate (issue 27, item 5): text generation without Python. gpt_char's GPT as a
decoding step with its K/V caches as inputs and outputs (examples/generate/decode.py), built with
`--lib` (native cpu kernels, what `flowgen build --target cpu` gives a user) and driven by run.c,
compiled here with the system C compiler: its greedy tokens equal flowgen eager's and PyTorch's
greedy generation with the full, uncached model; its sampling is seeded and stays in the top-k;
bad prompts are refused with a message."""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flowgen as flow
from flowgen.codegen import aot
from torch_oracle import get_torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "generate"
BLOCK_SIZE = 16   # the caches' capacity: the longest sequence


def _load_build_script():
    spec = importlib.util.spec_from_file_location("generate_build", EXAMPLE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_build_script()
gpt_char = sys.modules["gpt_char"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The untrained GPT (seed 0) as a decoding-step library with native cpu kernels, and run.c."""
    tmp = tmp_path_factory.mktemp("generate")
    model, corpus = generate.make_model(steps=0, seed=0, block_size=BLOCK_SIZE)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FLOWGEN_CPU_KERNELS", "native")
        manifest = generate.export(model, corpus, tmp)
    binary = tmp / "run"
    subprocess.run(generate.compile_command(manifest, tmp / "build", binary, compiler="gcc"), check=True,
                   capture_output=True, text=True)
    return {"model": model, "corpus": corpus, "build": tmp / "build", "run": binary, "manifest": manifest}


def run_c(built, *args):
    return subprocess.run([str(built["run"]), str(built["build"]), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def generated_ids(proc) -> list:
    assert proc.returncode == 0, proc.stderr
    return [int(word) for word in proc.stdout.split()]


def full_logits(model, ids) -> np.ndarray:
    """The last position's logits of the full (uncached) forward over `ids`."""
    with flow.no_grad():
        return model(flow.tensor(np.array([ids], np.int64)))[0].numpy()[0, -1]


def test_run_c_greedy_equals_eager_and_pytorch_without_a_cache(built):
    model, prompt = built["model"], [3, 14, 1, 20]
    proc = run_c(built, "-i", ",".join(map(str, prompt)), "-n", 100, "-r")
    ours = generated_ids(proc)
    assert len(ours) == BLOCK_SIZE and ours[:len(prompt)] == prompt   # stopped at the capacity
    assert f"stopping at {BLOCK_SIZE} tokens, the model's capacity" in proc.stderr
    assert re.search(rf"{BLOCK_SIZE - 1} calls \({len(prompt)} prompt tokens, {BLOCK_SIZE - len(prompt)} generated\) "
                     r"in [0-9.]+ s: [0-9.]+ tok/s", proc.stderr)

    eager = list(prompt)
    while len(eager) < BLOCK_SIZE:
        logits = full_logits(model, eager)
        top = np.sort(logits)[-2:]
        assert top[1] - top[0] > 1e-4   # no near-tie for float rounding to decide
        eager.append(int(np.argmax(logits)))
    assert ours == eager

    torch = get_torch()
    twin = gpt_char.define(torch)(model.config).eval()
    twin.load_state_dict({k: torch.from_numpy(v.numpy().copy()) for k, v in model.state_dict().items()})
    theirs = torch.tensor([prompt])
    with torch.no_grad():
        while theirs.shape[1] < BLOCK_SIZE:
            theirs = torch.cat([theirs, twin(theirs)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert theirs[0].tolist() == eager


def check_step_logits(build: Path, built) -> None:
    """The decoding step through flow.load_compiled, caches carried from call to call as run.c
    does: position t's logits are the full forward's at t."""
    library = flow.load_compiled(build)
    assert [str(t) for t in library.inputs[:3]] == ["input_0: int64[1, 1]", "input_1: int64[1]",
                                                    f"input_2: float32[1, 4, {BLOCK_SIZE}, 16]"]
    assert len(library.inputs) == 2 + 2 * built["model"].config.n_layer == len(library.outputs) + 1
    ids = built["corpus"].ids[:BLOCK_SIZE].tolist()
    caches = [np.zeros((1, 4, BLOCK_SIZE, 16), np.float32) for _ in range(len(library.inputs) - 2)]
    with flow.no_grad():
        expected = built["model"](flow.tensor(np.array([ids])))[0].numpy()[0]
    for pos, token in enumerate(ids):
        logits, *caches = library(np.array([[token]], np.int64), np.array([pos], np.int64), *caches)
        np.testing.assert_allclose(logits[0], expected[pos], rtol=1e-4, atol=1e-5)
    assert np.count_nonzero(caches[0][0, :, :, 0]) == 4 * BLOCK_SIZE   # every position written
    library.close()


def test_the_library_step_gives_the_full_forwards_logits_at_every_position(built):
    check_step_logits(built["build"], built)


@pytest.mark.slow
def test_the_step_as_cuda_source_on_the_emulator(built, tmp_path):
    """The same saved step built with every kernel the CUDA source (what a cuda build runs), on
    the emulator."""
    aot.build(built["build"].parent / "saved", tmp_path / "emulator", target="emulator", lib=True)
    check_step_logits(tmp_path / "emulator", built)


def test_sampling_is_seeded_and_stays_in_the_top_k(built):
    model, k = built["model"], 5
    prompt = built["corpus"].ids[:3].tolist()
    args = ("-i", ",".join(map(str, prompt)), "-n", 10, "-t", 0.8, "-k", k, "-r")
    first = generated_ids(run_c(built, *args, "-s", 7))
    assert generated_ids(run_c(built, *args, "-s", 7)) == first
    assert generated_ids(run_c(built, *args, "-s", 8)) != first
    assert len(first) == len(prompt) + 10 and first[:3] == prompt
    for end in range(len(prompt), len(first)):
        top_k = np.argsort(full_logits(model, first[:end]))[-k:]
        assert first[end] in top_k


def test_a_text_prompt_reads_the_vocabulary_beside_the_build(built):
    corpus = built["corpus"]
    text = corpus.decode(corpus.ids[:6])
    proc = run_c(built, "-p", text, "-n", 5)
    assert proc.returncode == 0, proc.stderr
    ids = generated_ids(run_c(built, "-i", ",".join(map(str, corpus.ids[:6])), "-n", 5, "-r"))
    assert proc.stdout == corpus.decode(ids) + "\n"


def test_bad_prompts_and_files_are_refused_with_a_message(built, tmp_path):
    """Each refused with its reason, by run.c as built and by run.c under AddressSanitizer and
    UndefinedBehaviorSanitizer (leaks included), which also generates a sampled sequence cleanly."""
    corpus = built["corpus"]
    sanitized = tmp_path / "run_asan"
    command = generate.compile_command(built["manifest"], built["build"], sanitized, compiler="gcc")
    subprocess.run([*command, "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"], check=True,
                   capture_output=True, text=True)
    too_long = ",".join(["1"] * (BLOCK_SIZE + 1))
    cases = [(("-i", too_long), rf"more than {BLOCK_SIZE} tokens; the model's KV cache holds {BLOCK_SIZE} positions"),
             (("-p", corpus.decode(corpus.ids[:BLOCK_SIZE + 3])),
              rf"has {BLOCK_SIZE + 3} characters; the model's KV cache holds {BLOCK_SIZE} positions"),
             (("-i", "0,37"), r"token id 37 \(prompt position 1\) is outside the vocabulary: 0 to 36"),
             (("-i", "-2"), r"token id -2 \(prompt position 0\) is outside the vocabulary"),
             (("-i", "4,x"), r"expected token ids separated by commas, at \"x\""),
             (("-p", "Q"), r"character 0 \('Q'\) is not in the vocabulary"),
             (("-p", ""), r"the prompt is empty"),
             (("-t", "-1"), r"must not be negative"),
             (("-n", "ten"), r"-n ten: expected a whole number"),
             (("-k", "2.5"), r"-k 2.5: expected a whole number")]
    for binary in (built["run"], sanitized):
        for args, message in cases:
            proc = subprocess.run([str(binary), str(built["build"]), *args], capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 1 and re.search(message, proc.stderr), (binary.name, args, proc.stderr)
            assert proc.stdout == "" and "Sanitizer" not in proc.stderr
        proc = subprocess.run([str(binary), str(tmp_path)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and "flowgen_create: cannot open weights file" in proc.stderr, proc.stderr
        assert subprocess.run([str(binary), str(built["build"]), "-q"], capture_output=True).returncode == 2
    proc = subprocess.run([str(sanitized), str(built["build"]), "-i", "1,2", "-n", "100", "-t", "0.9", "-k", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    # Past run.c's checks, the library refuses them too: the embeddings check their indices.
    library = flow.load_compiled(built["build"])
    caches = [np.zeros(t.shape, np.float32) for t in library.inputs[2:]]
    with pytest.raises(IndexError, match="37"):
        library(np.array([[37]], np.int64), np.array([0], np.int64), *caches)
    with pytest.raises(IndexError, match=str(BLOCK_SIZE)):
        library(np.array([[1]], np.int64), np.array([BLOCK_SIZE], np.int64), *caches)


def _readme_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"^### Generating text without Python\n(.*?)(?=^##|\Z)", readme, flags=re.S | re.M).group(1)


@pytest.mark.slow
def test_readme_commands_run(tmp_path):
    """The subsection's commands, run in a fresh directory (examples/ paths pointed at the repo;
    build.py without training, to stay quick)."""
    section = _readme_section()
    commands = [line.split("  #", 1)[0].strip()
                for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", section, flags=re.S | re.M)
                for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert commands[0].startswith("python examples/generate/build.py") and commands[1].startswith("cc ")
    for command in commands:
        words = shlex.split(command.replace("examples/", f"{ROOT}/examples/").replace("$PWD", str(tmp_path)))
        if words[0] == "python":
            words = [sys.executable, *words[1:], "--steps", "0", "--block-size", str(BLOCK_SIZE)]
        proc = subprocess.run(words, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "FLOWGEN_CPU_KERNELS": "native"})
        assert proc.returncode == 0, (command, proc.stdout, proc.stderr)
        if words[0].endswith("/run"):
            assert "tok/s" in proc.stderr and proc.stdout.strip()


@pytest.mark.slow
def test_generate_tokens_benchmark_runs(tmp_path):
    out = tmp_path / "generate_tokens.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_tokens.py"), "--steps", "0", "--repeats", "2",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=900)
    rows = json.loads(out.read_text())["rows"]
    assert {row["runner"] for row in rows} >= {"flowgen run.c", "torch eager, KV cache"}
    assert all(row["median_tokens_per_s"] > 0 for row in rows)


def test_readme_numbers_are_the_committed_benchmark():
    data = json.loads((ROOT / "benchmarks" / "results" / "generate_tokens.json").read_text())
    median = {(row["runner"], row["threads"]): row["median_tokens_per_s"] for row in data["rows"]}
    rate = {key: f"{value:.0f}" for key, value in median.items()}
    text = " ".join(_readme_section().split())
    assert (f"`run.c` on the library {rate['flowgen run.c', 1]} tok/s on one thread and {rate['flowgen run.c', 2]} "
            f"on two") in text
    assert (f"growing KV cache {rate['torch eager, KV cache', 1]} and {rate['torch eager, KV cache', 2]}, and running "
            f"the same at-capacity step {rate['torch eager, at capacity', 1]} and "
            f"{rate['torch eager, at capacity', 2]}") in text
    environment = data["environment"]
    assert f"flowgen {environment['flowgen_commit'][:7]}, {environment['date_utc'][:10]}" in text
    assert f"the median of {data['repeats']} repeats" in text
    assert f"load average of {environment['load_average_start'][0]:.1f}" in text
    speedup = median["flowgen run.c", 1] / median["torch eager, KV cache", 1]
    assert f"about {speedup:.1f} times as fast" in text
