"""Checkpoints: round trips of every dtype, no pickle, atomic writes that survive crashes, clear errors on
corrupt files, pruning, and optimizer state that resumes exactly."""

from __future__ import annotations

import doctest
import json
import os

import ml_dtypes
import numpy as np
import pytest

from stratagem.training import checkpoint as ckpt_module
from stratagem.training.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointNotFoundError,
    latest_checkpoint,
    load,
    save,
)
from stratagem.training.optimizers.rules import SGD, Adagrad, Adam
from stratagem.training.variables import Variable


def files(directory):
    return sorted(os.listdir(directory))


def pointer(directory):
    with open(os.path.join(directory, "latest")) as f:
        return f.read().strip()


# -- round trips -------------------------------------------------------------------------------------

ARRAYS = {
    "float32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "float64": np.array([np.pi, -np.inf, np.nan]),
    "float16": np.array([1.5, -2.25, 65504], np.float16),
    "bfloat16": np.array([[1.5, -3.0e38], [1e-30, 7.0]], ml_dtypes.bfloat16),
    "int64": np.array([-(2 ** 62), 2 ** 62]),
    "uint8": np.arange(5, dtype=np.uint8),
    "bool": np.array([True, False]),
    "complex64": np.array([1 + 2j], np.complex64),
    "scalar": np.array(3.0, np.float32),
    "empty": np.zeros((0, 3), np.float32),
    "layer/kernel:0 ünïcode": np.ones(2, np.float32),   # any name: members are numbered
}


def test_round_trip_of_every_dtype(tmp_path):
    path = save(tmp_path, ARRAYS, None, step=42, extra={"epoch": 3, "loss": 0.25, "tags": ["a"]})
    assert os.path.basename(path) == "ckpt-00000042.npz" and pointer(tmp_path) == "ckpt-00000042.npz"
    restored = load(tmp_path)
    assert isinstance(restored, Checkpoint)
    assert (restored.step, restored.extra, restored.optimizer_state, restored.path) == (
        42, {"epoch": 3, "loss": 0.25, "tags": ["a"]}, None, path)
    assert list(restored.variables) == list(ARRAYS)
    for name, array in ARRAYS.items():
        got = restored.variables[name]
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == array.tobytes(), name    # bit-exact, NaN and bfloat16 included


def test_values_may_be_variables_and_big_endian_arrays(tmp_path):
    big = np.arange(3, dtype=">f4")
    save(tmp_path, {"v": Variable(np.ones(2, np.float16), name="v"), "big": big}, None, 1)
    restored = load(tmp_path).variables
    assert restored["v"].dtype == np.float16 and restored["v"].tolist() == [1.0, 1.0]
    assert restored["big"].tolist() == [0.0, 1.0, 2.0] and restored["big"].dtype == np.float32


def test_device_arrays_are_copied_to_the_host(tmp_path, monkeypatch):
    class FakeDeviceArray(np.ndarray):
        def get(self):
            return np.array(self, copy=True).view(np.ndarray)

    FakeDeviceArray.__module__ = "cupy._core.core"
    save(tmp_path, {"w": np.arange(3.0).view(FakeDeviceArray)}, None, 1)
    assert load(tmp_path).variables["w"].tolist() == [0.0, 1.0, 2.0]


def test_optimizer_state_round_trip_with_bfloat16_slots(tmp_path):
    state = {"iterations": 7, "slots": {"w": {"m": np.ones(2, ml_dtypes.bfloat16), "v": np.zeros(2, np.float32)},
                                         "b": {"m": np.ones(1), "v": np.ones(1)}}}
    save(tmp_path, {"w": np.zeros(2), "b": np.zeros(1)}, state, 7)
    restored = load(tmp_path).optimizer_state
    assert restored["iterations"] == 7
    assert restored["slots"]["w"]["m"].dtype == np.dtype(ml_dtypes.bfloat16)
    for var, slots in state["slots"].items():
        for slot, array in slots.items():
            assert restored["slots"][var][slot].tobytes() == array.tobytes()


# -- no pickle -------------------------------------------------------------------------------------------

def test_format_loads_without_pickle(tmp_path, monkeypatch):
    path = save(tmp_path, ARRAYS, {"iterations": 1, "slots": {"w": {"m": np.ones(2, ml_dtypes.bfloat16)}}}, 5)
    with np.load(path, allow_pickle=False) as archive:     # plain numpy can read every member
        members = {key: archive[key] for key in archive.files}
    assert all(a.dtype.kind in "biufc" for a in members.values())
    meta = json.loads(members["__meta__"].tobytes())
    assert meta["format"] == "stratagem-checkpoint" and meta["version"] == 1
    calls = []
    original = np.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("allow_pickle"))
        return original(*args, **kwargs)

    monkeypatch.setattr(np, "load", spy)
    load(tmp_path)
    assert calls == [False]


def test_an_archive_with_pickled_objects_is_refused(tmp_path):
    path = tmp_path / "ckpt-00000001.npz"
    np.savez(path, __meta__=np.frombuffer(b"{}", np.uint8), evil=np.array([object()], dtype=object))
    with pytest.raises(CheckpointError, match=f"{path}.*pickle"):
        load(path)


def test_object_arrays_and_unserialisable_extra_are_refused_at_save(tmp_path):
    with pytest.raises(CheckpointError, match="variable 'o'.*without pickle"):
        save(tmp_path, {"o": np.array([object()], dtype=object)}, None, 1)
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save(tmp_path, {"w": np.zeros(1)}, None, 1, extra={"f": object()})
    assert latest_checkpoint(tmp_path) is None
    assert [f for f in os.listdir(tmp_path)] == []


@pytest.mark.parametrize("kwargs, message", [
    ({"step": -1}, "step must be an integer >= 0"),
    ({"step": 1.0}, "step must be an integer >= 0"),
    ({"step": True}, "step must be an integer >= 0"),
    ({"step": 1, "max_to_keep": 0}, "max_to_keep"),
    ({"step": 1, "optimizer_state": {"slots": {}}}, "state_dict"),
    ({"step": 1, "optimizer_state": {"iterations": "1", "slots": {}}}, "iterations"),
    ({"step": 1, "variables": [np.zeros(1)]}, "variables must be a dict"),
    ({"step": 1, "variables": {1: np.zeros(1)}}, "names must be strings"),
])
def test_save_validates(tmp_path, kwargs, message):
    kwargs = {"variables": {"w": np.zeros(1)}, "optimizer_state": None, **kwargs}
    with pytest.raises(CheckpointError, match=message):
        save(tmp_path, **kwargs)


# -- atomicity and crashes -----------------------------------------------------------------------------

def test_a_crash_while_writing_the_checkpoint_leaves_latest_intact(tmp_path, monkeypatch):
    save(tmp_path, {"w": np.full(3, 1.0)}, None, 1)
    real_savez = np.savez

    def crashing_savez(file, **members):
        file.write(b"PK\x03\x04 half a zip archive")     # garbage in the temporary file...
        raise OSError("disk full")                       # ...then the writer dies

    monkeypatch.setattr(np, "savez", crashing_savez)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, {"w": np.full(3, 2.0)}, None, 2)
    monkeypatch.setattr(np, "savez", real_savez)
    assert files(tmp_path) == ["ckpt-00000001.npz", "latest"]   # no partial file, no temp file left
    assert pointer(tmp_path) == "ckpt-00000001.npz"
    restored = load(tmp_path)
    assert restored.step == 1 and restored.variables["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_crash_after_a_partial_write_of_real_data_leaves_latest_intact(tmp_path, monkeypatch):
    save(tmp_path, {"w": np.zeros(1000)}, None, 1)
    real_savez = np.savez

    def dies_half_way(file, **members):
        real_savez(file, **members)
        file.truncate(file.tell() // 2)                 # a torn write
        raise KeyboardInterrupt                          # e.g. the job is being killed

    monkeypatch.setattr(np, "savez", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, {"w": np.ones(1000)}, None, 2)
    monkeypatch.setattr(np, "savez", real_savez)
    assert latest_checkpoint(tmp_path).endswith("ckpt-00000001.npz")
    assert not load(tmp_path).variables["w"].any()


def test_a_crash_before_the_pointer_is_updated_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, {"w": np.zeros(1)}, None, 1)
    real_replace = os.replace

    def failing_replace(src, dst):
        if os.path.basename(dst) == "latest":
            raise OSError("killed before the pointer was renamed")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="pointer"):
        save(tmp_path, {"w": np.ones(1)}, None, 2)
    monkeypatch.setattr(os, "replace", real_replace)
    # the new checkpoint is complete but not yet pointed at: latest still names the old one
    assert pointer(tmp_path) == "ckpt-00000001.npz" and load(tmp_path).step == 1
    assert load(tmp_path / "ckpt-00000002.npz").variables["w"].tolist() == [1.0]
    assert not [f for f in files(tmp_path) if f.startswith(".tmp-")]


def test_stray_temporary_files_are_ignored_and_cleaned_up(tmp_path):
    save(tmp_path, {"w": np.zeros(1)}, None, 1)
    for name in (".tmp-ckpt-00000002.npz.abc123", ".tmp-latest.xyz"):   # left by a killed process
        (tmp_path / name).write_bytes(b"\x00garbage")
    assert latest_checkpoint(tmp_path).endswith("ckpt-00000001.npz")
    assert load(tmp_path).step == 1
    save(tmp_path, {"w": np.ones(1)}, None, 2)
    assert files(tmp_path) == ["ckpt-00000001.npz", "ckpt-00000002.npz", "latest"]


def test_without_a_pointer_the_newest_checkpoint_is_used(tmp_path):
    save(tmp_path, {"w": np.zeros(1)}, None, 9, max_to_keep=None)
    save(tmp_path, {"w": np.ones(1)}, None, 100_000_000, max_to_keep=None)   # wider than 8 digits
    save(tmp_path, {"w": np.ones(1)}, None, 10, max_to_keep=None)
    assert pointer(tmp_path) == "ckpt-00000010.npz"
    os.unlink(tmp_path / "latest")
    assert latest_checkpoint(tmp_path).endswith("ckpt-100000000.npz")       # numeric, not lexical order
    os.unlink(tmp_path / "ckpt-100000000.npz")
    with open(tmp_path / "latest", "w") as f:
        f.write("ckpt-00000077.npz\n")                                       # names a deleted file
    assert latest_checkpoint(tmp_path).endswith("ckpt-00000010.npz")


def test_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = save(tmp_path, {"w": np.zeros(1)}, None, 1)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644          # not tempfile's private 0600
    assert os.stat(tmp_path / "latest").st_mode & 0o777 == 0o644


def test_same_step_is_replaced(tmp_path):
    save(tmp_path, {"w": np.zeros(1)}, None, 3)
    save(tmp_path, {"w": np.ones(1)}, None, 3)
    assert files(tmp_path) == ["ckpt-00000003.npz", "latest"] and load(tmp_path).variables["w"][0] == 1


# -- pruning -------------------------------------------------------------------------------------------

def test_max_to_keep(tmp_path):
    for step in range(7):
        save(tmp_path, {"w": np.full(1, step)}, None, step, max_to_keep=3)
    assert files(tmp_path) == ["ckpt-00000004.npz", "ckpt-00000005.npz", "ckpt-00000006.npz", "latest"]
    save(tmp_path, {"w": np.zeros(1)}, None, 7, max_to_keep=1)
    assert files(tmp_path) == ["ckpt-00000007.npz", "latest"]
    for step in range(8, 12):
        save(tmp_path, {"w": np.zeros(1)}, None, step, max_to_keep=None)
    assert len(files(tmp_path)) == 6


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (10, 11, 12):
        save(tmp_path, {"w": np.zeros(1)}, None, step, max_to_keep=5)
    path = save(tmp_path, {"w": np.ones(1)}, None, 5, max_to_keep=2)   # training rolled back to step 5
    assert files(tmp_path) == ["ckpt-00000005.npz", "ckpt-00000012.npz", "latest"]
    assert latest_checkpoint(tmp_path) == path


# -- reading errors ------------------------------------------------------------------------------------

def test_missing_checkpoints(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "nowhere") is None
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint in this directory"):
        load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load(tmp_path / "ckpt-00000001.npz")


def corrupt_truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def corrupt_bit_flip(path):
    data = bytearray(path.read_bytes())
    position = data.find(b"\x00\x00\x80\x3f")   # inside the float32 ones: the data, not the zip directory
    assert position > 0
    data[position + 3] ^= 0x01
    path.write_bytes(bytes(data))


def corrupt_empty(path):
    path.write_bytes(b"")


def corrupt_garbage(path):
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 300, dtype=np.uint8).tobytes())


def corrupt_npy(path):
    with open(path, "wb") as f:
        np.save(f, np.zeros(3))


def corrupt_no_meta(path):
    with open(path, "wb") as f:
        np.savez(f, w=np.zeros(3))


def corrupt_future_version(path):
    with np.load(path) as archive:
        members = {k: archive[k] for k in archive.files}
    meta = json.loads(members["__meta__"].tobytes())
    meta["version"] = 99
    members["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **members)


def corrupt_meta_lies_about_dtype(path):
    with np.load(path) as archive:
        members = {k: archive[k] for k in archive.files}
    meta = json.loads(members["__meta__"].tobytes())
    for info in meta["arrays"].values():
        info["dtype"] = "object"
    members["__meta__"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **members)


def corrupt_meta_not_json(path):
    with np.load(path) as archive:
        members = {k: archive[k] for k in archive.files}
    members["__meta__"] = np.frombuffer(b"\xff{not json", np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **members)


@pytest.mark.parametrize("corrupt, message", [
    (corrupt_truncated, "truncated or corrupt"),
    (corrupt_bit_flip, "truncated or corrupt"),
    (corrupt_empty, "truncated or corrupt"),
    (corrupt_garbage, "truncated or corrupt"),
    (corrupt_npy, "not an .npz archive"),
    (corrupt_no_meta, "no __meta__ member"),
    (corrupt_future_version, "version 99 is newer.*upgrade"),
    (corrupt_meta_lies_about_dtype, "unknown dtype 'object'"),
    (corrupt_meta_not_json, "corrupt metadata"),
])
def test_a_corrupt_file_gives_a_clear_error_naming_it(tmp_path, corrupt, message):
    path = tmp_path / "ckpt-00000001.npz"
    save(tmp_path, {"w": np.ones(64, np.float32)}, None, 1)
    corrupt(path)
    for target in (path, tmp_path):        # the file itself, or the directory whose latest it is
        with pytest.raises(CheckpointError, match=message) as info:
            load(target)
        assert str(path) in str(info.value)


@pytest.mark.parametrize("content", ["../../etc/passwd", "", "ckpt-1.npz.tmp"])
def test_a_bad_pointer_is_an_error_naming_it(tmp_path, content):
    save(tmp_path, {"w": np.zeros(1)}, None, 1)
    (tmp_path / "latest").write_text(content)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'latest'}: does not name a checkpoint"):
        latest_checkpoint(tmp_path)


# -- resuming training ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: SGD(0.1, momentum=0.9, nesterov=True), lambda: Adam(0.01),
                                  lambda: Adagrad(0.1)], ids=["SGD", "Adam", "Adagrad"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_resume_gives_the_same_next_update_as_an_uninterrupted_run(tmp_path, make, dtype):
    rng = np.random.default_rng(0)
    shapes = {"kernel": (3, 2), "bias": (2,)}
    grads = [{n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()} for _ in range(6)]

    def build():
        return {n: Variable(np.ones(s, dtype), name=n) for n, s in shapes.items()}

    def step(opt, variables, g):
        opt.apply_gradients([(g[n], variables[n]) for n in shapes])

    variables, opt = build(), make()
    for g in grads[:3]:
        step(opt, variables, g)
    save(tmp_path, {n: v.value for n, v in variables.items()}, opt.state_dict(), step=3)

    restored = load(tmp_path)                       # a new process: new variables, a new optimizer
    resumed, opt2 = build(), make()
    for n, v in resumed.items():
        v.assign(restored.variables[n])
    opt2.load_state_dict(restored.optimizer_state)
    assert restored.step == opt2.iterations == 3
    for g in grads[3:]:
        step(opt, variables, g)
        step(opt2, resumed, g)
    for n in shapes:
        assert variables[n].numpy().tobytes() == resumed[n].numpy().tobytes()


def test_docstring_examples():
    result = doctest.testmod(ckpt_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
