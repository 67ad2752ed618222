"""Generated kernels read like llm.c's (issue 25): nothing a compiler would warn about as unused,
and parameters named after what they carry.

* the kernels of an MLP training step (examples/linear_graph.py's model, trained), a conv net with
  BatchNorm and the GPT of examples/gpt_char.py, in float32 and under bf16 autocast (and the MLP
  under fp16 autocast with a GradScaler), compile with
  g++ -Wall -Wextra -Werror=unused-variable -Werror=unused-but-set-variable against the emulator
  header (the CPU build's kernel flags, runtime/toolchain.kernel_flags), and for the GPU
  (rendered for the cuda target, sm_90) with NVRTC, whose log then holds no unused-variable
  warning ("declared but never referenced", "set but never used"); so do the conv family's
  variants (SIMT, tf32, bf16 warpgroup MMA, 1x1, split-k, depthwise) rendered alone;
* naming rule: no kernel parameter is named in<k> or out<k> (a generic name for a buffer):
  every buffer a kernel reads or writes has a value behind it whose name (a parameter's module
  path, a graph input) or producing op names it better;
* a permute that keeps the order of the non-unit dims ([1, 16] -> [16, 1]) is a view: no kernel.
"""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import render_node
from flowgen.codegen.program import build_program
from flowgen.codegen.target import rendering_for
from flowgen.codegen.templates import reads
from flowgen.ir.graph import Node, Value
from flowgen.ops.registry import TensorMeta, get_op
from flowgen.runtime import nvrtc
from flowgen.runtime.toolchain import CXX, kernel_flags, nvrtc_options, runtime_cpp_dir
from graphs import TrainGraph, train_like_eager

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt_char  # noqa: E402

GXX_WARNINGS = ["-Wall", "-Wextra", "-Werror=unused-variable", "-Werror=unused-but-set-variable"]
NVRTC_UNUSED = re.compile(r"declared but never referenced|set but never used")
GENERIC_PARAMETER = re.compile(r"\b(in|out)\d+$")


def _amp(graph, amp):
    """amp: False (float32), True (bf16 autocast) or "fp16" (fp16 autocast with a GradScaler in the
    step, whose nonfinite_flag kernel scans every gradient)."""
    if amp == "fp16":
        graph.config.enable_amp(True, dtype=flow.float16)
        graph.set_grad_scaler(flow.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=2))
    elif amp:
        graph.config.enable_amp(True, dtype=flow.bfloat16)
    return graph


def mlp_step(amp):
    flow.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    graph = _amp(TrainGraph(model, nn.MSELoss(), flow.optim.SGD(model.parameters(), lr=0.1)), amp)
    rng = np.random.default_rng(0)
    graph(flow.tensor(rng.standard_normal((8, 4)).astype(np.float32)),
          flow.tensor(rng.standard_normal((8, 1)).astype(np.float32)))
    return graph


def convnet_step(amp):
    flow.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4), nn.BatchNorm2d(4), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
    opt = flow.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    graph = _amp(TrainGraph(model, nn.CrossEntropyLoss(), opt), amp)
    rng = np.random.default_rng(0)
    graph(flow.tensor(rng.standard_normal((4, 3, 8, 8)).astype(np.float32)), flow.tensor(rng.integers(0, 10, 4)))
    return graph


def gpt_step(amp):
    corpus = gpt_char.Corpus()
    config = gpt_char.GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1)
    config.vocab_size = corpus.vocab_size
    flow.manual_seed(0)
    model = gpt_char.define(flow)(config)
    opt = model.configure_optimizer(weight_decay=0.1, learning_rate=3e-3, betas=(0.9, 0.95))

    class Step(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self, x, y):
            _, loss = self.model(x, y)
            loss.backward()
            flow.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            return loss

    graph = _amp(Step(), amp)
    graph(*next(corpus.batches(1, 2, config.block_size)))
    return graph


GRAPHS = [pytest.param(make, amp, id=f"{make.__name__}-{'bf16' if amp else 'fp32'}",
                       marks=[pytest.mark.slow] if make is gpt_step else [])
          for make in (mlp_step, convnet_step, gpt_step) for amp in (False, True)]
GRAPHS.append(pytest.param(mlp_step, "fp16", id="mlp_step-fp16-grad_scaler"))


def _gxx_diagnostics(source: str, tmp_path) -> subprocess.CompletedProcess:
    path = tmp_path / "kernels.cu"
    path.write_text(source)
    command = [CXX, *kernel_flags(["-O0"]), *GXX_WARNINGS, "-fsyntax-only", f"-I{runtime_cpp_dir()}",
               "-include", "flowgen_emu.h", "-x", "c++", str(path)]
    return subprocess.run(command, capture_output=True, text=True)


def _parameter_names(source: str) -> list:
    names = []
    for params in re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?\w+\(([^)]*)\)', source):
        names += [p.split()[-1] for p in params.split(", ") if p]
    return names


def _gpu_source(graph) -> str:
    return build_program(graph.compiled.ir, target="cuda", arch="sm_90").source


@pytest.mark.parametrize("make, amp", GRAPHS)
def test_kernels_compile_with_gxx_without_unused_variables(make, amp, tmp_path):
    graph = make(amp)
    source = graph.compiled.program.source
    gxx = _gxx_diagnostics(source, tmp_path)
    assert gxx.returncode == 0, gxx.stderr[-4000:]
    assert "unused" not in gxx.stderr, gxx.stderr[-4000:]
    for source in (source, _gpu_source(graph)):
        generic = [n for n in _parameter_names(source) if GENERIC_PARAMETER.fullmatch(n)]
        assert not generic, generic


@pytest.mark.parametrize("make, amp", GRAPHS)
def test_kernels_compile_with_nvrtc_without_unused_variables(make, amp, tmp_path):
    source = _gpu_source(make(amp))
    nvrtc._compile_into(source, nvrtc_options(nvrtc.cubin_arch(source, "sm_90")), tmp_path, "kernels.cubin")
    log = (tmp_path / "compile.log").read_text()
    assert not NVRTC_UNUSED.search(log), log[-4000:]


# (name, x shape [N, C, H, W], weight shape [O, C / groups, KH, KW], stride, padding, groups): the
# implicit-GEMM variants (3x3, strided and grouped, 1x1 as a plain GEMM, one whose grad_weight
# splits its reduction across blocks) and a depthwise one
CONV_GEOMETRIES = [("3x3", (2, 4, 9, 7), (6, 4, 3, 3), 1, 1, 1),
                   ("3x3_s2_g2", (2, 6, 11, 9), (4, 3, 3, 3), 2, 1, 2),
                   ("1x1", (2, 5, 6, 7), (7, 5, 1, 1), 1, 0, 1),
                   ("3x3_split_k", (8, 16, 32, 32), (16, 16, 3, 3), 1, 1, 1),
                   ("depthwise", (2, 6, 7, 7), (6, 1, 3, 3), 1, 1, 6)]


def _conv_nodes(dtype) -> list:
    """conv2d, conv2d_grad_input and conv2d_grad_weight of every CONV_GEOMETRIES entry."""
    nodes = []
    for name, x_shape, w_shape, stride, padding, groups in CONV_GEOMETRIES:
        attrs = dict(stride=(stride, stride), padding=(padding, padding), dilation=(1, 1), groups=groups)
        x, w = Value("x", x_shape, dtype), Value("w", w_shape, dtype)
        y = Value("y", get_op("conv2d").infer(TensorMeta(x_shape, dtype), TensorMeta(w_shape, dtype), **attrs).shape,
                  dtype)
        nodes += [Node("conv2d", [x, w], [y], attrs, scope=f"fwd_{name}"),
                  Node("conv2d_grad_input", [y, w], [Value("dx", x_shape, dtype)], dict(attrs, input_shape=x_shape),
                       scope=f"dgrad_{name}"),
                  Node("conv2d_grad_weight", [y, x], [Value("dw", w_shape, dtype)],
                       dict(attrs, weight_shape=w_shape), scope=f"wgrad_{name}")]
    return nodes


@pytest.mark.parametrize("dtype, tf32", [(flow.float32, False), (flow.float32, True), (flow.bfloat16, False)],
                         ids=["fp32", "tf32", "bf16"])
def test_every_conv_variant_compiles_with_nvrtc_without_unused_variables(dtype, tf32, tmp_path):
    """conv2d.cu.j2 declares only the geometry constants each variant's gathers read: SIMT, tf32
    and 16-bit warpgroup-MMA implicit GEMMs (forward, grad_input, grad_weight, split-k), 1x1
    convs and depthwise convs, rendered for sm_90."""
    with rendering_for("cuda", allow_tf32=tf32, arch="sm_90"):
        kernels = [k for i, node in enumerate(_conv_nodes(dtype))
                   for k in render_node(node, RenderContext(name=f"k{i}_{node.scope}"))]
    assert any("_combine" in k.name for k in kernels)   # a split-k grad_weight is among them
    source = f'#include "{nvrtc.PRELUDE}"\n' + "\n".join(k.source for k in kernels)
    nvrtc._compile_into(source, nvrtc_options(nvrtc.cubin_arch(source, "sm_90")), tmp_path, "kernels.cubin")
    log = (tmp_path / "compile.log").read_text()
    assert not NVRTC_UNUSED.search(log), log[-4000:]


def test_a_template_declares_what_the_code_reads_outside_its_comments():
    """templates.reads, the test a template asks before declaring a variable: a use counts, a
    comment's mention (a wgmma tile's `C(m, n)`), a member (`t.C`) or a longer name (`x_C`) does not."""
    assert reads("y[i] = C * x[i];", "C") and reads("if (ih < H) v = x[ih];", "H")
    assert not reads("float acc[32];   // register r: C(64 group, ...)\n/* C = A * B */ y = t.C + x_C;", "C")


def test_a_permute_keeping_the_memory_order_is_a_view():
    """Linear(16, 1)'s weight [1, 16] transposed to [16, 1] lists the same elements in the same
    order: the GEMM reads the weight's own buffer (no permute kernel), and training still equals
    eager; a transpose that moves elements ([16, 4] -> [4, 16], under autocast where a cast sits
    between it and the GEMM) stays a copy kernel."""
    flow.manual_seed(0)
    rng = np.random.default_rng(0)
    batches = [(flow.tensor(rng.standard_normal((8, 4)).astype(np.float32)),
                flow.tensor(rng.standard_normal((8, 1)).astype(np.float32))) for _ in range(2)]
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    graph, _, _ = train_like_eager(model, lambda p: flow.optim.SGD(p, lr=0.1), batches, loss_fn=nn.MSELoss())
    assert not [k.name for k in graph.compiled.program.kernels if k.ops == ["permute"]]
    copies = [k for k in mlp_step(amp=True).compiled.program.kernels if k.ops == ["permute"]]
    assert copies and all(sorted(k.args[0].value.shape) == [4, 16] for k in copies), [k.comment for k in copies]


def test_the_grad_scalers_scan_names_the_gradients_it_reads():
    """The GradScaler's nonfinite_flag kernel (one launch over every gradient of the fp16 MLP: two
    weights, two biases) names each buffer after the value it carries, and its output `flag`."""
    scans = [k for k in mlp_step("fp16").compiled.program.kernels
             if k.ops == ["nonfinite_flag"] and "isfinite(" in k.source]   # not its flag-zeroing kernel
    assert len(scans) == 1, [k.name for k in scans]
    names = _parameter_names(scans[0].source)
    assert len(set(names)) == 5 and names[-1] == "flag", names
    assert not [n for n in names if GENERIC_PARAMETER.fullmatch(n)], names
