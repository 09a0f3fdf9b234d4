"""A Megatron checkpoint converted to ``--layout hf`` carries the tokenizer its args name and runs in vLLM's CPU build
(its own venv, :mod:`fixtures.vllm`): vLLM's greedy tokens are transformers' on the same prompt."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from fixtures.megatron import Sizes, full_model, megatron_args, write_megatron
from fixtures.sentencepiece import sentencepiece_python, train_sentencepiece
from fixtures.tokenizer import tiny_tokenizer, tiny_tokenizer_size
from fixtures.vllm import VLLM_ENV, vllm_python

pytestmark = pytest.mark.oracle

PROMPT = "the red cat runs over the river and"
STEPS = 12
# vLLM's CPU attention takes head_dim 32 or more; the vocab is the tokenizer's, padded by Megatron to 4 * tp.
SIZES = Sizes(hidden=64, heads=2, groups=1, head_dim=32, ffn=128, layers=2, vocab=tiny_tokenizer_size(), multiple=4)

VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":  # vLLM may spawn processes
    llm = LLM(model=sys.argv[1], dtype="float32", distributed_executor_backend="uni", max_model_len=64,
              enforce_eager=True, seed=0, gpu_memory_utilization=0.05)
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
    out = llm.generate([sys.argv[2]], params, use_tqdm=False)[0]
    print("RESULT " + json.dumps({"prompt": out.prompt_token_ids, "tokens": list(out.outputs[0].token_ids)}))
"""


def test_megatron_to_hf_carries_its_tokenizer_and_vllm_gives_transformers_greedy_tokens(
    cli, pytestconfig: pytest.Config, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    python = vllm_python(pytestconfig)
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer")
    args = megatron_args(SIZES, 2, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer))
    src = write_megatron(tmp_path / "megatron", full_model(SIZES, seed=0), 2, sizes=SIZES, args=args)
    out = tmp_path / "hf"
    result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["vocab"]["original"] == SIZES.vocab and any("carries the tokenizer" in n for n in report["notes"])
    assert (out / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}

    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = AutoTokenizer.from_pretrained(out)(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = model.eval().generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    expected = expected[0, ids.shape[1] :].tolist()

    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = {**os.environ, **VLLM_ENV, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [str(python), str(script), str(out), PROMPT, str(STEPS)], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["prompt"] == ids[0].tolist()
    assert got["tokens"] == expected and len(set(expected)) > 1


def test_a_llama2_sentencepiece_tokenizer_carried_from_megatron_runs_in_vllm(
    cli, pytestconfig: pytest.Config, tmp_path: Path
) -> None:
    """Megatron's Llama2Tokenizer (a sentencepiece model) made into the output's tokenizer: vLLM loads it, its prompt
    ids are Megatron's (bos, then sentencepiece's encode) and its greedy tokens transformers'."""
    from transformers import AutoModelForCausalLM

    sp_python = sentencepiece_python(pytestconfig)
    assert train_sentencepiece(sp_python, tmp_path)["bpe"] == 300
    model_file = tmp_path / "bpe.model"
    encode = "import sentencepiece as s, sys; p = s.SentencePieceProcessor(model_file=sys.argv[1]); "
    encode += "print([p.bos_id()] + p.encode(sys.argv[2]))"
    ids = subprocess.run([str(sp_python), "-c", encode, str(model_file), PROMPT], capture_output=True, text=True)
    megatron_ids = json.loads(ids.stdout)
    sizes = Sizes(hidden=64, heads=2, groups=1, head_dim=32, ffn=128, layers=2, vocab=300, multiple=4)
    args = megatron_args(sizes, 2, tokenizer_type="Llama2Tokenizer", tokenizer_model=str(model_file))
    src = write_megatron(tmp_path / "megatron", full_model(sizes, seed=0), 2, sizes=sizes, args=args)
    out = tmp_path / "hf"
    result = cli("convert", src, "--tp", 1, "--layout", "hf", "-o", out)
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        prompt = torch.tensor([megatron_ids])
        expected = model.eval().generate(prompt, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)
    expected = expected[0, len(megatron_ids) :].tolist()
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = {**os.environ, **VLLM_ENV, "HF_HUB_OFFLINE": "1"}
    python = vllm_python(pytestconfig)
    run = subprocess.run(
        [str(python), str(script), str(out), PROMPT, str(STEPS)], capture_output=True, text=True, env=env, timeout=600
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert got["prompt"] == megatron_ids and megatron_ids[0] == 1
    assert got["tokens"] == expected and len(set(expected)) > 1
