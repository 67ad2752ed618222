"""DataLoader, flow.save/flow.load (atomic, validated) and the eager poly-fit example."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import flowgen as flow
from flowgen import nn, optim, serialization
from flowgen.serialization import CheckpointError
from flowgen.utils.data import DataLoader, Dataset, TensorDataset, default_collate, random_split

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ data
class Squares(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": np.full(2, i, np.float64), "y": i * i, "w": 0.5 * i, "name": f"s{i}"}


def test_dataloader_batches_and_collates():
    loader = DataLoader(Squares(), batch_size=4)
    batches = list(loader)
    assert len(loader) == len(batches) == 3
    first = batches[0]
    assert first["x"].shape == (4, 2) and first["x"].dtype == flow.float32
    assert first["y"].dtype == flow.int64 and first["y"].tolist() == [0, 1, 4, 9]
    assert first["w"].dtype == flow.float32 and first["name"] == ["s0", "s1", "s2", "s3"]
    assert batches[-1]["y"].shape == (2,)
    dropped = DataLoader(Squares(), batch_size=4, drop_last=True)
    assert len(dropped) == 2 and [b["y"].shape[0] for b in dropped] == [4, 4]
    assert list(DataLoader(Squares(), batch_size=None))[3]["y"] == 9


def test_shuffle_is_seeded_and_covers_every_sample():
    data = TensorDataset(flow.arange(20), flow.arange(20) * 2)

    def epoch_order(loader):
        return [int(v) for x, _ in loader for v in x.tolist()]

    flow.manual_seed(5)
    loader = DataLoader(data, batch_size=6, shuffle=True)
    e1, e2 = epoch_order(loader), epoch_order(loader)
    assert sorted(e1) == list(range(20)) and e1 != list(range(20)) and e1 != e2  # new order each epoch
    flow.manual_seed(5)
    assert epoch_order(DataLoader(data, batch_size=6, shuffle=True)) == e1
    gen_a = DataLoader(data, batch_size=6, shuffle=True, generator=np.random.default_rng(1))
    gen_b = DataLoader(data, batch_size=6, shuffle=True, generator=np.random.default_rng(1))
    assert epoch_order(gen_a) == epoch_order(gen_b)
    for x, y in DataLoader(data, batch_size=6, shuffle=True):
        np.testing.assert_array_equal(y.numpy(), x.numpy() * 2)  # rows stay paired


def test_tensor_dataset_fast_path_equals_per_sample_collate():
    x, y = flow.randn(7, 3), flow.arange(7)
    data = TensorDataset(x, y)
    fast = list(DataLoader(data, batch_size=3))
    slow = list(DataLoader(data, batch_size=3, collate_fn=lambda b: default_collate(b)))
    for (fx, fy), (sx, sy) in zip(fast, slow):
        np.testing.assert_array_equal(fx.numpy(), sx.numpy())
        np.testing.assert_array_equal(fy.numpy(), sy.numpy())
        assert fy.dtype == sy.dtype == flow.int64
    with pytest.raises(ValueError, match="Size mismatch"):
        TensorDataset(flow.zeros(3), flow.zeros(4))


def test_random_split():
    flow.manual_seed(0)
    a, b = random_split(Squares(), [0.7, 0.3])
    assert len(a) == 7 and len(b) == 3
    assert sorted(a.indices + b.indices) == list(range(10))


# ---------------------------------------------------------- save / load
def _model():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))


def _train_step(model, opt, seed):
    rng = np.random.default_rng(seed)
    x, y = flow.tensor(rng.standard_normal((8, 3)).astype(np.float32)), flow.tensor(rng.integers(0, 2, 8))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def test_save_load_round_trip_of_a_checkpoint(tmp_path):
    flow.manual_seed(0)
    model = _model()
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 3, 3])
    for step in range(2):
        _train_step(model, opt, step)
        scheduler.step()
    checkpoint = {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict(),
        "epoch": 2, "best": 0.125, "tag": "run-1", "notes": None, "flags": (True, False), "inf": float("inf"),
        "extras": [flow.tensor([1, 2, 3]), {1: flow.ones(2, dtype=flow.bfloat16)}, np.arange(3.0)],
        "scalar": flow.tensor(3.5),
    }
    path = tmp_path / "ckpt"
    flow.save(checkpoint, path)
    assert sorted(os.listdir(path)) == ["structure.json", "tensors.safetensors"]
    loaded = flow.load(path)

    assert loaded["epoch"] == 2 and loaded["best"] == 0.125 and loaded["tag"] == "run-1"
    assert loaded["notes"] is None and loaded["flags"] == (True, False) and loaded["inf"] == float("inf")
    assert loaded["extras"][0].dtype == flow.int64 and loaded["extras"][0].tolist() == [1, 2, 3]
    assert loaded["extras"][1][1].dtype == flow.bfloat16
    assert isinstance(loaded["extras"][2], np.ndarray) and loaded["scalar"].shape == ()
    assert list(loaded["model"]) == list(checkpoint["model"])
    for key, value in checkpoint["model"].items():
        assert loaded["model"][key].dtype == value.dtype
        np.testing.assert_array_equal(loaded["model"][key].numpy(), value.numpy())
    assert loaded["optimizer"]["state"][0]["momentum_buffer"].shape == (4, 3)
    assert loaded["scheduler"]["milestones"] == {1: 1, 3: 2}

    # Resuming from the loaded checkpoint continues exactly like the original run.
    model2 = _model()
    opt2 = optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    scheduler2 = optim.lr_scheduler.MultiStepLR(opt2, milestones=[1, 3, 3])
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    scheduler2.load_state_dict(loaded["scheduler"])
    for step in range(2, 5):
        assert _train_step(model, opt, step) == _train_step(model2, opt2, step)
        scheduler.step()
        scheduler2.step()
        assert scheduler.get_last_lr() == scheduler2.get_last_lr()
    for a, b in zip(model.parameters(), model2.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_structure_json_is_readable(tmp_path):
    flow.save({"w": flow.ones(2), "n": 3}, tmp_path / "s")
    structure = json.loads((tmp_path / "s" / "structure.json").read_text())
    assert structure["format"] == "flowgen.save" and structure["version"] == 1
    assert structure["root"] == {"__dict__": {"w": {"__tensor__": "w", "dtype": "float32", "device": "cpu"},
                                              "n": 3}}
    body = {k: v for k, v in structure.items() if k != "structure_sha256"}
    assert structure["structure_sha256"] == serialization.document_sha256(body)
    from safetensors.numpy import load_file

    assert list(load_file(str(tmp_path / "s" / "tensors.safetensors"))) == ["w"]


def test_save_overwrites_atomically_and_cleans_up(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    flow.save({"version": 1, "w": flow.zeros(3)}, path)
    flow.save({"version": 2, "w": flow.ones(3)}, path)  # replacing a previous save is fine
    assert flow.load(path)["version"] == 2

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    # A failure while writing the tensors leaves the old save untouched and no temporary directory behind.
    monkeypatch.setattr(serialization, "_write_tensors", crash)
    with pytest.raises(OSError, match="simulated"):
        flow.save({"version": 3, "w": flow.full((3,), 7.0)}, path)
    monkeypatch.undo()
    assert flow.load(path)["version"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]

    # Where the old and new directories cannot be swapped in one step (renameat2), the old one is
    # renamed aside first; a failure between the two renames puts it back.
    monkeypatch.setattr(serialization, "_exchange", lambda new, path: False)
    real_rename = os.rename
    calls = []

    def rename_failing_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("rename failed (simulated)")
        return real_rename(src, dst)

    monkeypatch.setattr(serialization.os, "rename", rename_failing_second)
    with pytest.raises(OSError, match="simulated"):
        flow.save({"version": 4}, path)
    monkeypatch.setattr(serialization.os, "rename", real_rename)
    loaded = flow.load(path)
    assert loaded["version"] == 2 and loaded["w"].tolist() == [1.0, 1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    flow.save({"version": 5}, path)   # and without the failure, the fallback replaces the save
    monkeypatch.undo()
    assert flow.load(path) == {"version": 5} and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_leftovers_of_interrupted_saves_are_removed_by_the_next_save_and_load(tmp_path):
    path = tmp_path / "ckpt"
    flow.save({"a": 1}, path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()   # a process that has exited
    leftovers = [f"ckpt.tmp-{dead}-0123abcd", f"ckpt.old-{dead}-4567cdef", "ckpt.tmp-89abcdef"]   # + old naming
    running = f"ckpt.tmp-{os.getppid()}-0123abcd"   # a save in progress in a live process: kept
    for name in leftovers + [running, "ckpt2.tmp-0123abcd"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "tensors.safetensors").write_bytes(b"x" * 1000)
    flow.save({"a": 2}, path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", running, "ckpt2.tmp-0123abcd"])
    (tmp_path / leftovers[0]).mkdir()
    assert flow.load(path) == {"a": 2}
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", running, "ckpt2.tmp-0123abcd"])


def test_save_refuses_to_clobber_other_things(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="a file that flow.save did not write"):
        flow.save({"a": 1}, tmp_path / "file")
    assert (tmp_path / "file").read_text() == "x"
    other = tmp_path / "project"
    other.mkdir()
    (other / "main.py").write_text("print()")
    with pytest.raises(FileExistsError, match="not a flow.save directory"):
        flow.save({"a": 1}, other)
    assert (other / "main.py").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    flow.save({"a": 1}, empty)  # an empty directory (made by os.makedirs first) is fine
    assert flow.load(empty) == {"a": 1}
    with pytest.raises(TypeError, match="cannot save an object of type object at 'bad.0'"):
        flow.save({"bad": [object()]}, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="parent directory"):
        flow.save({"a": 1}, tmp_path / "missing" / "x")


def _rehashed(structure: dict) -> str:
    """structure.json text for a hand-edited structure, with its self-hash made to match."""
    body = {k: v for k, v in structure.items() if k != "structure_sha256"}
    return json.dumps(serialization.with_self_hash(body, "structure_sha256"))


def test_load_reports_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        flow.load(tmp_path / "nothing")
    path = tmp_path / "ckpt"
    flow.save({"w": flow.randn(100), "n": 3}, path)
    tensors = path / "tensors.safetensors"
    data = tensors.read_bytes()

    tensors.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="tensors.safetensors is corrupt"):
        flow.load(path)
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    tensors.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="SHA-256"):
        flow.load(path)
    tensors.write_bytes(data)
    assert flow.load(path)["w"].shape == (100,)

    structure = path / "structure.json"
    text = structure.read_text()
    structure.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        flow.load(path)
    # The structure file is covered by its own hash: an edited value is refused...
    structure.write_text(text.replace('"n": 3', '"n": 4'))
    with pytest.raises(CheckpointError, match="structure.json is corrupt.*structure_sha256"):
        flow.load(path)
    # ... and an edit with a matching hash is still checked node by node.
    edited = json.loads(text)
    edited["root"]["__dict__"]["w"]["__tensor__"] = "v"
    structure.write_text(_rehashed(edited))
    with pytest.raises(CheckpointError, match="node at 'w' refers to tensor 'v'"):
        flow.load(path)
    edited["root"]["__dict__"]["w"] = {"__dict_items__": [[[1], 2]]}
    structure.write_text(_rehashed(edited))
    with pytest.raises(CheckpointError, match="node at 'w' has __dict_items__ entry 0 whose key is a list"):
        flow.load(path)
    structure.unlink()
    with pytest.raises(CheckpointError, match="structure.json is missing"):
        flow.load(path)
    structure.mkdir()
    with pytest.raises(CheckpointError, match="cannot read .*structure.json"):
        flow.load(path)
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="f is corrupt"):
        flow.load(tmp_path / "f")


def test_load_hints_at_an_interrupted_swap(tmp_path):
    flow.save({"a": 1}, tmp_path / "ckpt")
    os.rename(tmp_path / "ckpt", tmp_path / "ckpt.old-1234abcd")
    with pytest.raises(FileNotFoundError, match="ckpt.old-1234abcd"):
        flow.load(tmp_path / "ckpt")


def test_save_dispatches_to_flowgen_save_hook(tmp_path):
    class Exportable:
        def _flowgen_save(self, path):
            self.saved_to = path
            return "done"

    obj = Exportable()
    assert flow.save(obj, tmp_path / "g") == "done" and obj.saved_to == tmp_path / "g"


def test_parameters_round_trip_as_parameters(tmp_path):
    p = nn.Parameter(flow.randn(2, 2))
    flow.save({"p": p, "t": p.detach()}, tmp_path / "p", )
    loaded = flow.load(tmp_path / "p", map_location="cuda")
    assert isinstance(loaded["p"], nn.Parameter) and loaded["p"].requires_grad
    assert not isinstance(loaded["t"], nn.Parameter) and loaded["t"].device == flow.device("cuda")


# ---------------------------------------------------------- polyfit example
def test_polyfit_example_reaches_loss_about_9(capsys):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import polyfit_eager
    finally:
        sys.path.pop(0)
    losses, model = polyfit_eager.main()
    out = capsys.readouterr().out
    assert losses[-1][0] == 1999 and 7.5 < losses[-1][1] < 11.0
    assert losses[0][1] > losses[-1][1]
    assert "Result: y = " in out and "*x^3" in out
    w = model[0].weight.numpy()[0]
    assert 0.8 < w[0] < 0.9 and -0.1 < w[2] < -0.08  # ~ sin(x) ≈ x - x^3/6 over [-pi, pi]


def test_save_to_an_existing_file_writes_one_file_atomically(tmp_path, monkeypatch):
    """OneFlow's flow.save writes a file, so its users save to a tempfile's name: an empty file (or
    an earlier single-file save) is replaced atomically by one safetensors file; load reads it back.
    A save that fails midway leaves the old file whole."""
    import tempfile

    from flowgen import serialization

    state = {"w": flow.randn(3, 2), "opt": {"step": 4, "lr": 0.5, "m": [flow.ones(2)]}}
    with tempfile.NamedTemporaryFile(dir=tmp_path) as f:
        flow.save(state, f.name)
        got = flow.load(f.name)
        np.testing.assert_array_equal(got["w"].numpy(), state["w"].numpy())
        assert got["opt"]["step"] == 4 and got["opt"]["lr"] == 0.5
        np.testing.assert_array_equal(got["opt"]["m"][0].numpy(), np.ones(2, np.float32))
        before = open(f.name, "rb").read()

        def broken(arrays, file, metadata):
            file.write(b"partial")
            raise OSError("disk full")
        monkeypatch.setattr(serialization, "write_safetensors", broken)
        with pytest.raises(OSError, match="disk full"):
            flow.save({"w": flow.zeros(1)}, f.name)
        monkeypatch.undo()
        assert open(f.name, "rb").read() == before and sorted(os.listdir(tmp_path)) == [os.path.basename(f.name)]
        data = bytearray(before)
        data[-1] ^= 0xFF                              # a flipped bit in the last tensor's bytes
        open(f.name, "wb").write(bytes(data))
        with pytest.raises(CheckpointError, match="is corrupt: its tensors do not match"):
            flow.load(f.name)
