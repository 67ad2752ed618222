"""examples/generate (issue 27, item 5): text generation without Python. gpt_char's GPT as two
libraries with a dynamic dimension each (examples/generate/build.py): the prefill of a prompt of
any length (prefill.py) and a decoding step whose K/V caches, of any length, are inputs and grow
by one position in its outputs (decode.py), built with `--lib` (native cpu kernels, what `flowgen
build --target cpu` gives a user) and driven by run.c (both opened with dlopen), compiled here
with the system C compiler: its greedy tokens equal flowgen eager's and PyTorch's greedy
generation with the full, uncached model; each library call's logits equal the full forward's at
its position; its sampling is seeded and stays in the top-k; bad prompts are refused with a
message."""
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
BLOCK_SIZE = 16   # the longest sequence: the prefill's longest prompt, one more than the step's caches


def _load_build_script():
    spec = importlib.util.spec_from_file_location("generate_build", EXAMPLE / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_build_script()
gpt_char = sys.modules["gpt_char"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The untrained GPT (seed 0) as prefill and decoding-step libraries with native cpu kernels,
    and run.c."""
    tmp = tmp_path_factory.mktemp("generate")
    model, corpus = generate.make_model(steps=0, seed=0, block_size=BLOCK_SIZE)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("FLOWGEN_CPU_KERNELS", "native")
        manifests = generate.export(model, corpus, tmp / "build")
    binary = tmp / "run"
    subprocess.run(generate.compile_command(tmp / "build", binary, compiler="gcc"), check=True,
                   capture_output=True, text=True)
    return {"model": model, "corpus": corpus, "build": tmp / "build", "run": binary, "manifests": manifests}


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
    generated = BLOCK_SIZE - len(prompt)
    assert re.search(rf"{generated} tokens generated in [0-9.]+ s: [0-9.]+ tok/s \(1 prefill call of {len(prompt)} "
                     rf"prompt tokens, [0-9.]+ s, then {generated - 1} decode calls\)", proc.stderr), proc.stderr

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
    """The two libraries through flow.load_compiled, the caches carried from call to call as run.c
    does: the prefill of prompts of several lengths, then the step at each later position; every
    call's logits are the full forward's at its last position, and the caches grow a position a
    call (those stepped to the end equal the prefill's of the whole sequence)."""
    n_caches = 2 * built["model"].config.n_layer
    with flow.load_compiled(build / "prefill") as prefill, flow.load_compiled(build / "decode") as step:
        assert [str(t) for t in prefill.inputs] == ["input_0: int64[1, ?]"]
        assert (prefill.inputs[0].min_shape, prefill.inputs[0].max_shape) == ((1, 1), (1, BLOCK_SIZE))
        assert [str(t) for t in prefill.outputs] == [
            "output_0: float32[1, 37]", *[f"output_{i}: float32[1, 4, ?, 16]" for i in range(1, 1 + n_caches)]]
        assert [str(t) for t in step.inputs[:3]] == ["input_0: int64[1, 1]", "input_1: int64[1]",
                                                     "input_2: float32[1, 4, ?, 16]"]
        assert (step.inputs[2].min_shape, step.inputs[2].max_shape) == ((1, 4, 1, 16), (1, 4, BLOCK_SIZE - 1, 16))
        assert len(step.inputs) == 2 + n_caches == len(step.outputs) + 1
        ids = built["corpus"].ids[:BLOCK_SIZE].tolist()
        with flow.no_grad():
            expected = built["model"](flow.tensor(np.array([ids])))[0].numpy()[0]
        _, *whole = prefill(np.array([ids], np.int64))
        for n in (1, 2, 7, BLOCK_SIZE - 1, BLOCK_SIZE):
            logits, *caches = prefill(np.array([ids[:n]], np.int64))
            np.testing.assert_allclose(logits[0], expected[n - 1], rtol=1e-4, atol=1e-5, err_msg=f"prefill of {n}")
            assert all(cache.shape == (1, 4, n, 16) for cache in caches)
            for pos in range(n, BLOCK_SIZE):
                logits, *caches = step(np.array([[ids[pos]]], np.int64), np.array([pos], np.int64), *caches)
                np.testing.assert_allclose(logits[0], expected[pos], rtol=1e-4, atol=1e-5,
                                           err_msg=f"step at {pos} after a prefill of {n}")
                assert all(cache.shape == (1, 4, pos + 1, 16) for cache in caches)
            for cache, full in zip(caches, whole):
                np.testing.assert_allclose(cache, full, rtol=1e-4, atol=1e-5)


def test_the_libraries_give_the_full_forwards_logits_at_every_position(built):
    check_step_logits(built["build"], built)


@pytest.mark.slow
def test_the_step_as_cuda_source_on_the_emulator(built, tmp_path):
    """The same saved prefill and step built with every kernel the CUDA source (what a cuda build
    runs), on the emulator: every kernel's launch grid is the same at every length (so the cuda
    target builds them too; a grid that followed the length would be refused)."""
    for part, name in generate.LIBRARY_NAMES.items():
        aot.build(built["build"] / "saved" / part, tmp_path / "emulator" / part, target="emulator", lib=True,
                  name=name)
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


def test_bad_prompts_and_files_are_refused_with_a_message(built, tmp_path, monkeypatch):
    """Each refused with its reason, by run.c as built and by run.c under AddressSanitizer and
    UndefinedBehaviorSanitizer (leaks included), which also generates a sampled sequence cleanly."""
    corpus, build = built["corpus"], built["build"]
    sanitized = tmp_path / "run_asan"
    command = generate.compile_command(build, sanitized, compiler="gcc")
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
    # Folders of other libraries: none; the prefill without its weights; the step as the prefill;
    # a prefill built at one fixed prompt length (no dynamic dimension).
    def folder(name, prefill, decode):
        for part, library in (("prefill", prefill), ("decode", decode)):
            (tmp_path / name / part).mkdir(parents=True)
            if library:
                (tmp_path / name / part / f"lib{generate.LIBRARY_NAMES[part]}.so").symlink_to(library)
        return tmp_path / name

    prefill_so, decode_so = (build / part / f"lib{name}.so" for part, name in generate.LIBRARY_NAMES.items())
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "native")   # as build.py's (the emulator's link libgomp, whose
    fixed = generate.GPTPrefill(generate.define_prefill(flow)(built["model"]))   # dlclose LeakSanitizer reports)
    with flow.no_grad():
        fixed(flow.tensor(np.zeros((1, BLOCK_SIZE), np.int64)))
    flow.save(fixed, tmp_path / "fixed_saved")
    aot.build(tmp_path / "fixed_saved", tmp_path / "fixed_build", target="cpu", lib=True, name="gpt_prefill")
    files = [(tmp_path / "missing", r"cannot open the prefill library: .*missing/prefill/libgpt_prefill.so"),
             (folder("no_weights", prefill_so, decode_so),
              r"libgpt_prefill.so: flowgen_create: cannot open weights file .*no_weights/prefill/weights.safetensors"),
             (folder("swapped", decode_so, decode_so),
              r"prefill/libgpt_prefill.so takes 6 inputs and gives 5 outputs; the prefill takes the prompt"),
             (folder("fixed", tmp_path / "fixed_build" / "libgpt_prefill.so", decode_so),
              rf"input 0 \(input_0\) is int64 \[1, {BLOCK_SIZE}\], expected int64 \[1, seq\] "
              r"\(the prompt\): not the library examples/generate/build.py builds")]
    for binary in (built["run"], sanitized):
        for args, message in cases:
            proc = subprocess.run([str(binary), str(build), *args], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 1 and re.search(message, proc.stderr), (binary.name, args, proc.stderr)
            assert proc.stdout == "" and "Sanitizer" not in proc.stderr
        for where, message in files:
            proc = subprocess.run([str(binary), str(where)], capture_output=True, text=True, timeout=60)
            assert proc.returncode == 1 and re.search(message, proc.stderr), (binary.name, where, proc.stderr)
            assert proc.stdout == "" and "Sanitizer" not in proc.stderr
        assert subprocess.run([str(binary), str(build), "-q"], capture_output=True).returncode == 2
    proc = subprocess.run([str(sanitized), str(build), "-i", "1,2", "-n", "100", "-t", "0.9", "-k", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr
    assert f"{BLOCK_SIZE - 2} tokens generated" in proc.stderr and len(proc.stdout) == BLOCK_SIZE + 1
    # Past run.c's checks, the libraries refuse them too: the embeddings check their indices.
    with flow.load_compiled(build / "prefill") as prefill, flow.load_compiled(build / "decode") as step:
        with pytest.raises(IndexError, match="37"):
            prefill(np.array([[1, 37]], np.int64))
        caches = [np.zeros((1, 4, 3, 16), np.float32) for _ in step.inputs[2:]]
        with pytest.raises(IndexError, match="37"):
            step(np.array([[37]], np.int64), np.array([3], np.int64), *caches)
        with pytest.raises(IndexError, match=str(BLOCK_SIZE)):
            step(np.array([[1]], np.int64), np.array([BLOCK_SIZE], np.int64), *caches)
        with pytest.raises(ValueError, match="past"):   # the step needs a cache of at least one position
            step(np.array([[1]], np.int64), np.array([0], np.int64), *[c[:, :, :0] for c in caches])


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
    assert {(row["phase"], row["runner"]) for row in rows} >= {
        ("generate", "flowgen run.c"), ("generate", "torch eager, KV cache"),
        ("prompt", "flowgen prefill"), ("prompt", "torch eager, prefill")}
    assert all(row["median_tokens_per_s"] > 0 for row in rows)


def test_readme_numbers_are_the_committed_benchmark():
    data = json.loads((ROOT / "benchmarks" / "results" / "generate_tokens.json").read_text())
    median = {(row["runner"], row["threads"]): row["median_tokens_per_s"] for row in data["rows"]}
    rate = {key: f"{value:.0f}" for key, value in median.items()}
    text = " ".join(_readme_section().split())
    assert (f"`run.c` on the libraries {rate['flowgen run.c', 1]} tok/s on one thread and {rate['flowgen run.c', 2]} "
            f"on two") in text
    assert f"growing KV cache {rate['torch eager, KV cache', 1]} and {rate['torch eager, KV cache', 2]}" in text
    assert (f"{rate['flowgen prefill', 1]} tok/s on one thread and {rate['flowgen prefill', 2]} on two through "
            f"`flow.load_compiled`, PyTorch's same forward {rate['torch eager, prefill', 1]} and "
            f"{rate['torch eager, prefill', 2]}") in text
    environment = data["environment"]
    assert f"flowgen {environment['flowgen_commit'][:7]}, {environment['date_utc'][:10]}" in text
    assert f"the median of {data['repeats']} repeats" in text
    assert f"load average of {environment['load_average_start'][0]:.1f}" in text
    speedup = median["flowgen run.c", 1] / median["torch eager, KV cache", 1]
    assert f"about {speedup:.1f} times as fast" in text
