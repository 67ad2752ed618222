"""Conv algorithm search on the GPU (`config.enable_cudnn_conv_heuristic_search_algo(True)`).

For every implicit-GEMM conv of a graph (forward, grad-input, grad-weight), the cost model's
best few tile shapes are compiled side by side, each is timed on the device with random data,
and the fastest is kept. Results are cached per GPU architecture in
`<cache>/autotune/conv_<arch>.json` (written atomically), so each conv shape is measured once;
`with_conv_tiles` writes the choices into the conv nodes' ``tile`` attribute, so they travel
with the IR (graph.json included) to every program rendered from it.
"""
from __future__ import annotations

import ctypes
import json
import time

import numpy as np

from flowgen.codegen.kernel import RenderContext
from flowgen.codegen.kernels import family_of, render_node
from flowgen.codegen.kernels.conv import conv_key, conv_tile_candidates
from flowgen.ir.graph import Node
from flowgen.runtime.toolchain import atomic_write_bytes, cache_dir

CANDIDATES = 4
REPEATS = 10


def _conv_nodes(graph):
    for node in graph.nodes:
        for n in (node.body if node.op == "fused" else [node]):
            if family_of(n) == "conv2d":
                yield n


def _with_tile(node, dims):
    return Node(node.op, node.inputs, node.outputs, {**node.attrs, "tile": tuple(int(d) for d in dims)},
                node.scope, node.loc)


def with_conv_tiles(graph, choices: dict):
    """The graph with every conv whose `conv_key` has a choice rendering that tile (IR -> IR)."""
    if not choices:
        return graph

    def tiled(node):
        if node.op == "fused":
            return Node(node.op, node.inputs, node.outputs, {**node.attrs, "body": [tiled(n) for n in node.body]},
                        node.scope, node.loc)
        if family_of(node) == "conv2d":
            dims = choices.get(conv_key(node))
            if dims is not None:
                return _with_tile(node, dims)
        return node

    return graph.copy_with(nodes=[tiled(n) for n in graph.nodes])


def _cache_path(arch: str):
    return cache_dir() / "autotune" / f"conv_{arch}.json"


def _load(arch: str) -> dict:
    try:
        return json.loads(_cache_path(arch).read_text())
    except (OSError, ValueError):
        return {}


def _time_candidates(node, candidates, ctx, arch, log) -> tuple:
    """Compile one kernel set per candidate tile, time each on random inputs; the fastest dims."""
    # Imported here, not at the top: cuda-python's bindings take ~0.3 s to load (autotune runs on a GPU only).
    from flowgen.runtime.cuda_driver import CudaModule
    from flowgen.runtime.nvrtc import compile_cuda

    variants = [render_node(_with_tile(node, dims), RenderContext(name=f"tune{k}_{node.op}"))
                for k, dims in enumerate(candidates)]
    source = "#include \"flowgen_cuda_prelude.h\"\n" + "\n".join(k.source for ks in variants for k in ks)
    module = CudaModule(compile_cuda(source, arch, tag="autotune"))
    rng = np.random.default_rng(0)
    buffers = {}
    for v in list(node.inputs) + list(node.outputs):
        buffers[v] = ctx.alloc(v.nbytes)
        if v in node.inputs:
            ctx.memcpy_htod(buffers[v], rng.standard_normal(v.shape).astype(v.dtype.np_dtype))
    for arg in (a for ks in variants for k in ks for a in k.args):   # a split-k grad_weight's partials
        if arg.value not in buffers:
            buffers[arg.value] = ctx.alloc(arg.value.nbytes)
    try:
        times = []
        for dims, kernels in zip(candidates, variants):
            launches = [(k, [ctypes.c_void_p(buffers[a.value]) for a in k.args]) for k in kernels]

            def run():
                for k, args in launches:
                    module.launch(k.name, k.grid, k.block, k.smem, args)

            run()
            ctx.synchronize()
            start = time.perf_counter()
            for _ in range(REPEATS):
                run()
            ctx.synchronize()
            times.append((time.perf_counter() - start) / REPEATS)
        best = min(range(len(candidates)), key=times.__getitem__)
        if log is not None:
            log(1, f"(AUTOTUNE) {node.scope or 'graph'} {node.op}: " + ", ".join(
                f"{'x'.join(map(str, d[:2]))}/{d[2]}x{d[3]} {t * 1e6:.1f} us" for d, t in zip(candidates, times))
                + f" -> {'x'.join(map(str, candidates[best][:2]))}")
        return tuple(candidates[best]), times[best]
    finally:
        for ptr in buffers.values():
            ctx.free(ptr)
        module.close()


def tune_convs(graph, log=None) -> dict:
    """conv_key -> tile dims for every implicit-GEMM conv of `graph` (measuring unseen shapes)."""
    # Imported here, not at the top: cuda-python's bindings take ~0.3 s to load (autotune runs on a GPU only).
    from flowgen.runtime.cuda_driver import CudaContext

    ctx = CudaContext.get()
    arch = ctx.arch
    cache = _load(arch)
    choices, changed = {}, False
    for node in _conv_nodes(graph):
        key = conv_key(node)
        if key in choices:
            continue
        if key not in cache:
            candidates = conv_tile_candidates(node, CANDIDATES)
            if not candidates:
                continue   # depthwise convs have a single direct kernel
            dims, seconds = _time_candidates(node, candidates, ctx, arch, log)
            cache[key] = {"tile": list(dims), "seconds": seconds}
            changed = True
        choices[key] = tuple(cache[key]["tile"])
    if changed:
        atomic_write_bytes(_cache_path(arch), json.dumps(cache, indent=1, sort_keys=True).encode())
    return choices
