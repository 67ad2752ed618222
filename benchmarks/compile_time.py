"""Compile time of the MobileNetV2 (CIFAR shapes) training graph, cold and warm cache.

    python benchmarks/compile_time.py [--batch 8] [--width 1.0] [--arch sm_90] [--skip-cpu-build]
                                      [--skip-cuda-call] [--cpu-only] [--note TEXT] [--out FILE]

Every stage runs in a fresh Python process. "cold" uses an empty build cache ($FLOWGEN_CACHE in
a temporary directory), "warm" runs the same stage again on that cache (a new process, the same
graph: compiled kernels, the program cache's passes + codegen and compiled templates are found
there; the emulator row's stages_s then shows "program cache" instead of "passes" and "codegen").
Stages:

  native first call     graph(x, y) on the CPU with the cpu target's native kernels (the default,
                        FLOWGEN_CPU_KERNELS=native): trace, passes, codegen, g++ build, one step
  emulator first call   the same with every kernel the CUDA source on the emulator
                        (FLOWGEN_CPU_KERNELS=emulator)
  nvrtc (cuda target)   the cuda program's kernels.cu through NVRTC (no GPU needed)
  flowgen build cuda    `flowgen build --target cuda` of the saved graph (NVRTC + host g++)
  cuda first call       graph(x, y) on 'cuda': the same for the cuda target (without a GPU,
                        FLOWGEN_EMULATE_CUDA=1: its CUDA program built by g++ and run on the
                        emulator, whose step is slow; "nvrtc_s" is then its kernels.cu through
                        NVRTC and the kernel cache, which the GPU backend runs instead of g++)
  flowgen build cpu     `flowgen build --target cpu` (native kernels)

`--cpu-only` runs the first two and the last (the cuda stages take most of the time).

Each row reports wall seconds and CPU seconds (user + sys of the process and the compilers it
ran); the first-call rows also "import_s" (`import flowgen`) and "inner_s", the graph call alone,
split into "stages_s" (its compile pipeline) and "step_s" (the step it then runs). The stages
share one build cache (but the emulator first call, which has its own) and run in the order
above: the cuda call's NVRTC kernels are those the nvrtc row compiled. The machines these run on are shared, so read CPU time next to wall time.
Writes JSON (default benchmarks/results/compile_time.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Each child prints one JSON line: the seconds it measured itself ("inner").
_SETUP = f"""
import json, sys, time
sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
"""

_FIRST_CALL = _SETUP + """
start = time.perf_counter()
import flowgen as flow
import_s = time.perf_counter() - start
from flowgen.models import mobilenet_v2
from flowgen.runtime import cuda_driver, nvrtc
from graphs import TrainGraph
batch, width, device, saved, arch = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
flow.manual_seed(0)
model = mobilenet_v2(num_classes=10, width_mult=width).to(device)
graph = TrainGraph(model, flow.nn.CrossEntropyLoss(), flow.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
x, y = flow.randn(batch, 3, 32, 32, device=device), flow.randint(0, 10, (batch,), device=device)
start = time.perf_counter()
graph(x, y)
inner = time.perf_counter() - start
stages = graph.compiled.timings
result = {"import_s": import_s, "inner_s": inner, "kernels": len(graph.compiled.program.kernels), "stages_s": stages,
          "step_s": inner - sum(stages.values()), "program_cache": graph.compiled.program_cache}
if device == "cpu":
    flow.save(graph, saved)
elif not cuda_driver.available():
    result["emulated"] = True
    start = time.perf_counter()
    nvrtc.compile_kernels(graph.compiled.program.source, arch)
    result["nvrtc_s"] = time.perf_counter() - start
print(json.dumps(result))
"""

_NVRTC = _SETUP + """
import flowgen as flow
from flowgen.runtime import nvrtc
saved, arch = flow.load(sys.argv[1]), sys.argv[2]
program = saved.program("cuda")
start = time.perf_counter()
images = nvrtc.compile_kernels(program.source, arch)
inner = time.perf_counter() - start
print(json.dumps({"inner_s": inner, "kernels": len(program.kernels) + len(program.prepare),
                  "stats": images.stats.as_dict()}))
"""


def _run(command: list, env: dict) -> dict:
    """Run `command`; its wall time, CPU time (it and its children) and the JSON it printed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])}... failed:\n{proc.stdout}\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = {"wall_s": wall, "cpu_s": cpu}
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    if last and last[0].startswith("{"):
        result.update(json.loads(last[0]))
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--skip-cpu-build", action="store_true", help="skip `flowgen build --target cpu`")
    parser.add_argument("--skip-cuda-call", action="store_true", help="skip the graph call on 'cuda'")
    parser.add_argument("--cpu-only", action="store_true", help="only the cpu stages: native, emulator, build cpu")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile (kept in the JSON)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compile_time.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()

    work = tempfile.mkdtemp(prefix="flowgen-compile-time-")
    env = dict(os.environ, FLOWGEN_CACHE=os.path.join(work, "cache"), FLOWGEN_PROGRESS="0", FLOWGEN_EMULATE_CUDA="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    saved = os.path.join(work, "saved")
    flowgen_cli = [sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                   "from cli.main import main; main()"]
    first_call = [sys.executable, "-c", _FIRST_CALL, str(args.batch), str(args.width)]
    # The emulator stage has a build cache of its own: the native program's fallback kernels are
    # CUDA kernels the emulator program compiles too, which a shared cache would find warm.
    native = dict(env, FLOWGEN_CPU_KERNELS="native")
    emulator = dict(env, FLOWGEN_CPU_KERNELS="emulator", FLOWGEN_CACHE=os.path.join(work, "cache_emulator"))
    stages = [   # (name, command, environment)
        ("native first call", [*first_call, "cpu", saved, args.arch], native),
        ("emulator first call", [*first_call, "cpu", saved, args.arch], emulator),
    ]
    if not args.cpu_only:
        stages += [("nvrtc (cuda target)", [sys.executable, "-c", _NVRTC, saved, args.arch], env),
                   ("flowgen build cuda", [*flowgen_cli, "build", saved, "-o", os.path.join(work, "out_cuda"),
                                           "--target", "cuda", "--arch", args.arch], env)]
    if not (args.skip_cuda_call or args.cpu_only):
        stages.append(("cuda first call", [*first_call, "cuda", saved, args.arch], env))
    if not args.skip_cpu_build:
        stages.append(("flowgen build cpu", [*flowgen_cli, "build", saved, "-o", os.path.join(work, "out_cpu"),
                                             "--target", "cpu"], native))
    rows = []
    for name, command, stage_env in stages:
        for cache in ("cold", "warm"):
            result = _run(command, stage_env)
            rows.append({"stage": name, "cache": cache, **result})
            print(f"{name:<22} {cache:<5} wall {result['wall_s']:8.2f} s   cpu {result['cpu_s']:8.2f} s"
                  + (f"   (inner {result['inner_s']:.2f} s)" if "inner_s" in result else ""), flush=True)

    print(f"\nMobileNetV2 training graph, batch {args.batch}, width {args.width}, {os.cpu_count()} cores")
    print(f"{'stage':<22}{'cache':<7}{'wall s':>9}{'cpu s':>9}{'inner s':>9}{'step s':>9}")
    for r in rows:
        inner, step = (f"{r[k]:9.2f}" if k in r else f"{'-':>9}" for k in ("inner_s", "step_s"))
        print(f"{r['stage']:<22}{r['cache']:<7}{r['wall_s']:9.2f}{r['cpu_s']:9.2f}{inner}{step}")
    report = {"model": "mobilenet_v2", "batch": args.batch, "width": args.width, "arch": args.arch,
              "cores": os.cpu_count(), "machine": platform.machine(), "load_average_before": load_before,
              "load_average": os.getloadavg(), "note": args.note, "stages": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(args.out + ".tmp", args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
