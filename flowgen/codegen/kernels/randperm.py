"""randperm: a Fisher-Yates shuffle on one thread (templates/randperm.cu.j2), reading the graph's
rng state (the seed and per-call offset, passes/random_streams.py) as an extra argument."""
from __future__ import annotations

from flowgen.codegen.kernel import BufferArg, Kernel, RenderContext
from flowgen.codegen.kernels.common import node_comment, render_template


def render(node, ctx: RenderContext) -> list:
    rng = ctx.rng_state(node)
    if rng is None:
        raise AssertionError(f"randperm ({node.scope or 'graph'}) reached codegen without its rng stream "
                             f"(passes/random_streams.py binds one)")
    kernel_name = ctx.kernel_name(node, [node.op])
    n = node.output.numel
    comment = node_comment(node, f"of {n}")
    source = render_template("randperm.cu.j2", name=kernel_name, comment=comment, n=n, offset=node.attrs["offset"])
    args = [BufferArg(node.output, "long long*"), BufferArg(rng, "const long long*")]
    return [Kernel(name=kernel_name, source=source, args=args, grid=(1, 1, 1), block=(1, 1, 1),
                   needs_fibers=False, comment=comment, ops=[node.op])]
