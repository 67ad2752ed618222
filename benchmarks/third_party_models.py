"""Third-party model files run with only their import line changed, against PyTorch.

    python benchmarks/third_party_models.py --torchvision-wheel WHEEL --examples EXAMPLES
                                            [--flowvision-sdist SDIST] [--graph] [--steps N]
                                            [--models NAME ...]

WHEEL is a torchvision wheel (`pip download torchvision --no-deps`); EXAMPLES is a checkout (or bare
clone) of github.com/pytorch/examples; SDIST is flowvision's source archive (flowvision-0.2.2.tar.gz
from PyPI; it has no wheel), for OneFlow's own ViT (model `vit`). Nothing is downloaded. Into a temporary folder go two copies
of torchvision's models/resnet.py, models/mobilenetv2.py and ops/misc.py and of pytorch/examples'
mnist/main.py and word_language_model/model.py: one as published, one with its `torch` import
lines changed to `flowgen`. torchvision's weight registry, logging hook and presets (models/_api,
_meta, _utils, transforms/_presets, utils._log_api_usage_once) and mnist/main.py's `torchvision`
import are replaced by small local stand-ins, the same for both copies.

flowvision's vision_transformer.py and the layers it imports (weight_init, PatchEmbed, Mlp, DropPath)
are copied twice the same way: `oneflow` imports changed to `flowgen`, and to `torch` for the
oracle copy, whose only other edit is `x.is_global` -> `False` (a OneFlow attribute torch lacks);
its registry, download helper and `flowvision.layers` package are replaced by small stand-ins.

Both copies get the same weights (torch's state_dict); dropout is set to 0 so numbers compare.
Prints per model: eval forward max|diff|, the loss of each SGD-momentum training step, and the
largest parameter/buffer difference after the steps; with --graph flowgen runs as an nn.Graph.
Writes the same as JSON (--out; default results/third_party_models_<eager|graph>.json).
MobileNetV2's ReLU6 masks flip on float32 rounding, so its training numbers drift as much as torch
float32 drifts from torch float64 (both ~0.5 after 3 steps at 4x3x64x64).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

import numpy as np

SHIMS = {
    "utils.py": "import collections\nfrom itertools import repeat\n\n\ndef _log_api_usage_once(obj):\n    pass\n\n\n"
                "def _make_ntuple(x, n):\n    return tuple(x) if isinstance(x, collections.abc.Iterable) "
                "else tuple(repeat(x, n))\n",
    "models/_api.py": "from dataclasses import dataclass\nfrom enum import Enum\n\n\n@dataclass\nclass Weights:\n"
                      "    url: str\n    transforms: object\n    meta: dict\n\n\nclass WeightsEnum(Enum):\n"
                      "    @classmethod\n    def verify(cls, obj):\n        return obj\n\n\ndef register_model(name=None):\n    return lambda fn: fn\n",
    "models/_meta.py": "_IMAGENET_CATEGORIES = []\n",
    "models/_utils.py": "def _make_divisible(v, divisor, min_value=None):\n    min_value = min_value or divisor\n"
                        "    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)\n"
                        "    return new_v + divisor if new_v < 0.9 * v else new_v\n\n\n"
                        "def _ovewrite_named_param(kwargs, param, new_value):\n    kwargs.setdefault(param, new_value)\n\n\n"
                        "def handle_legacy_interface(**weights):\n    return lambda fn: fn\n",
    "transforms/_presets.py": "class ImageClassification:\n    pass\n",
}
TORCHVISION_FILES = ("models/resnet.py", "models/mobilenetv2.py", "ops/misc.py")
EXAMPLES_FILES = {"mnist_main.py": "mnist/main.py", "wlm_model.py": "word_language_model/model.py"}


FLOWVISION_FILES = ("models/vision_transformer.py", "models/helpers.py", "layers/weight_init.py",
                    "layers/blocks/patch_embed.py", "layers/blocks/mlp.py", "layers/regularization/droppath.py")
FLOWVISION_SHIMS = {
    "layers/__init__.py": "from .weight_init import trunc_normal_, lecun_normal_\nfrom .blocks.patch_embed import "
                          "PatchEmbed\nfrom .blocks.mlp import Mlp\nfrom .regularization.droppath import DropPath\n",
    "models/utils.py": "def load_state_dict_from_url(*args, **kwargs):\n    raise RuntimeError('no downloads')\n",
    "models/registry.py": "class ModelCreator:\n    @staticmethod\n    def register_model(fn):\n        return fn\n",
}


def oneflow_to(lib, package, text):
    """A flowvision file with its `oneflow` imports read from `lib` and `flowvision.` from `package`."""
    text = re.sub(r"^import oneflow as flow$", f"import {lib} as flow", text, flags=re.M)
    text = re.sub(r"^import oneflow\.([\w.]+) as (\w+)$", rf"import {lib}.\1 as \2", text, flags=re.M)
    text = re.sub(r"^from oneflow(\.[\w.]+)? import ", rf"from {lib}\1 import ", text, flags=re.M)
    text = text.replace("from flowvision.", f"from {package}.")
    return text.replace("x.is_global", "False") if lib == "torch" else text


def prepare_flowvision(folder, sdist):
    with tarfile.open(sdist) as tar:
        sources = {}
        for member in tar.getmembers():
            rel = member.name.partition("/flowvision/")[2]
            if rel in FLOWVISION_FILES:
                sources[rel] = tar.extractfile(member).read().decode()
    missing = set(FLOWVISION_FILES) - set(sources)
    if missing:
        raise SystemExit(f"{sdist}: not a flowvision source archive (missing {sorted(missing)})")
    for flavour, lib in (("pt", "torch"), ("fg", "flowgen")):
        package = f"fvlite_{flavour}"
        for rel, text in list(sources.items()) + list(FLOWVISION_SHIMS.items()):
            path = os.path.join(folder, package, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "w").write(oneflow_to(lib, package, text) if rel in sources else text)
        for sub in ("", "models", "layers/blocks", "layers/regularization"):
            open(os.path.join(folder, package, sub, "__init__.py"), "a").close()


def to_flowgen(text):
    text = re.sub(r"^import torch$", "import flowgen as torch", text, flags=re.M)
    text = re.sub(r"^import torch\.(\w+(?:\.\w+)?) as (\w+)$", r"import flowgen.\1 as \2", text, flags=re.M)
    text = re.sub(r"^from torch(\.[\w.]+)? import ", r"from flowgen\1 import ", text, flags=re.M)
    return text


def read_examples(root, rel):
    if os.path.isfile(os.path.join(root, rel)):
        return open(os.path.join(root, rel)).read()
    return subprocess.run(["git", "--git-dir", root, "show", f"HEAD:{rel}"], check=True, capture_output=True,
                          text=True).stdout


def prepare(folder, wheel, examples):
    with zipfile.ZipFile(wheel) as whl:
        sources = {rel: whl.read(f"torchvision/{rel}").decode() for rel in TORCHVISION_FILES}
    for flavour, edit in (("pt", lambda t: t), ("fg", to_flowgen)):
        pkg = os.path.join(folder, f"tvlite_{flavour}")
        for sub in ("", "models", "ops", "transforms"):
            os.makedirs(os.path.join(pkg, sub), exist_ok=True)
            open(os.path.join(pkg, sub, "__init__.py"), "w").close()
        for rel, text in sources.items():
            open(os.path.join(pkg, rel), "w").write(edit(text))
        for rel, text in SHIMS.items():
            open(os.path.join(pkg, rel), "w").write(text)
        for name, rel in EXAMPLES_FILES.items():
            open(os.path.join(folder, f"{flavour}_{name}"), "w").write(edit(read_examples(examples, rel)))
    os.makedirs(os.path.join(folder, "torchvision"), exist_ok=True)
    open(os.path.join(folder, "torchvision", "__init__.py"), "w").write("datasets = transforms = None\n")
    sys.path.insert(0, folder)


def build(name, torch, flow, pt, fg):
    """(torch model, flowgen model, input batch, targets, forward(lib, model, x) -> log-probabilities or logits)."""
    rng = np.random.default_rng(0)
    if name in ("resnet18", "mobilenet_v2"):
        mod = "resnet" if name == "resnet18" else "mobilenetv2"
        kwargs = {"num_classes": 10} if name == "resnet18" else {"num_classes": 10, "dropout": 0.0}
        pm = getattr(importlib.import_module(f"tvlite_pt.models.{mod}"), name)(**kwargs)
        fm = getattr(importlib.import_module(f"tvlite_fg.models.{mod}"), name)(**kwargs)
        x, y = rng.standard_normal((4, 3, 64, 64)).astype(np.float32), rng.integers(0, 10, (4,))
        return pm, fm, x, y, lambda lib, m, x: lib.nn.functional.log_softmax(m(x), dim=1)
    if name == "vit":
        config = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)
        pm, fm = (importlib.import_module(f"fvlite_{flavour}.models.vision_transformer").VisionTransformer(**config)
                  for flavour in ("pt", "fg"))
        x, y = rng.standard_normal((4, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, (4,))
        return pm, fm, x, y, lambda lib, m, x: lib.nn.functional.log_softmax(m(x), dim=1)
    if name == "mnist":
        pm, fm = pt["mnist_main"].Net(), fg["mnist_main"].Net()
        x, y = rng.standard_normal((8, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, (8,))
        return pm, fm, x, y, lambda lib, m, x: m(x)
    kind = name.split(":")[1]
    if kind == "Transformer":
        pm, fm = (lib["wlm_model"].TransformerModel(50, 16, 2, 16, 2, dropout=0.0) for lib in (pt, fg))
        forward = lambda lib, m, x: m(x).view(-1, 50)
    else:
        pm, fm = (lib["wlm_model"].RNNModel(kind, 50, 16, 16, 2, dropout=0.0) for lib in (pt, fg))
        forward = lambda lib, m, x: m(x, m.init_hidden(3))[0]
    return pm, fm, rng.integers(0, 50, (6, 3)), rng.integers(0, 50, (18,)), forward


def run(name, graph, steps, torch, flow, pt, fg):
    torch.manual_seed(0)
    pm, fm, x, y, forward = build(name, torch, flow, pt, fg)
    for lib, model in ((torch, pm), (flow, fm)):
        for m in model.modules():
            if isinstance(m, lib.nn.Dropout):
                m.p = 0.0
            if isinstance(m, lib.nn.MultiheadAttention):  # nn.Transformer's own dropout
                m.dropout = 0.0
    fm.load_state_dict({k: flow.tensor(v.detach().numpy().copy()) for k, v in pm.state_dict().items()})
    pm.eval(), fm.eval()
    with torch.no_grad():
        expected = forward(torch, pm, torch.tensor(x)).numpy()
    if graph:
        class Infer(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = fm

            def build(self, x):
                return forward(flow, self.model, x)
        got = Infer()(flow.tensor(x)).numpy()
    else:
        got = forward(flow, fm, flow.tensor(x)).numpy()
    row = {"model": name, "mode": "graph" if graph else "eager", "forward_max_abs_diff": float(np.abs(expected - got).max()),
           "forward_max_abs": float(np.abs(expected).max()), "losses_torch": [], "losses_flowgen": []}
    print(f"{name:16s} {row['mode']}  eval forward max|diff| {row['forward_max_abs_diff']:.3g}")
    pm.train(), fm.train()
    popt = torch.optim.SGD(pm.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    fopt = flow.optim.SGD(fm.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    def flow_step(x, y):
        loss = flow.nn.functional.nll_loss(forward(flow, fm, x), y)
        loss.backward()
        return loss

    if graph:
        class Train(flow.nn.Graph):
            def __init__(self):
                super().__init__()
                self.model = fm
                self.add_optimizer(fopt)

            def build(self, x, y):
                return flow_step(x, y)
        train = Train()
    for step in range(steps):
        popt.zero_grad()
        ploss = torch.nn.functional.nll_loss(forward(torch, pm, torch.tensor(x)), torch.tensor(y))
        ploss.backward()
        popt.step()
        if graph:
            floss = train(flow.tensor(x), flow.tensor(y))
        else:
            fopt.zero_grad()
            floss = flow_step(flow.tensor(x), flow.tensor(y))
            fopt.step()
        row["losses_torch"].append(ploss.item())
        row["losses_flowgen"].append(float(floss.numpy()))
        print(f"    step {step}: loss torch {ploss.item():.6f} flowgen {float(floss.numpy()):.6f}")
    psd, fsd = pm.state_dict(), fm.state_dict()
    worst = max(psd, key=lambda k: np.abs(psd[k].numpy() - fsd[k].numpy()).max())
    row["after_steps_max_abs_diff"] = float(np.abs(psd[worst].numpy() - fsd[worst].numpy()).max())
    row["after_steps_worst"] = worst
    print(f"    after {steps} steps max|param/buffer diff| {row['after_steps_max_abs_diff']:.3g} ({worst})")
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchvision-wheel", required=True)
    parser.add_argument("--examples", required=True, help="pytorch/examples checkout or bare clone")
    parser.add_argument("--flowvision-sdist", help="flowvision-0.2.2.tar.gz (for the model `vit`)")
    parser.add_argument("--graph", action="store_true", help="run flowgen as an nn.Graph")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", nargs="*", help="default: all (`vit` when --flowvision-sdist is given)")
    parser.add_argument("--out", help="JSON file (default benchmarks/results/third_party_models_<eager|graph>.json)")
    args = parser.parse_args()
    models = args.models or ["resnet18", "mobilenet_v2", "mnist", "wlm:LSTM", "wlm:GRU", "wlm:RNN_TANH",
                             "wlm:Transformer"] + (["vit"] if args.flowvision_sdist else [])
    import torch
    import flowgen as flow
    with tempfile.TemporaryDirectory(prefix="flowgen_third_party_") as folder:
        prepare(folder, args.torchvision_wheel, args.examples)
        if args.flowvision_sdist:
            prepare_flowvision(folder, args.flowvision_sdist)
        elif "vit" in models:
            parser.error("the model `vit` needs --flowvision-sdist")
        pt, fg = ({name[:-3]: importlib.import_module(f"{flavour}_{name[:-3]}") for name in EXAMPLES_FILES}
                  for flavour in ("pt", "fg"))
        rows = [run(name, args.graph, args.steps, torch, flow, pt, fg) for name in models]
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"third_party_models_{'graph' if args.graph else 'eager'}.json")
    payload = {"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "torch": torch.__version__,
               "torchvision_wheel": os.path.basename(args.torchvision_wheel), "steps": args.steps, "rows": rows}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(out + ".tmp", out)
    print(f"wrote {out}")


def _commit() -> str:
    """The flowgen checkout's commit, or "unknown" outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
