"""OneFlow's own nn.Graph tests, run against flowgen as a user would run them: import line changed.

    python benchmarks/oneflow_graph_tests.py ONEFLOW_CHECKOUT [--files PATTERN ...] [--timeout S]
                                             [--out FILE]

ONEFLOW_CHECKOUT is a clone of github.com/Oneflow-Inc/oneflow (this script downloads nothing). The
test files of python/oneflow/test/graph are copied into a temporary folder where `oneflow` and every
`oneflow.X` module import resolve to `flowgen` and `flowgen.X` (the same as editing the import
lines). Each file runs in its own pytest process on one node with one device, so the tests marked
`skip_unless_1n1d` are the ones that run; multi-device tests are skipped. Without a GPU, tests on
'cuda' run their CUDA programs on the CPU emulator (FLOWGEN_EMULATE_CUDA=1) unless --no-emulate-cuda.
Tests whose code uses OneFlow's implementation (its C++ bindings, framework modules such as
`oneflow.framework.graph_build_util`, protobuf job configs) are marked and counted apart from the API
tests, and so are files whose tests all need several devices (`file_groups` in the JSON, with the
reason) and tests whose code needs what flowgen leaves out of scope (OneFlow's OFRecord data readers,
its job protobuf, the flowvision package; each test outcome carries its `group` and `reason`). The
internals are decided per test, like the scope: a file importing OneFlow's internal modules gets
stand-ins for them (any use raises, naming the module), so its tests that never touch them run as
API tests; a file that cannot be collected at all counts as internal as a whole. Failures
that come from a documented semantic choice of flowgen (PyTorch's formula where OneFlow's differs)
stay counted as failures, with the difference spelled out (`known_differences`).

Prints one row per file (passed / failed / skipped) and the single-device pass rate, and writes the
per-test outcomes with the first line of each failure as JSON (default
benchmarks/results/oneflow_graph_tests.json).
"""
from __future__ import annotations

import argparse
import ast
import collections
import datetime
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TEST_DIR = os.path.join("python", "oneflow", "test", "graph")

# OneFlow's test-suite helpers (oneflow.test_utils.test_util): argument grids, not library API.
_TEST_UTIL = '''
import itertools
from collections import OrderedDict


def GenCartesianProduct(sets):
    return itertools.product(*[s if isinstance(s, (list, tuple)) else [s] for s in sets])


def GenArgList(arg_dict):
    return [list(args) for args in GenCartesianProduct(arg_dict.values())]


def GenArgDict(arg_dict):
    return [OrderedDict(zip(arg_dict.keys(), args)) for args in GenCartesianProduct(arg_dict.values())]
'''

# Files that test OneFlow's implementation rather than its API: they import its C++ bindings, its
# framework internals, protobuf job configs or the automated PyTorch-comparison harness.
INTERNAL = re.compile(r"^\s*(import|from)\s+(oneflow\._oneflow_internal|oneflow\.framework|oneflow\._C"
                      r"|google\.protobuf|oneflow\.test_utils\.automated_test_util|oneflow\.core)", re.M)

# Tests that need what flowgen leaves out of scope: counted apart from the API tests, like the
# internals above. A test is out of scope when the code it runs (its method and the file's functions,
# classes and imports it reaches by name) matches a pattern; the first pattern found gives its reason.
OUT_OF_SCOPE = (
    (re.compile(r"OFRecord"),
     "reads OneFlow's OFRecord dataset files (nn.OFRecordReader and its raw/image decoders): OneFlow's "
     "own data-loading format and readers, not part of flowgen"),
    (re.compile(r"^\s*import flowvision", re.M),
     "imports flowvision, OneFlow's separate vision package (datasets, transforms, model zoo): not a "
     "dependency of flowgen"),
    (re.compile(r"\._graph_proto\b|\.config\.proto\b|_generate_config_proto"),
     "reads the OneFlow job protobuf a graph compiles to (graph._graph_proto, graph.config.proto): "
     "OneFlow's internal representation; flowgen's is its IR (graph.compiled)"),
)
MULTI_DEVICE = ("every test in the file needs several devices (skip_unless_1n2d and up), so none runs on one "
                "device; what the file imports at collection ({imports}) serves those tests only")

# Tests that fail because flowgen follows PyTorch's formula where OneFlow's differs (flowgen/optim
# documents each choice; tests/test_optim.py checks flowgen against PyTorch). Still counted failed.
KNOWN_DIFFERENCES = {
    "test_graph_optim_sgd.py::TestGraphSGD::test_sgd":
        "SGD follows PyTorch: the momentum buffer starts as the first gradient (OneFlow: (1 - dampening) * g "
        "from a zero buffer), maximize negates the gradient before weight decay (OneFlow negates the whole "
        "step, weight decay included), Nesterov with dampening is refused (OneFlow allows it)",
    "test_graph_optim_sgd.py::TestGraphSGD::test_sgd_with_clip_grad":
        "SGD follows PyTorch: Nesterov with nonzero dampening raises ValueError (OneFlow allows it); the "
        "dampening and maximize differences of test_sgd",
    "test_graph_optim_rmsprop.py::TestRMSprop::test_rmsprop":
        "RMSprop follows PyTorch: w -= lr * g / (sqrt(v) + eps); OneFlow's test expects lr * g / sqrt(v + eps)",
    "test_graph_optim_rmsprop.py::TestRMSprop::test_rmsprop_clip_grad":
        "RMSprop follows PyTorch: w -= lr * g / (sqrt(v) + eps); OneFlow's test expects lr * g / sqrt(v + eps)",
    "test_graph_lr_scale.py::LRScaleTest::test_lr_scale":
        "the graph cases pass; the eager cases expect OneFlow's eager optimizer to ignore a group's "
        "lr_scale, which flowgen applies in eager mode too (an option is never silently ignored)",
}


def _marked_multi_device(node) -> bool:
    """Whether a test class or function carries a skip_unless_XnYd marker other than 1n1d."""
    for decorator in node.decorator_list:
        call = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "")
        match = re.fullmatch(r"skip_unless_(\d+)n(\d+)d", name)
        if match and match.groups() != ("1", "1"):
            return True
    return False


def multi_device_only(source: str) -> bool:
    """Whether every test class and test function of a file is marked for several devices."""
    tests = [node for node in ast.parse(source).body
             if isinstance(node, ast.ClassDef) and any("TestCase" in ast.unparse(b) for b in node.bases)
             or isinstance(node, ast.FunctionDef) and node.name.startswith("test")]
    return bool(tests) and all(_marked_multi_device(node) for node in tests)


INTERNAL_REASON = ("uses OneFlow's C++ bindings, framework modules, protobuf or its PyTorch-comparison "
                   "harness")


def categorise_file(source: str) -> tuple:
    """(group, reason) for a whole file: 'multi_device', else ('api', '') and its tests are
    categorised one by one (`test_scopes`: internals, out of scope, API)."""
    if multi_device_only(source):
        imports = sorted(set(re.findall(r"^\s*(?:from|import)\s+(oneflow\.[\w.]+)", source, re.M)))
        return "multi_device", MULTI_DEVICE.format(imports=", ".join(imports) or "nothing")
    return "api", ""


def out_of_scope_reason(code: str) -> str:
    """The reason `code` needs what flowgen leaves out of scope, or ''."""
    return next((reason for pattern, reason in OUT_OF_SCOPE if pattern.search(code)), "")


def _reachable_code(source: str, tree, start) -> str:
    """The source of `start` and of every module-level definition and import it reaches by name."""
    named = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            named[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                named[(alias.asname or alias.name).split(".")[0]] = node
    seen, stack, parts = {id(start)}, [start], []
    while stack:
        node = stack.pop()
        parts.append(ast.get_source_segment(source, node) or "")
        for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
            target = named.get(name)
            if target is not None and id(target) not in seen:
                seen.add(id(target))
                stack.append(target)
    return "\n".join(parts)


def code_group(code: str) -> tuple:
    """(group, reason) of the code a test runs: 'internal' when it uses OneFlow's internals, else
    'out_of_scope' with the reason, else ('api', '')."""
    if INTERNAL.search(code):
        return "internal", INTERNAL_REASON
    reason = out_of_scope_reason(code)
    return ("out_of_scope", reason) if reason else ("api", "")


def test_scopes(source: str) -> dict:
    """Test id as the junit report names it ('Class::method', 'module::function') -> (group, reason)
    of the code it runs: its method and the file's definitions and imports it reaches."""
    tree = ast.parse(source)
    scopes = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            scopes[node.name] = code_group(_reachable_code(source, tree, node))
        elif isinstance(node, ast.ClassDef):
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name.startswith("test"):
                    code = _reachable_code(source, tree, method)
                    scopes[f"{node.name}::{method.name}"] = code_group(code)
    return scopes


def test_group(row: dict, scopes: dict, source: str) -> tuple:
    """(group, reason) of one test outcome of a file; a collection failure (no test of the file ran)
    takes the group of the whole file's code."""
    test = row["test"]
    group = scopes.get(test, scopes.get(test.rsplit("::", 1)[-1]))
    return group if group is not None else code_group(source)


# Installed as conftest.py beside the copied tests: `import oneflow.nn.graph` loads flowgen.nn.graph.
_ALIAS = '''
import importlib, importlib.abc, importlib.util, sys, types
sys.path.insert(0, {root!r})

_COMPAT = {{"oneflow.test_utils": {init!r}, "oneflow.test_utils.test_util": {util!r}}}
_INTERNAL = ("oneflow.framework", "oneflow._oneflow_internal", "oneflow.core")


class _InternalStandIn(types.ModuleType):
    """One of OneFlow's internal modules, which flowgen does not have: importing it works (so the
    file's other tests run), any use raises naming it."""

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"{{self.__name__}}.{{attr}}: OneFlow's internal module {{self.__name__}} is not part of "
                             f"flowgen")


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _InternalStandIn(spec.name)

    def exec_module(self, module):
        pass


def _exists(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:   # its parent package is missing
        return False


class _OneflowAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in ("oneflow.test_utils", "oneflow.test_utils.test_util"):
            return importlib.util.spec_from_file_location(name, _COMPAT[name], submodule_search_locations=[])
        if name == "oneflow" or name.startswith("oneflow."):
            real = "flowgen" + name[len("oneflow"):]
            if not _exists(real):
                if any(name == p or name.startswith(p + ".") for p in _INTERNAL):
                    return importlib.util.spec_from_loader(name, _StandInLoader(), is_package=True)
                return None
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return importlib.import_module("flowgen" + spec.name[len("oneflow"):])

    def exec_module(self, module):
        pass

sys.meta_path.insert(0, _OneflowAlias())
'''


def _outcomes(xml_path: str) -> list:
    """(test id, outcome, message) for each test case in a junit XML report."""
    rows = []
    for case in ElementTree.parse(xml_path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or "").strip()
                errors = [line[1:].strip() for line in (node.text or "").splitlines() if line.startswith("E ")]
                if errors and (not message or message == "collection failure"):
                    message = errors[-1]
                message = message.splitlines()[0][:300] if message else ""
                break
        rows.append({"test": test_id, "outcome": outcome, "message": message})
    return rows


def run_file(work: str, name: str, timeout: float, emulate_cuda: bool) -> list:
    """Run one copied test file in its own pytest process; its per-test outcomes."""
    report = os.path.join(work, name + ".xml")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rN",
               f"--junitxml={report}", name]
    env = dict(os.environ, ONEFLOW_TEST_NODE_NUM="1", ONEFLOW_TEST_DEVICE_NUM="1", PYTHONHASHSEED="0")
    if emulate_cuda:
        env["FLOWGEN_EMULATE_CUDA"] = "1"
    try:
        proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"test": f"{name}::*", "outcome": "failed", "message": f"timed out after {timeout:.0f} s"}]
    if proc.returncode == 5:   # pytest collected no tests: a helper module named test_*.py
        return []
    if not os.path.exists(report):
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no report"]
        return [{"test": f"{name}::*", "outcome": "failed", "message": tail[0][:300]}]
    rows = _outcomes(report)
    if not rows:  # collection error: pytest writes an empty suite with the error
        tail = (proc.stdout + proc.stderr).strip().splitlines()
        message = next((line for line in tail if "Error" in line), tail[-1] if tail else "")
        return [{"test": f"{name}::*", "outcome": "failed", "message": message[:300]}]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("oneflow", help="path to a clone of Oneflow-Inc/oneflow")
    parser.add_argument("--files", nargs="*", default=["test_*.py"], help="file name patterns to run")
    parser.add_argument("--no-emulate-cuda", dest="emulate_cuda", action="store_false",
                        help="without a GPU, fail 'cuda' tests instead of running their CUDA programs on "
                             "the emulator (FLOWGEN_EMULATE_CUDA=1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per file")
    parser.add_argument("--oneflow-commit", default=None,
                        help="the OneFlow commit the tests were exported from, when ONEFLOW_CHECKOUT is not a git clone")
    parser.add_argument("--note", default="", help="a line stored with the results (machine, how the tests were obtained)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "oneflow_graph_tests.json"))
    args = parser.parse_args()

    source = os.path.join(args.oneflow, TEST_DIR)
    if not os.path.isdir(source):
        raise SystemExit(f"{source} does not exist: pass the root of a oneflow clone")
    work = tempfile.mkdtemp(prefix="flowgen-oneflow-tests-")
    for entry in os.listdir(source):
        if entry.endswith(".py"):
            shutil.copy(os.path.join(source, entry), work)
    compat = os.path.join(work, "_oneflow_test_utils")
    os.makedirs(compat)
    open(os.path.join(compat, "__init__.py"), "w").close()
    with open(os.path.join(compat, "test_util.py"), "w") as f:
        f.write(_TEST_UTIL)
    with open(os.path.join(work, "conftest.py"), "w") as f:
        f.write(_ALIAS.format(root=ROOT, init=os.path.join(compat, "__init__.py"),
                              util=os.path.join(compat, "test_util.py")))

    names = sorted(n for n in os.listdir(work)
                   if n.startswith("test_") and n.endswith(".py")
                   and any(fnmatch.fnmatch(n, pattern) for pattern in args.files))
    groups = ("api", "internal", "out_of_scope", "multi_device")
    marks = {"internal": "OneFlow internals", "out_of_scope": "out of scope", "multi_device": "multi-device only"}
    results, file_groups = {}, {}
    kinds = ("passed", "failed", "skipped")
    totals = {group: dict.fromkeys(kinds, 0) for group in groups}
    print(f"{'file':48} {'passed':>6} {'failed':>6} {'skipped':>7}")
    for name in names:
        with open(os.path.join(work, name)) as f:
            source = f.read()
        file_group, file_reason = categorise_file(source)
        if file_group != "api":
            file_groups[name] = {"group": file_group, "reason": file_reason}
        scopes = test_scopes(source) if file_group == "api" else {}
        rows = run_file(work, name, args.timeout, args.emulate_cuda)
        for row in rows:
            group, reason = (file_group, "") if file_group != "api" else test_group(row, scopes, source)
            row["group"] = group
            if reason:
                row["reason"] = reason
            difference = KNOWN_DIFFERENCES.get(f"{name}::{row['test']}")
            if difference and row["outcome"] == "failed":
                row["known_difference"] = difference
            totals[group][row["outcome"]] += 1
        results[name] = rows
        row_groups = {(r["group"], r.get("reason", "")) for r in rows}
        if name not in file_groups and len(row_groups) == 1 and next(iter(row_groups))[0] != "api":
            group, reason = next(iter(row_groups))   # the whole file (a collection failure, or every test)
            file_groups[name] = {"group": group, "reason": reason}
        counts = {k: sum(r["outcome"] == k for r in rows) for k in kinds}
        apart = collections.Counter(r["group"] for r in rows if r["group"] != "api")
        labels = [marks[g] if n == len(rows) else f"{n} {marks[g]}" for g, n in apart.items()]
        mark = f"  ({', '.join(labels)})" if labels else ""
        print(f"{name:48} {counts['passed']:6} {counts['failed']:6} {counts['skipped']:7}{mark}", flush=True)
    rates = {}
    for label, included in (("API tests", ["api"]), ("all tests", list(groups))):
        passed = sum(totals[g]["passed"] for g in included)
        ran = passed + sum(totals[g]["failed"] for g in included)
        rates[label] = passed / ran if ran else 0.0
        print(f"single-device pass rate, {label}: {passed}/{ran} = {rates[label]:.1%}")
    for group in groups[1:]:
        rows = [(n, r) for n, file_rows in results.items() for r in file_rows if r["group"] == group]
        print(f"{marks[group]}: {len({n for n, _ in rows})} files, {totals[group]['failed']} failed tests")
        reasons = {}
        for name, row in rows:
            reason = row.get("reason") or file_groups[name]["reason"]
            test = row["test"].lstrip(":")   # a collection failure is '::<file stem>'
            label = name if file_groups.get(name, {}).get("group") == group else f"{name}::{test}"
            reasons.setdefault(reason, {}).setdefault(label, None)
        for reason, labels in sorted(reasons.items()):
            print(f"  {', '.join(labels)}: {reason}")
    failed_differences = [(n, r) for n, rows in results.items() for r in rows if "known_difference" in r]
    if failed_differences:
        print(f"{len(failed_differences)} API failures are flowgen's documented semantic choices (known_differences):")
        for name, row in failed_differences:
            print(f"  {name}::{row['test']}: {row['known_difference']}")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    oneflow_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.oneflow,
                                    capture_output=True, text=True).stdout.strip()
    payload = {"date": datetime.date.today().isoformat(), "flowgen_commit": commit,
               "oneflow_commit": oneflow_commit or args.oneflow_commit, "totals": totals, "pass_rates": rates,
               "emulate_cuda": args.emulate_cuda, "file_groups": file_groups,
               "known_differences": KNOWN_DIFFERENCES, "note": args.note, "files": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
    os.replace(tmp, args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
