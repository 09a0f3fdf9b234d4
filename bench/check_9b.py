"""Time ``reshard check`` on the headers of a Qwen3.5-9B-sized checkpoint (no tensor data on disk).

Writes a sparse ``model.safetensors`` whose header is the real one for Qwen3.5-9B's text model
(hidden 4096, 32 layers, every fourth full attention, vocab 248320, bf16: about 18 GB of declared
data) with ``header_bytes`` and ``truncate``, plus its ``config.json``, then runs ``check`` at tp 4
with the built-in plan and with ``--plan transformers``.

    .venv/bin/python bench/check_9b.py
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reshard.commands.check import CheckOptions, check
from reshard.io.safetensors_writer import header_bytes
from reshard.layouts.readers import TensorHeader

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(32)],
    "tie_word_embeddings": False,
}


def shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, key_dim, value_dim = c["hidden_size"], 16 * 128, 32 * 128
    out = {"model.embed_tokens.weight": (c["vocab_size"], h), "lm_head.weight": (c["vocab_size"], h)}
    out["model.norm.weight"] = (h,)
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            a = p + "linear_attn."
            out |= {
                a + "in_proj_qkv.weight": (2 * key_dim + value_dim, h),
                a + "in_proj_z.weight": (value_dim, h),
                a + "in_proj_b.weight": (32, h),
                a + "in_proj_a.weight": (32, h),
                a + "conv1d.weight": (2 * key_dim + value_dim, 1, 4),
                a + "A_log": (32,),
                a + "dt_bias": (32,),
                a + "norm.weight": (128,),
                a + "out_proj.weight": (h, value_dim),
            }
        else:
            a = p + "self_attn."
            out |= {
                a + "q_proj.weight": (2 * 16 * 256, h),
                a + "k_proj.weight": (4 * 256, h),
                a + "v_proj.weight": (4 * 256, h),
                a + "o_proj.weight": (h, 16 * 256),
                a + "q_norm.weight": (256,),
                a + "k_norm.weight": (256,),
            }
        out |= {
            p + "mlp.gate_proj.weight": (c["intermediate_size"], h),
            p + "mlp.up_proj.weight": (c["intermediate_size"], h),
            p + "mlp.down_proj.weight": (h, c["intermediate_size"]),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    return out


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    headers = {n: TensorHeader(s, "BF16") for n, s in shapes(CONFIG).items()}
    header = header_bytes(headers, {"format": "pt"})
    data = sum(h.nbytes for h in headers.values())
    with open(folder / "model.safetensors", "wb") as f:
        f.write(header)
        f.truncate(len(header) + data)
    assert struct.unpack("<Q", header[:8])[0] == len(header) - 8
    (folder / "config.json").write_text(json.dumps(CONFIG))
    print(f"{len(headers)} tensors, {data / 1e9:.1f} GB declared (sparse file)")
    try:
        for label, plan in (("built-in plan", None), ("--plan transformers", "transformers")):
            best = min(_timed(folder, plan) for _ in range(3))
            print(f"check --tp 4, {label}: {best * 1000:.0f} ms in the library (best of 3)")
            best = min(_timed_command(folder, plan) for _ in range(3))
            print(f"check --tp 4, {label}: {best * 1000:.0f} ms for the command, start to exit (best of 3)")
    finally:
        shutil.rmtree(folder)


def _timed(folder: Path, plan: str | None) -> float:
    start = time.perf_counter()
    report = check(folder, CheckOptions(tp=4, plan=plan))
    elapsed = time.perf_counter() - start
    assert len(report.tensors) > 400
    return elapsed


def _timed_command(folder: Path, plan: str | None) -> float:
    """Wall time of ``reshard check`` as a user runs it: a new process, imports included."""
    command = [str(Path(sys.executable).with_name("reshard")), "check", str(folder), "--tp", "4", "--json"]
    start = time.perf_counter()
    done = subprocess.run(command + (["--plan", plan] if plan else []), capture_output=True, check=False)
    elapsed = time.perf_counter() - start
    assert done.returncode in (0, 1) and b'"tensors"' in done.stdout, done.stderr.decode()
    return elapsed


if __name__ == "__main__":
    main()
