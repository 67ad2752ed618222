"""runtime_cpp/flowgen_cpu_math.h: the float32 exp, erf, erfc and tanh of the cpu target's native loops,
against a float64 reference (libm's exp, erf, erfc, tanh of the float argument, rounded once) over
millions of floats spread over every binade: the ulp bounds the header states, exact special
values, the same bits at -O0 (scalar) and -O2 (vectorized); and through the public API, graphs
calling them (GELU forward and backward, erf, exp, tanh) with native kernels against eager, bit for bit
at every FLOWGEN_EMULATOR_OPT."""
import copy
import ctypes
import subprocess

import numpy as np
import pytest

import flowgen as flow
import flowgen.nn as nn
from flowgen.runtime import toolchain
from graphs import MeanSquareGraph

FUNCTIONS = ("expf", "erff", "erfcf", "tanhf")
# The bounds flowgen_cpu_math.h states, in units in the last place of the float result.
ULP_BOUNDS = {"expf": 1.0, "erff": 1.0, "erfcf": 3.0, "tanhf": 2.0}

# One loop per function over an array (as a native kernel's loop: vectorized at -O2), and the
# float64 reference of the same name.
PROBE = """
#include "flowgen_cpu_math.h"
#define PROBE(fn, ref) \\
  extern "C" void probe_##fn(const float* x, float* y, long long n) { \\
    _Pragma("omp simd") for (long long i = 0; i < n; ++i) y[i] = flowgen_cpu::fn(x[i]); \\
  } \\
  extern "C" void reference_##fn(const float* x, double* y, long long n) { \\
    for (long long i = 0; i < n; ++i) y[i] = ref((double)x[i]); \\
  }
PROBE(expf, std::exp)
PROBE(erff, std::erf)
PROBE(erfcf, std::erfc)
PROBE(tanhf, std::tanh)
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """{level: library} of the probe loops compiled at -O0 and -O2 with the kernels' flags."""
    folder = tmp_path_factory.mktemp("cpu_math")
    (folder / "probe.cpp").write_text(PROBE)
    libraries = {}
    for level in ("0", "2"):
        path = folder / f"probe_O{level}.so"
        subprocess.run([toolchain.CXX, *toolchain.kernel_flags([f"-O{level}"]), f"-I{toolchain.runtime_cpp_dir()}",
                        "-shared", "probe.cpp", "-o", path.name], cwd=folder, check=True)
        libraries[level] = ctypes.CDLL(str(path))
    return libraries


def call(library, name, x, out_dtype):
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty(x.shape, out_dtype)
    getattr(library, name)(x.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p),
                           ctypes.c_longlong(x.size))
    return y


def sweep() -> np.ndarray:
    """About 8 million floats: every 509th bit pattern of each sign (every binade, subnormals
    included, about 16000 values each), the neighbours of the points where the functions change
    regime, and the special values."""
    positive = np.arange(0, 0x7F800000, 509, dtype=np.uint32).view(np.float32)
    edges = np.array([0.47, 0.55, 1.0, 2.0, 10.1, 10.0546875, 88.72283, 89.0, -87.33655, -103.97208, -104.0,
                      0.5 * np.log(2)], np.float32)
    near = (edges.view(np.int32)[:, None] + np.arange(-300, 301, dtype=np.int32)).ravel().view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                        np.float32(2.0 ** -149)], np.float32)
    return np.concatenate([positive, -positive, near, -near, special])


def ulp_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the float ulp at want (subnormal spacing below the normal range)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(want), np.finfo(np.float32).tiny)))
    ulp = np.exp2(exponent - 23)
    return np.abs(got.astype(np.float64) - want) / ulp


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_max_ulp_error_over_every_binade(probes, fn):
    x = sweep()
    got = call(probes["2"], f"probe_{fn}", x, np.float32)
    want = call(probes["2"], f"reference_{fn}", x, np.float64)
    finite = np.isfinite(want) & (np.abs(want) <= np.finfo(np.float32).max)
    errors = ulp_errors(got[finite], want[finite])
    worst = int(np.argmax(errors))
    at, value, reference = x[finite][worst], got[finite][worst], want[finite][worst]
    assert errors[worst] <= ULP_BOUNDS[fn], f"{fn}({at!r}) = {value!r}, want {reference!r}"
    # where float64's result overflows float32, or is nan, so is ours
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got[~finite], want[~finite].astype(np.float32))


SPECIAL = {
    "expf": [(0.0, 1.0), (-0.0, 1.0), (np.inf, np.inf), (-np.inf, 0.0), (np.nan, np.nan), (88.8, np.inf),
             (-104.0, 0.0), (-200.0, 0.0), (np.float32(2.0 ** -30), 1.0), (np.float32(-(2.0 ** -30)), 1.0)],
    "erff": [(0.0, 0.0), (-0.0, -0.0), (np.inf, 1.0), (-np.inf, -1.0), (np.nan, np.nan), (4.0, 1.0), (-4.0, -1.0)],
    "erfcf": [(0.0, 1.0), (-0.0, 1.0), (np.inf, 0.0), (-np.inf, 2.0), (np.nan, np.nan), (11.0, 0.0), (-11.0, 2.0),
              (10.1, 0.0), (-5.0, 2.0)],
    "tanhf": [(0.0, 0.0), (-0.0, -0.0), (np.inf, 1.0), (-np.inf, -1.0), (np.nan, np.nan), (10.0, 1.0), (-10.0, -1.0),
              (np.float32(2.0 ** -140), np.float32(2.0 ** -140))],
}


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_special_values_are_exact(probes, fn):
    x, want = (np.array(column, np.float32) for column in zip(*SPECIAL[fn]))
    for level, library in probes.items():
        got = call(library, f"probe_{fn}", x, np.float32)
        np.testing.assert_array_equal(got, want, err_msg=f"-O{level}")
        number = ~np.isnan(want)
        np.testing.assert_array_equal(np.signbit(got[number]), np.signbit(want[number]), err_msg=f"-O{level}: signs")


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_scalar_and_vectorized_loops_give_the_same_bits(probes, fn):
    x = sweep()
    at_o0 = call(probes["0"], f"probe_{fn}", x, np.float32)
    at_o2 = call(probes["2"], f"probe_{fn}", x, np.float32)
    np.testing.assert_array_equal(at_o0.view(np.uint32), at_o2.view(np.uint32))


class Activations(nn.Module):
    """GELU (erfc in its forward, erfc and exp in its gradient) after a Linear, so one runs in a
    GEMM's epilogue and the others in elementwise loops: erf, exp, a sigmoid and tanh."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(24, 40)
        self.gelu = nn.GELU()

    def forward(self, x):
        h = self.gelu(self.linear(x))
        return (h * 0.5 + flow.erf(x * 2.0).sum(dim=1, keepdim=True) + flow.exp(-h).mean() + flow.sigmoid(h)
                + flow.tanh(h * 0.3))


def _train_step(monkeypatch, opt_level=None):
    """One SGD step of Activations as a graph with native kernels: (model, input, [output, the
    Linear's weight and bias after the step], native kernel names, kernels.cu)."""
    monkeypatch.setenv("FLOWGEN_CPU_KERNELS", "native")
    if opt_level is not None:
        monkeypatch.setenv("FLOWGEN_EMULATOR_OPT", opt_level)
    flow.manual_seed(3)
    model = Activations()
    x = flow.tensor((np.random.default_rng(4).standard_normal((33, 24)) * 3).astype(np.float32))
    before = copy.deepcopy(model)

    step = MeanSquareGraph(model, flow.optim.SGD(model.parameters(), lr=0.1))
    got = [step(x)[1].numpy(), model.linear.weight.numpy(), model.linear.bias.numpy()]
    names = [k.name for k in step.compiled.program.kernels if k.native]
    sources = next(iter(step._variants.values())).sources["kernels.cu"]
    return before, x, got, names, sources


def test_native_gelu_erf_exp_graph_matches_eager(monkeypatch):
    eager, x, got, names, sources = _train_step(monkeypatch)
    assert any("gelu" in n and "matmul" in n for n in names), names
    for fn in FUNCTIONS:
        assert f"flowgen_cpu::{fn}(" in sources, f"no native call of {fn}"
    opt = flow.optim.SGD(eager.parameters(), lr=0.1)
    out = eager(x)
    (out * out).mean().backward()
    opt.step()
    want = [out.numpy(), eager.linear.weight.numpy(), eager.linear.bias.numpy()]
    for g, w, what in zip(got, want, ("output", "weight", "bias")):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=what)


def test_native_math_is_bit_identical_at_every_emulator_opt_level(monkeypatch):
    """The same graph compiled at -O0, -O1 and -O2: the same bits (vectorized or not)."""
    results = {level: _train_step(monkeypatch, level)[2] for level in ("0", "1", "2")}
    for level in ("0", "1"):
        for got, want in zip(results[level], results["2"]):
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"-O{level} vs -O2")
