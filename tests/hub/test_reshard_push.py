"""``--push-to-hub`` through the real huggingface_hub client to the local Hub, read back by the real ``hf`` CLI
and transformers: what reshard publishes is what the ecosystem loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.models import logits, tiny_llama
from fixtures.tp import padded_rows
from fixtures.trainer import write_rank_files
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file

V = 1001


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama (vocab 1001) saved by transformers, and its tp=2 rank files as a trainer writes them: vocab
    rows padded to 1024 with junk, config.json saying the padded size."""
    root = tmp_path_factory.mktemp("model")
    model = tiny_llama(root / "full", vocab=V)
    config = json.loads((root / "full" / "config.json").read_text()) | {"vocab_size": padded_rows(V, 64 * 2)}
    _write_ranks(root / "full", root / "padded", 2, name="model-rank-{r}.safetensors", config=config)
    return model, root


def _hf(*args: str) -> subprocess.CompletedProcess:
    hf = Path(sys.executable).with_name("hf")
    return subprocess.run([str(hf), *args], capture_output=True, text=True, timeout=120, check=False)


def test_fix_a_repo_and_push_it_then_hf_download_and_from_pretrained_give_the_padded_models_logits(
    hub, model, tmp_path, cli
):
    """Issue 15's target, end to end through the real clients."""
    from transformers import LlamaForCausalLM

    original, root = model
    source = hub.publish("acme/padded", root / "padded")
    args = ["fix", "acme/padded", "--vocab", V, "-o", tmp_path / "out", "--push-to-hub", "acme/fixed", "--json"]

    done = cli(*args)
    got = _hf("download", "acme/fixed", "--local-dir", str(tmp_path / "got"))

    assert done.exit_code == 0, done.stderr
    assert got.returncode == 0, got.stderr
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "got").eval()
    assert loaded.config.vocab_size == V
    assert torch.equal(logits(loaded, V), logits(original, V))
    push = json.loads(done.stdout)["push"]
    assert push["repo"] == "acme/fixed" and push["commit"] == HfApi().model_info("acme/fixed").sha
    card = ModelCard.load("acme/fixed")
    assert (card.data.base_model, card.data.base_model_relation) == ("acme/padded", "finetune")
    assert (card.data.library_name, card.data.tags) == ("transformers", ["reshard"])
    assert f"[`acme/padded`](/acme/padded) at commit `{source}`" in card.text
    assert "The source held 1024 rows (23 of padding), cut to 1001." in card.text
    assert "Its config.json said 1024; this one says 1001." in card.text
    assert (
        "`model.embed_tokens.weight` 2 x [512, 64] -> [1001, 64]; 14 other tensor(s) re-sliced from tp=2 to tp=1"
        in card.text
    )
    assert f"reshard fix acme/padded --vocab 1001 -o {tmp_path / 'out'} --push-to-hub acme/fixed --json" in card.text
    assert (tmp_path / "got" / "README.md").read_text() == (tmp_path / "out" / "README.md").read_text()
    manifest = json.loads((tmp_path / "got" / "reshard.json").read_text())
    assert (manifest["source"]["repo"], manifest["source"]["commit"]) == ("acme/padded", source)


def test_push_options_private_branch_pull_request_message_and_stale_files(hub, model, tmp_path, cli):
    _, root = model
    full = root / "full"
    api = HfApi()

    sliced = cli("convert", full, "--tp", 2, "-o", tmp_path / "tp2", "--push-to-hub", "acme/sliced", "--private",
                 "--commit-message", "tp=2 slices")  # fmt: skip
    main = api.model_info("acme/sliced")
    branch = cli("convert", full, "--tp", 1, "-o", tmp_path / "tp1", "--push-to-hub", "acme/sliced",
                 "--revision", "dev")  # fmt: skip
    pr = cli("convert", full, "--tp", 1, "-o", tmp_path / "pr", "--push-to-hub", "acme/sliced",
             "--create-pr", "--json")  # fmt: skip

    assert sliced.exit_code == 0 and branch.exit_code == 0 and pr.exit_code == 0, (sliced.stderr, branch.stderr)
    assert main.private and hub.store.get("acme/sliced").commit_info(main.sha)["title"] == "tp=2 slices"
    on_main = set(api.list_repo_files("acme/sliced"))
    assert {"rank_00/model.safetensors", "rank_01/model.safetensors", "reshard.json", "README.md"} <= on_main
    on_dev = set(api.list_repo_files("acme/sliced", revision="dev"))
    assert "model.safetensors" in on_dev and not any(f.startswith("rank_") for f in on_dev)  # stale ranks deleted
    assert api.model_info("acme/sliced").sha == main.sha  # neither the branch nor the pull request moved main
    assert json.loads(pr.stdout)["push"]["pull_request"].endswith("/discussions/1")
    assert "model.safetensors" in api.list_repo_files("acme/sliced", revision="refs/pr/1")
    card = ModelCard.load("acme/sliced")  # main: a local source, so no base model
    assert (card.data.base_model, card.data.library_name) == (None, None)
    assert card.data.tags == ["reshard", "tensor-parallel"]
    assert "a local checkpoint (`full`)" in card.text
    assert f"pushed to {hub.endpoint}/acme/sliced (commit" in branch.stdout.splitlines()[-1]
    hub.publish("acme/public", {"config.json": b"{}"})
    public = cli("convert", full, "--tp", 1, "-o", tmp_path / "pub", "--push-to-hub", "acme/public", "--private")
    assert (
        public.exit_code == 0 and not api.model_info("acme/public").private
    )  # as `hf upload`: not for a repo that exists


def _error(done) -> str:
    assert done.exit_code == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_a_push_that_cannot_succeed_is_refused_before_any_work(model, hub, tmp_path, cli, monkeypatch):
    _, root = model

    bad_id = cli("convert", root / "full", "--tp", 1, "-o", tmp_path / "a", "--push-to-hub", "acme//x")
    alone = cli("convert", root / "full", "--tp", 1, "-o", tmp_path / "b", "--private")
    pr_to = cli("convert", root / "full", "--tp", 1, "-o", tmp_path / "d", "--push-to-hub", "acme/x",
                "--create-pr", "--revision", "dev")  # fmt: skip
    monkeypatch.delenv("HF_TOKEN")
    no_token = cli("fix", root / "padded", "--vocab", V, "-o", tmp_path / "c", "--push-to-hub", "acme/x")

    assert "acme//x: not a repo id" in _error(bad_id)
    assert "--private, --revision, --create-pr and --commit-message go with --push-to-hub" in alone.stderr
    assert alone.exit_code == 2
    assert "--push-to-hub needs a Hugging Face token (set HF_TOKEN or run `hf auth login`)" in _error(no_token)
    assert "acme/x: --create-pr opens a pull request against the default branch" in _error(pr_to)
    assert not any((tmp_path / name).exists() for name in "abcd")
    assert not hub.requests


def test_a_refused_push_leaves_the_output_complete_and_says_how_to_publish_it(model, hub, tmp_path, cli):
    _, root = model
    out = tmp_path / "out"

    foreign = cli("convert", root / "full", "--tp", 1, "-o", out, "--push-to-hub", "someone-else/model")
    hub.fail_next("POST", "/commit/")
    failed = cli("convert", root / "full", "--tp", 1, "-o", tmp_path / "again", "--push-to-hub", "acme/model")
    upload = _hf("upload", "acme/model", str(tmp_path / "again"))

    line = _error(foreign)
    assert "someone-else/model: not allowed (403)" in line
    assert f"the output is complete in {out}; `hf upload someone-else/model {out}` publishes it" in line
    assert (out / "reshard.json").is_file() and (out / "model.safetensors").is_file()
    assert f"`hf upload acme/model {tmp_path / 'again'}` publishes it" in _error(failed)
    assert upload.returncode == 0, upload.stderr
    assert {"model.safetensors", "README.md", "reshard.json"} <= set(HfApi().list_repo_files("acme/model"))


def _write_ranks(model_dir: Path, out: Path, tp: int, *, name: str = "pytorch_model_rank{r}.bin", config=None) -> Path:
    """The saved model in ``model_dir`` as a TP trainer's padded rank files in ``out``."""
    config = config or json.loads((model_dir / "config.json").read_text())
    return write_rank_files(out, load_file(model_dir / "model.safetensors"), config, tp, name=name)
