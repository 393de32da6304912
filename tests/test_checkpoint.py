"""Tests for attnkit.runs.checkpoint: safetensors weights with ties, safe training state."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from attnkit.common.errors import UserError
from attnkit.runs.checkpoint import (
    ALIASES_KEY,
    average_weights,
    capture_rng_state,
    check_compatible,
    load_training_state,
    load_weights,
    restore_rng_state,
    save_training_state,
    save_weights,
)


class Exploit:
    """Unpickling this would run code; weights_only loading must refuse it."""

    def __reduce__(self) -> tuple:
        return (Path.touch, (Path("/tmp/attnkit-test-pwned"),))


def tied_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    emb = torch.randn(5, 3)
    return {
        "embed.weight": emb,
        "out.weight": emb,  # tied: same storage, same view
        "out.bias": torch.zeros(5),
        "transposed": torch.randn(3, 4).t(),  # non-contiguous
        "half_a": emb[:2],  # another view of the tied storage
        "steps": torch.tensor([7], dtype=torch.int64),
    }


def test_weights_round_trip_with_ties_and_metadata(tmp_path: Path) -> None:
    state = tied_state()
    path = tmp_path / "model.safetensors"
    save_weights(path, state, {"config": "abc"})
    loaded, metadata = load_weights(path)
    assert metadata == {"config": "abc"}
    assert loaded.keys() == state.keys()
    for key in state:
        torch.testing.assert_close(loaded[key], state[key], rtol=0, atol=0)
    assert loaded["out.weight"] is loaded["embed.weight"]  # tie restored
    assert loaded["half_a"].untyped_storage().data_ptr() != loaded["embed.weight"].untyped_storage().data_ptr()


def test_tied_module_loads_into_model(tmp_path: Path) -> None:
    embed = torch.nn.Embedding(6, 4)
    out = torch.nn.Linear(4, 6, bias=False)
    out.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "out": out})
    path = tmp_path / "m.safetensors"
    save_weights(path, model.state_dict())
    fresh = torch.nn.ModuleDict({"embed": torch.nn.Embedding(6, 4), "out": torch.nn.Linear(4, 6, bias=False)})
    fresh["out"].weight = fresh["embed"].weight
    loaded, _ = load_weights(path)
    check_compatible(fresh.state_dict(), loaded, path)
    fresh.load_state_dict(loaded)
    torch.testing.assert_close(fresh["out"].weight, embed.weight)
    assert fresh["out"].weight is fresh["embed"].weight


def test_reserved_metadata_key_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        save_weights(tmp_path / "x.safetensors", {"a": torch.ones(1)}, {ALIASES_KEY: "{}"})


@pytest.mark.parametrize("kind", ["random", "truncated", "pickle", "empty"])
def test_corrupt_weights_are_a_user_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "bad.safetensors"
    if kind == "random":
        path.write_bytes(random.Random(0).randbytes(4096))
    elif kind == "truncated":
        save_weights(path, {"w": torch.randn(64, 64)})
        path.write_bytes(path.read_bytes()[:-100])
    elif kind == "pickle":
        torch.save({"w": torch.randn(3)}, path)
    else:
        path.write_bytes(b"")
    with pytest.raises(
        UserError, match=r"bad\.safetensors: is not a safetensors checkpoint \(corrupt or foreign file\)"
    ):
        load_weights(path)


def test_missing_weights_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="nope.safetensors: no such checkpoint file"):
        load_weights(tmp_path / "nope.safetensors")


def test_check_compatible_summarises_differences() -> None:
    model = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1)}
    loaded = {"a": torch.zeros(2, 5), "b": torch.zeros(4), "z": torch.zeros(1)}
    with pytest.raises(UserError) as err:
        check_compatible(model, loaded, "ck.safetensors")
    message = str(err.value)
    assert message.startswith("ck.safetensors: checkpoint does not fit this model")
    assert "missing key(s) 'c'" in message and "unexpected key(s) 'z'" in message
    assert "'a' checkpoint (2, 5) vs model (2, 3)" in message and "\n" not in message
    check_compatible(model, dict(model), "ck.safetensors")  # identical: no error


def test_training_state_round_trip(tmp_path: Path) -> None:
    param = torch.nn.Parameter(torch.randn(3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.ones(3)
    optimizer.step()
    state = {
        "optimizer": optimizer.state_dict(),
        "step": 12,
        "epoch": 1,
        "batch": [3, 4],
        "loss": 0.5,
        "rng": capture_rng_state(),
    }
    path = tmp_path / "train_state.pt"
    save_training_state(path, state)
    loaded = load_training_state(path)
    assert loaded["step"] == 12 and loaded["batch"] == [3, 4] and loaded["loss"] == 0.5
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=0.1)
    fresh.load_state_dict(loaded["optimizer"])
    torch.testing.assert_close(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_save_training_state_rejects_arbitrary_objects(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['obj'\] is a Exploit"):
        save_training_state(tmp_path / "s.pt", {"obj": Exploit()})
    assert not (tmp_path / "s.pt").exists()


def test_pickled_object_is_refused_not_executed(tmp_path: Path) -> None:
    marker = Path("/tmp/attnkit-test-pwned")
    marker.unlink(missing_ok=True)
    path = tmp_path / "evil.pt"
    torch.save({"step": 1, "obj": Exploit()}, path)
    with pytest.raises(UserError, match=r"evil\.pt: cannot load training state"):
        load_training_state(path)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["random", "truncated", "plain-pickle", "not-a-dict", "missing"])
def test_bad_training_state_is_a_user_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "state.pt"
    if kind == "random":
        path.write_bytes(random.Random(1).randbytes(2048))
    elif kind == "truncated":
        save_training_state(path, {"w": torch.randn(100)})
        path.write_bytes(path.read_bytes()[:200])
    elif kind == "plain-pickle":
        path.write_bytes(b"\x80\x02}q\x00X\x04\x00\x00\x00stepq\x01K\x01s.")  # a plain pickle of {"step": 1}
    elif kind == "not-a-dict":
        torch.save([1, 2], path)
    with pytest.raises(UserError, match=r"state\.pt: "):
        load_training_state(path)


def test_rng_capture_restore_reproduces_numbers(tmp_path: Path) -> None:
    random.seed(123)
    torch.manual_seed(123)
    random.gauss(0, 1)  # leaves a cached gauss_next in the Python state
    path = tmp_path / "rng.pt"
    save_training_state(path, {"rng": capture_rng_state()})
    expected = ([random.random() for _ in range(5)], random.gauss(0, 1), torch.rand(5))
    random.seed(999)
    torch.manual_seed(999)
    restore_rng_state(load_training_state(path)["rng"])
    got = ([random.random() for _ in range(5)], random.gauss(0, 1), torch.rand(5))
    assert got[:2] == expected[:2]
    torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0)


def test_average_weights(tmp_path: Path) -> None:
    paths = []
    for i in range(3):
        emb = torch.full((2, 2), float(i))
        state = {
            "emb": emb,
            "out": emb,
            "half": torch.full((2,), float(i), dtype=torch.bfloat16),
            "step": torch.tensor(i),
        }
        paths.append(tmp_path / f"ckpt{i}.safetensors")
        save_weights(paths[-1], state)
    averaged = average_weights(paths)
    torch.testing.assert_close(averaged["emb"], torch.full((2, 2), 1.0))
    assert averaged["out"] is averaged["emb"]
    assert averaged["half"].dtype == torch.bfloat16 and averaged["half"].tolist() == [1.0, 1.0]
    assert averaged["step"].item() == 2


def test_average_weights_mismatch_names_file(tmp_path: Path) -> None:
    a, b, c = (tmp_path / f"{n}.safetensors" for n in "abc")
    save_weights(a, {"w": torch.zeros(2)})
    save_weights(b, {"w": torch.zeros(3)})
    save_weights(c, {"v": torch.zeros(2)})
    with pytest.raises(UserError, match=r"b\.safetensors: tensor 'w' is torch.float32 \(3,\)"):
        average_weights([a, b])
    with pytest.raises(UserError, match=r"c\.safetensors: has different keys"):
        average_weights([a, c])
    with pytest.raises(UserError, match="no checkpoints"):
        average_weights([])


def test_training_state_is_safetensors_with_its_structure_as_json(tmp_path: Path) -> None:
    """No pickle: the tensors are the file's, the rest JSON in its header; int keys, tuples, sizes, bytes and
    infinities come back as they went in."""
    import math

    from safetensors import safe_open

    state = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)[:, 1]}},
                           "param_groups": [{"params": [0], "betas": (0.9, 0.99)}]},
             "best_score": -math.inf, "shape": torch.Size([2, 3]), "raw": b"\x00\xff", "none": None}
    path = tmp_path / "state.safetensors"
    save_training_state(path, state)
    with safe_open(str(path), framework="pt") as f:
        assert "attnkit.training_state" in f.metadata() and len(list(f.keys())) == 2
    loaded = load_training_state(path)
    assert loaded.keys() == state.keys() and loaded["best_score"] == -math.inf
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert (loaded["shape"], loaded["raw"], loaded["none"]) == (torch.Size([2, 3]), b"\x00\xff", None)
    for key, tensor in state["optimizer"]["state"][0].items():
        assert torch.equal(loaded["optimizer"]["state"][0][key], tensor)
