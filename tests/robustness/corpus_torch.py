"""Damaged torch files: pytorch_model.bin, loose rank files, Megatron and SAT checkpoints; hostile pickles in each."""

from __future__ import annotations

import pickle
import shutil

import torch
from cases import case
from damage import (
    edit_json,
    patch_first_numel,
    payload,
    rezip,
    torch_edit,
    truncate,
)
from safetensors.torch import save_file

# ---------------------------------------------------------------- pytorch_model.bin


BIN = "pytorch_model.bin"


def _bin_payload(name: str, kind: str, culprit: str, **save: object) -> None:
    @case(f"bin-payload-{name}", "bin", BIN, culprit)
    def _(ckpt, marker):
        torch_edit(ckpt / BIN, lambda sd: sd.__setitem__("evil", payload(marker, kind)), **save)


_bin_payload("system", "system", "posix.system")
_bin_payload("exec", "exec", "pickles exec")
_bin_payload("legacy-format", "open", "open", _use_new_zipfile_serialization=False)


@case("bin-raw-pickle-payload", "bin", BIN, "weights-only unpickler")
def _(ckpt, marker):
    (ckpt / BIN).write_bytes(pickle.dumps(payload(marker)))


@case("bin-truncated", "bin", BIN, "truncated")
def _(ckpt, marker):
    truncate(ckpt / BIN, 0.5)


@case("bin-storage-past-its-record", "bin", BIN, "the record holds")
def _(ckpt, marker):
    rezip(ckpt / BIN, pickled=lambda data: patch_first_numel(data, lambda n: n * 4))


@case("bin-tensor-past-its-storage", "bin", BIN, "of a storage of")
def _(ckpt, marker):
    rezip(ckpt / BIN, pickled=lambda data: patch_first_numel(data, lambda n: n // 2))


@case("bin-compressed-record", "bin", BIN, "compressed")
def _(ckpt, marker):
    rezip(ckpt / BIN, compress=True)


@case("bin-holds-safetensors", "bin", BIN, "holds safetensors data")
def _(ckpt, marker):
    save_file({"x": torch.arange(4.0)}, ckpt / BIN)


@case("bin-garbage", "bin", BIN, "not a torch.save file")
def _(ckpt, marker):
    (ckpt / BIN).write_bytes(b"GARBAGE!" * 64)


@case("bin-empty", "bin", BIN, "not a torch.save file")
def _(ckpt, marker):
    (ckpt / BIN).write_bytes(b"")


# ---------------------------------------------------------------- loose rank files


L0, L1 = "pytorch_model_rank0.bin", "pytorch_model_rank1.bin"


@case("loose-extra-rank-copied", "loose", "pytorch_model_rank2.bin", "a copy of another rank")
def _(ckpt, marker):
    shutil.copy(ckpt / L1, ckpt / "pytorch_model_rank2.bin")


@case("loose-missing-rank-0", "loose", L0, "missing")
def _(ckpt, marker):
    (ckpt / L0).unlink()


@case("loose-absurd-rank-number", "loose", "pytorch_model_rank999999999.bin")
def _(ckpt, marker):
    shutil.copy(ckpt / L1, ckpt / "pytorch_model_rank999999999.bin")


@case("loose-payload", "loose", L1, "posix.system")
def _(ckpt, marker):
    torch_edit(ckpt / L1, lambda sd: sd.__setitem__("evil", payload(marker)))


@case("loose-legacy-payload", "loose", L1, "pickles exec")
def _(ckpt, marker):
    torch_edit(
        ckpt / L1, lambda sd: sd.__setitem__("evil", payload(marker, "exec")), _use_new_zipfile_serialization=False
    )


@case("loose-rank-holds-safetensors", "loose", L1, "holds safetensors data")
def _(ckpt, marker):
    save_file({"x": torch.arange(4.0)}, ckpt / L1)


@case("loose-rank-truncated", "loose", L1, "truncated")
def _(ckpt, marker):
    truncate(ckpt / L1, 0.7)


@case("loose-pipeline-rank", "loose", "pytorch_model_pp_rank1.bin", "not a tensor-parallel rank")
def _(ckpt, marker):
    shutil.copy(ckpt / L1, ckpt / "pytorch_model_pp_rank1.bin")


# ---------------------------------------------------------------- megatron


ITER = "iter_0000100"


def mg(rank: int) -> str:
    return f"{ITER}/mp_rank_{rank:02d}/model_optim_rng.pt"


@case("megatron-payload", "megatron", mg(0), "posix.system")
def _(ckpt, marker):
    torch_edit(ckpt / mg(0), lambda obj: obj.__setitem__("evil", payload(marker)))


@case("megatron-missing-rank", "megatron", "mp_rank_03", "missing")
def _(ckpt, marker):
    shutil.rmtree(ckpt / ITER / "mp_rank_03")


@case("megatron-extra-rank", "megatron", ITER, "tensor_model_parallel_size=8")
def _(ckpt, marker):
    shutil.copytree(ckpt / ITER / "mp_rank_07", ckpt / ITER / "mp_rank_08")


@case("megatron-heads-zero", "megatron", mg(0), "args.num_attention_heads")
def _(ckpt, marker):
    torch_edit(ckpt / mg(0), lambda obj: setattr(obj["args"], "num_attention_heads", 0))


@case("megatron-hidden-word", "megatron", mg(0), "args.hidden_size")
def _(ckpt, marker):
    torch_edit(ckpt / mg(0), lambda obj: setattr(obj["args"], "hidden_size", "sixty-four"))


@case("megatron-rank-truncated", "megatron", mg(2), "truncated")
def _(ckpt, marker):
    truncate(ckpt / mg(2), 0.5)


@case("megatron-tracker-garbage", "megatron", "latest_checkpointed_iteration.txt", "not an iteration")
def _(ckpt, marker):
    (ckpt / "latest_checkpointed_iteration.txt").write_text("latest?")


@case("megatron-storage-overrun", "megatron", mg(1), "the record holds")
def _(ckpt, marker):
    rezip(ckpt / mg(1), pickled=lambda data: patch_first_numel(data, lambda n: n * 8))


# ---------------------------------------------------------------- sat


def sat(rank: int) -> str:
    return f"1/mp_rank_{rank:02d}_model_states.pt"


@case("sat-payload", "sat", sat(0), "posix.system")
def _(ckpt, marker):
    torch_edit(ckpt / sat(0), lambda obj: obj.__setitem__("evil", payload(marker)))


@case("sat-missing-rank", "sat", "mp_rank_05_model_states.pt", "missing")
def _(ckpt, marker):
    (ckpt / sat(5)).unlink()


@case("sat-extra-rank", "sat", "model_config.json", "model_parallel_size is 8")
def _(ckpt, marker):
    shutil.copy(ckpt / sat(7), ckpt / sat(8))


@case("sat-parallel-size-word", "sat", "model_config.json", "model_parallel_size")
def _(ckpt, marker):
    edit_json(ckpt / "model_config.json", lambda c: c.__setitem__("model_parallel_size", "eight"))


@case("sat-rank-truncated", "sat", sat(3), "truncated")
def _(ckpt, marker):
    truncate(ckpt / sat(3), 0.5)


@case("sat-latest-escapes", "sat", "latest", "does not name an iteration folder")
def _(ckpt, marker):
    (ckpt / "latest").write_text("../../etc")


@case("sat-config-not-json", "sat", "model_config.json", "cannot read the config")
def _(ckpt, marker):
    (ckpt / "model_config.json").write_text("{model_parallel_size: 8}")


@case("sat-rank-copied", "sat", "mp_rank_03_model_states.pt", "a copy of another rank")
def _(ckpt, marker):
    shutil.copy(ckpt / sat(2), ckpt / sat(3))
