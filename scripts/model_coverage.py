"""A verdict for every causal-LM and image-text-to-text model type the installed transformers ships.

For each model type: build the model of its default config on the meta device (as ``reshard check CONFIG``
does, once), then check it at tp 2, 4 and 8 with the built-in plan reshard picks and with ``--plan
transformers``; write the table to ``docs/model-coverage.md``. A verdict is *splits*, *cannot split* (and
why: the first error ``check`` reports) or *no plan*. Any exception that is not a ``ReshardError`` (a
traceback a user would see) is listed at the end, and the script exits 1.

    python scripts/model_coverage.py                      # every type, rewrite docs/model-coverage.md
    python scripts/model_coverage.py --types llama,gemma3 # a few, printed
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "model-coverage.md"
TPS = (2, 4, 8)


@dataclass
class Verdict:
    """One model type's row."""

    model_type: str
    model_class: str = "-"
    plan: str = "-"  # the built-in plan and how it was chosen
    builtin: dict[int, str] = field(default_factory=dict)
    transformers: dict[int, str] = field(default_factory=dict)
    tracebacks: list[str] = field(default_factory=list)


# Published quantized checkpoints' configs (their sizes and quantization_config; one layer, a small vocab: the
# rules are per layer), checked as `reshard check CONFIG` checks them, with the built-in plan.
_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
        }
    },
    "ignore": ["lm_head"],
}
_QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1024, "num_hidden_layers": 1}
QUANTIZED = {
    "Qwen3-30B-A3B-FP8": (
        {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_hidden_layers": 1,
            "vocab_size": 1024,
            "quantization_config": _FP8,
        }
    ),
    "DeepSeek-V3 (FP8)": (
        {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "first_k_dense_replace": 0,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "num_hidden_layers": 1,
            "vocab_size": 1024,
            "quantization_config": _FP8,
        }
    ),
    "Llama-3.1-8B-Instruct W4A16 (compressed-tensors)": (
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 1,
            "vocab_size": 1024,
            "quantization_config": _W4A16,
        }
    ),
    "Qwen2.5-0.5B-Instruct-GPTQ-Int4": _QWEN2
    | {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    },
    "Qwen2.5-72B-Instruct-AWQ": _QWEN2
    | {
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "quantization_config": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
        },
    },
}


def judge_quantized() -> dict[str, dict[int, str]]:
    """Each published quantized config's verdict at every tp, with the built-in plan."""
    from reshard.commands.check import CheckOptions, check_built, plan_for
    from reshard.config import ModelConfig
    from reshard.plans.skeleton import build_skeleton

    verdicts = {}
    for name, raw in QUANTIZED.items():
        config = ModelConfig(raw)
        skeleton = build_skeleton(config)
        plan = plan_for(config, skeleton, CheckOptions(tp=1))
        verdicts[name] = {tp: verdict_of(check_built(config, skeleton, CheckOptions(tp=tp), plan=plan)) for tp in TPS}
    return verdicts


def model_types() -> list[str]:
    """Every model type transformers maps to a causal-LM or an image-text-to-text class."""
    from transformers.models.auto import modeling_auto

    names = (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.keys()
        | modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.keys()
    )
    return sorted(names)


def verdict_of(report) -> str:
    """``splits``, ``no plan`` or ``cannot split: <the first error>``."""
    errors = [p.message for p in report.problems if p.severity == "error"]
    if any(m.startswith("no TP plan for") for m in errors):
        return "no plan"
    if not errors:
        return "splits"
    return "cannot split: " + errors[0]


def judge(model_type: str) -> Verdict:
    """Check one model type's default config at every tp, with both plans; never raises."""
    from transformers import CONFIG_MAPPING

    from reshard.commands.check import CheckOptions, check_built, plan_for
    from reshard.config import ModelConfig
    from reshard.errors import ReshardError
    from reshard.options import ReadOptions
    from reshard.plans import FAMILIES, TRANSFORMERS
    from reshard.plans.skeleton import build_skeleton

    verdict = Verdict(model_type)
    try:
        raw = CONFIG_MAPPING[model_type]().to_dict()
    except Exception as err:  # transformers' own defaults fail its validation: no config.json to check
        why = " ".join(str(err).split())[:200]
        reason = f"cannot check: transformers cannot make its default config ({type(err).__name__}: {why})"
        verdict.builtin = verdict.transformers = dict.fromkeys(TPS, reason)
        return verdict
    try:
        config = ModelConfig(raw)
        skeleton = build_skeleton(config)
    except ReshardError as err:
        reason = "cannot check: " + err.detail
        verdict.builtin = verdict.transformers = dict.fromkeys(TPS, reason)
        return verdict
    except Exception:
        verdict.tracebacks.append(traceback.format_exc())
        return verdict
    verdict.model_class = skeleton.model_class
    for plan_name, into in ((None, verdict.builtin), (TRANSFORMERS, verdict.transformers)):
        try:
            plan = plan_for(config, skeleton, CheckOptions(tp=1, read=ReadOptions(plan=plan_name)))
        except ReshardError as err:
            into.update(dict.fromkeys(TPS, "error: " + err.detail))
            continue
        except Exception:
            verdict.tracebacks.append(traceback.format_exc())
            continue
        if plan_name is None:
            by_type = any(model_type in f.model_types for f in FAMILIES)
            verdict.plan = plan.name if plan.rules else "-"
            verdict.plan += " (by names)" if plan.rules and not by_type else ""
        for tp in TPS:
            try:
                options = CheckOptions(tp=tp, read=ReadOptions(plan=plan_name))
                report = check_built(config, skeleton, options, plan=plan)
            except ReshardError as err:
                into[tp] = "error: " + err.detail
            except Exception:
                verdict.tracebacks.append(traceback.format_exc())
                into[tp] = "TRACEBACK"
            else:
                into[tp] = verdict_of(report)
    return verdict


def _cell(text: str, reasons: dict[str, int]) -> str:
    """A short verdict; a reason is numbered once and listed under the table."""
    verdict, _, why = text.partition(": ")
    if not why:
        return verdict
    number = reasons.setdefault(why, len(reasons) + 1)
    return f"{verdict} [{number}](#r{number})"


def render(verdicts: list[Verdict], seconds: float) -> str:
    import transformers

    splits = sum(all(v.builtin.get(tp) == "splits" for tp in TPS) for v in verdicts)
    some = sum(any(v.builtin.get(tp) == "splits" for tp in TPS) for v in verdicts) - splits
    no_plan = sum(v.builtin.get(2) == "no plan" for v in verdicts)
    unbuilt = sum(v.builtin.get(2, "").startswith("cannot check") for v in verdicts)
    lines = [
        "# Model coverage",
        "",
        f"Written by `scripts/model_coverage.py` for transformers {transformers.__version__}: every model type it "
        "maps to a causal-LM or an image-text-to-text class, its default config built on the meta device, "
        "checked at tp 2, 4 and 8 with the built-in plan reshard picks (by `model_type`, or *by names* when a "
        "family's tensor names match) and with `--plan transformers`. *splits*: no error; *cannot split*: the "
        "first error `reshard check` reports (numbered below); *no plan*: nothing says how to split it; *cannot "
        "check*: transformers cannot build its own default config. Default configs are the sizes transformers "
        "documents, usually a published checkpoint's.",
        "",
        f"{len(verdicts)} model types: {splits} split at tp 2, 4 and 8 with a built-in plan, {some} at some of "
        f"them; {no_plan} have no built-in plan; transformers cannot build {unbuilt} from their default config. "
        f"Checked in {seconds:.0f} s.",
        "",
        "| model type | class | built-in plan | tp 2 | tp 4 | tp 8 | transformers plan: tp 2 | tp 4 | tp 8 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    reasons: dict[str, int] = {}
    for v in verdicts:
        cells = [v.model_type, v.model_class, v.plan]
        cells += [_cell(v.builtin.get(tp, "-"), reasons) for tp in TPS]
        cells += [_cell(v.transformers.get(tp, "-"), reasons) for tp in TPS]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += [
        "",
        "## Quantized variants",
        "",
        "Published quantized checkpoints' configs (sizes and `quantization_config`, one layer), checked as "
        "`reshard check CONFIG` checks them: each quantized layer's scales, zeros and packed weights cut with its "
        "weight, refused where a block or group would be cut, as the runtimes refuse ([quantization.md]"
        "(quantization.md)).",
        "",
        "| checkpoint | tp 2 | tp 4 | tp 8 |",
        "|---|---|---|---|",
    ]
    for name, cells in judge_quantized().items():
        row = [name, *(_cell(cells[tp], reasons) for tp in TPS)]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    lines += ["", "## Reasons", ""]
    lines += [f'{n}. <a id="r{n}"></a>' + why.replace("|", "\\|") for why, n in reasons.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: all); prints instead of writing")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    types = args.types.split(",") if args.types else model_types()
    verdicts = [judge(t) for t in types]
    text = render(verdicts, time.perf_counter() - start)
    if args.types:
        print(text)
    else:
        args.output.write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    tracebacks = [(v.model_type, tb) for v in verdicts for tb in v.tracebacks]
    for model_type, tb in tracebacks:
        print(f"--- {model_type}\n{tb}", file=sys.stderr)
    return 1 if tracebacks else 0


if __name__ == "__main__":
    sys.exit(main())
