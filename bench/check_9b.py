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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tensor names of the tests' builders

from fixtures.shapes import qwen3_5_shapes  # noqa: E402

from reshard.commands.check import CheckOptions, check  # noqa: E402
from reshard.formats.readers import TensorHeader  # noqa: E402
from reshard.formats.safetensors.writer import header_bytes  # noqa: E402
from reshard.options import ReadOptions  # noqa: E402

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


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    headers = {n: TensorHeader(s, "BF16") for n, s in qwen3_5_shapes(CONFIG).items()}
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
    report = check(folder, CheckOptions(tp=4, read=ReadOptions(plan=plan)))
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
