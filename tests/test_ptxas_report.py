"""ptxas's resource report on the tensor-core kernels, for sm_80 and sm_90, without a GPU: NVRTC with
`--ptxas-options=--verbose` says, per kernel, its registers, stack frame and spills; each kernel's
source says which shared-memory tiles it indexes. Checked for every tensor-core kernel (GEMMs and
convs on mma.sync or wgmma, tiled attention on mma.sync):
- no stack frame and no spills (local memory is slow, and a spill is a sign the tile is too big);
  the attention kernels with dropout may keep DROPOUT_LOCAL_BYTES there;
- registers at most REGISTER_CEILING, a margin under the 255 a thread can have, so that a small
  change to a template does not tip a kernel into spilling (the 256-wide wgmma tiles: 255);
- the dynamic shared memory the launch requests (`Kernel.smem`) is what the kernel's tiles take
  (the wgmma kernels: plus up to 1024 bytes to start the tiles at a 1024-byte boundary), so no
  launch asks for shared memory that would only cost occupancy.
The default run checks kernels rendered directly (benchmarks/first_contact_cases.py); the slow run
the tensor-core kernels of the example graphs under bf16 AMP (examples/gpt_char.py's model,
examples/mobilenet_v2_cifar10.py's MobileNetV2), rendered for both GPUs.
"""
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import flowgen as flow
from first_contact_cases import AttentionCase, ConvCase, GemmCase
from flowgen.codegen.program import build_program
from flowgen.runtime import nvrtc
from test_tensor_cores import build_with_ptxas_report

# 255 registers a thread at most; every tensor-core kernel stays this far under it, but for the wgmma
# tiles 256 columns wide: a warpgroup's 64 x 256 fp32 accumulators alone take 128 registers a thread,
# and their launch bounds (256 threads, 1 block) give each thread all 255 (the f16 GEMM with A^T, whose
# mn-major copies take more address arithmetic, sits at 254 on sm_90 without spilling).
REGISTER_CEILING, WIDE_WGMMA_REGISTER_CEILING = 240, 255
# The wgmma kernels start their tiles at the first 1024-byte boundary of the shared window (the
# 128-byte swizzle repeats every 1024 bytes), so they ask for up to that much more than they index.
WGMMA_ALIGNMENT = 1024
# The attention kernels with dropout keep the Philox rounds' state as well; ptxas may put a few words
# of it in local memory (sm_90, bf16 dK/dV at head dim 32: 16 bytes of stack, 12 spilled).
DROPOUT_LOCAL_BYTES = 16
CTYPE_BYTES = {"__nv_bfloat16": 2, "__half": 2, "float": 4, "unsigned": 4, "double": 8}


def ptxas_resources(kernels: list, arch: str) -> dict:
    """{kernel name: (registers, 'N bytes stack frame, N bytes spill stores, N bytes spill loads')}
    from ptxas --verbose on `kernels` compiled together for `arch` (sm_90a where they use wgmma)."""
    source = "\n".join(k.source for k in kernels)
    _, log = build_with_ptxas_report(source, nvrtc.cubin_arch(source, arch))
    found = re.findall(r"Compiling entry function '(\w+)'.*?Function properties for \w+\s*ptxas\s+\.\s+([^\n]*)"
                       r"\s*ptxas info\s+:\s+Used (\d+) registers", log, re.S)
    return {name: (int(registers), frame) for name, frame, registers in found}


def shared_bytes_indexed(source: str) -> tuple:
    """(bytes of dynamic shared memory the kernel's tiles take, allowed excess of the request) read
    from the kernel's own declarations: the tiled attention's tile pointers (offset, [rows x length]
    and buffers), or the GEMM/conv pipelines' stages (and the wgmma epilogue's fp32 tile)."""
    tiles = re.findall(r"(\w+)\* const \w+ = reinterpret_cast<\w+\*>\(smem \+ (\d+)\);  // \[(?:(\d+) x )?(\d+)\]"
                       r"(?: x (\d+) buffers)?", source)
    if tiles:   # attention_tiled.cu.j2
        return max(int(offset) + CTYPE_BYTES[ctype] * int(rows or 1) * int(length) * int(buffers or 1)
                   for ctype, offset, rows, length, buffers in tiles), 0
    stages = int(re.search(r"// (\d+) stages of \[A tile \| B tile\]", source).group(1))
    elem, stage_elems = re.search(r"(\w+)\* as = smem \+ stage \* (\d+);", source).groups()
    used = stages * int(stage_elems) * CTYPE_BYTES[elem]
    if "smem_raw" not in source:   # _mma.j2: the stages from the window's start
        return used, 0
    epilogue = re.search(r"float\* tile = reinterpret_cast<float\*>\(smem\);   // (\d+) rows of (\d+) \+ (\d+) floats",
                         source)
    if epilogue:
        rows, columns, pad = map(int, epilogue.groups())
        used = max(used, rows * (columns + pad) * 4)
    return used, WGMMA_ALIGNMENT


def check_tensor_core_kernels(kernels: list, arch: str):
    resources = ptxas_resources(kernels, arch)
    assert set(resources) == {k.name for k in kernels}
    for k in kernels:
        registers, frame = resources[k.name]
        stack, stores, loads = map(int, re.fullmatch(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", frame).groups())
        allowed = DROPOUT_LOCAL_BYTES if "dropout" in k.ops[0] else 0
        assert max(stack, stores, loads) <= allowed, (arch, k.name, frame)
        wide_wgmma = re.search(r"GEMM \d+x256, \w+ wgmma", k.comment) is not None
        assert registers <= (WIDE_WGMMA_REGISTER_CEILING if wide_wgmma else REGISTER_CEILING), (arch, k.name, registers)
        used, allowance = shared_bytes_indexed(k.source)
        assert used <= k.smem <= used + allowance, (arch, k.name, "requests", k.smem, "indexes", used)


def is_tensor_core_kernel(kernel) -> bool:
    """Whether the kernel's comment says it runs on tensor cores ("tensor-core GEMM ...", "on tensor
    cores, ...", "tensor cores, bf16 mma.sync")."""
    return re.search(r"tensor[ -]core", kernel.comment) is not None


# ---------------------------------------------------------------------------------------
# Rendered directly: each tensor-core family at a size that picks its large tiles

RESNET_3X3 = ("resnet_3x3", 8, 64, 28, 28, 64, (3, 3), (1, 1), (1, 1), (1, 1), 1)


def direct_cases(arch):
    sm_90 = "sm_90" if arch == "sm_90" else None
    attention = [k for dtype, E, Ev, causal in ((flow.bfloat16, 64, 64, True), (flow.float16, 128, 128, False),
                                                (flow.bfloat16, 80, 48, False))
                 for op in ("attention", "attention_backward")
                 for k in AttentionCase(op, dtype, 2, 4, 200, 200, E, Ev, causal=causal, prefix=f"px{arch}").kernels]
    gemms = [GemmCase(kind, 4096, 4096, 4096, a_trans, b_trans, arch=sm_90, prefix=f"px{arch}").kernel
             for kind, a_trans, b_trans in (("bf16", False, True), ("f16", True, False), ("tf32", False, False))]
    convs = [k for kind in ("bf16", "tf32") for op in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
             for k in ConvCase(kind, op, RESNET_3X3, arch=sm_90, prefix=f"px{arch}").kernels]
    return attention + gemms + convs


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tensor_core_kernels_have_no_spills_registers_to_spare_and_exact_shared_memory(arch):
    kernels = [k for k in direct_cases(arch) if is_tensor_core_kernel(k)]
    assert len(kernels) == 9 + 3 + 6   # attention, GEMMs, convs (not split-k weight gradients' combine kernels)
    check_tensor_core_kernels(kernels, arch)


def test_tiled_attention_requests_the_shared_memory_its_tiles_take():
    """The forward kernel at head dim 128: Q (64 rows of 128 + 8) and two buffers each of K and V
    tiles, bf16: 5 x 17408 bytes (it once requested the dQ kernel's layout)."""
    forward, dq, dkdv = [k for op in ("attention", "attention_backward")
                         for k in AttentionCase(op, flow.bfloat16, 1, 1, 64, 64, 128, 128, prefix="pxs").kernels]
    assert forward.smem == 5 * 64 * 136 * 2
    assert dq.smem == 2 * 64 * 136 * 2 + 2 * 64 * 4 + 2 * 2 * 32 * 136 * 2     # Q, dO, lse, D; 32-row K, V x 2
    assert dkdv.smem == 2 * 64 * 136 * 2 + 2 * 2 * 16 * 136 * 2 + 2 * 2 * 16 * 4  # K, V; 16-row Q, dO, lse, D x 2
    assert all(shared_bytes_indexed(k.source) == (k.smem, 0) for k in (forward, dq, dkdv))


# ---------------------------------------------------------------------------------------
# The example graphs under bf16 AMP, rendered for each GPU

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def gpt_char_step():
    """examples/gpt_char.py's model (head dim 64, dropout) as a bf16 AMP training step."""
    sys.path.insert(0, str(EXAMPLES))
    import gpt_char   # noqa: E402
    config = gpt_char.GPTConfig(block_size=128, n_layer=1, n_head=2, n_embd=128, dropout=0.1)
    config.vocab_size = 65
    model = gpt_char.define(flow)(config)
    optimizer = model.configure_optimizer(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95))

    class Step(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(optimizer)
            self.config.enable_amp(True, dtype=flow.bfloat16)

        def build(self, x, y):
            _, loss = self.model(x, y)
            loss.backward()
            return loss

    tokens = flow.tensor(np.random.default_rng(0).integers(0, 65, (4, 128)))
    return Step(), (tokens, tokens)


def mobilenet_step():
    """examples/mobilenet_v2_cifar10.py's MobileNetV2 (width 0.25) as a bf16 AMP training step."""
    sys.path.insert(0, str(EXAMPLES))
    from flowgen.models import mobilenet_v2
    model = mobilenet_v2(width_mult=0.25)
    loss_fn = flow.nn.CrossEntropyLoss()
    optimizer = flow.optim.SGD(model.parameters(), lr=0.01)

    class Step(flow.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model, self.loss_fn = model, loss_fn
            self.add_optimizer(optimizer)
            self.config.enable_amp(True, dtype=flow.bfloat16)

        def build(self, x, y):
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            return loss

    rng = np.random.default_rng(0)
    return Step(), (flow.tensor(rng.standard_normal((8, 3, 32, 32)).astype(np.float32)),
                    flow.tensor(rng.integers(0, 10, 8)))


@pytest.mark.slow   # traces and compiles two training steps for the emulator, then ptxas: about a minute
@pytest.mark.parametrize("example", [gpt_char_step, mobilenet_step], ids=["gpt_char", "mobilenet_v2"])
def test_example_graphs_tensor_core_kernels_under_bf16_amp(example):
    graph, inputs = example()
    graph._compile(*inputs)
    for arch in ("sm_80", "sm_90"):
        kernels = [k for k in build_program(graph._last.ir, target="cuda", arch=arch).kernels
                   if is_tensor_core_kernel(k)]
        assert kernels, arch
        check_tensor_core_kernels(kernels, arch)
