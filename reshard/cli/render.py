"""Text renderings of the command reports, for people (``--json`` prints the reports themselves)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reshard.cli.output import shape_list, table
from reshard.errors import shown
from reshard.ranks import listed
from reshard.sizes import human_bytes

SHOWN_NAMES = 3  # parameter names shown per group (--json lists them all)

if TYPE_CHECKING:
    from reshard.commands.check import CheckReport
    from reshard.commands.convert import ConvertReport
    from reshard.commands.fix import FixReport
    from reshard.commands.inspect import InspectReport
    from reshard.commands.verify import VerifyResult


def render_inspect(report: InspectReport) -> str:
    vocab = report.vocab
    lines = [
        f"checkpoint  {report.path}",
        f"layout      {report.layout}, tp={report.tp}, {len(report.files)} file(s)",
        f"config      {report.config or 'none found'}"
        + (f" (model_type {report.model_type})" if report.model_type else ""),
        f"plan        {report.plan}",
        *([_hub_line(report.hub)] if report.hub else []),
        f"vocab       {vocab['original'] or 'unknown'} (from {vocab['origin']})"
        + (
            f", {vocab['padded_in_source']} rows in the source ({vocab['padding_rows']} padding)"
            if vocab["padded_in_source"] is not None and vocab["padding_rows"]
            else ""
        ),
    ]
    if report.mapping:
        lines.append(f"names       {report.mapping} under --layout hf (the 'hf name' column)")
    if report.training:
        lines += _training_lines(report.training)
    stored = any(t.stored for t in report.tensors)
    lines.append("")
    rows = [
        [
            t.name,
            shape_list(t.rank_shapes),
            t.dtype,
            human_bytes(t.bytes),
            (t.partition or {}).get("kind", "-") + _partition_args(t.partition),
            t.problem or t.reason,
        ]
        + ([", ".join(t.targets or ["(dropped)"])] if report.mapping else [])
        + ([t.stored or "-"] if stored else [])
        for t in report.tensors
    ]
    header = ["tensor", "rank shapes", "dtype", "bytes", "partition", "why"] + (["hf name"] if report.mapping else [])
    header += ["stored as"] if stored else []
    lines.append(table(rows, header))
    lines += [f"note: {n}" for n in report.notes] + [f"not a tensor: {e}" for e in report.extras]
    if report.problems:
        lines.append(f"{len(report.problems)} tensor(s) cannot be gathered as they are")
    return "\n".join(lines)


def _training_lines(training: dict[str, Any]) -> list[str]:
    """The optimizer, step and moments, each group's parameters and hyper-parameters, the frozen parameters, what is
    not carried and why the state is not read, where it is not."""
    moments = ", ".join(training["moments"]) or "none"
    step = training["step"] if training["step"] is not None else "not recorded"
    lines = [f"training    {training['optimizer'] or 'optimizer not named'}, step {step}, moments {moments}"]
    carried = training["carried_as"]
    if carried != training["optimizer"]:
        said = carried if carried.startswith("not carried") else f"carried as {carried}'s state"
        lines.append(f"{'':12}--with-optimizer: {said}")
    for index, group in enumerate(training["groups"]):
        names = group["params"]
        lines.append(f"group {index:<6}{len(names)} parameters: {listed(names[:SHOWN_NAMES], len(names))}")
        hyper = ", ".join(f"{k}={shown(v)}" for k, v in group["hyper"].items()) or "hyper-parameters not recorded"
        lines.append(f"{'':12}{hyper}")
    if training["frozen"]:
        frozen = training["frozen"]
        lines.append(f"frozen      {listed(frozen[:SHOWN_NAMES], len(frozen))} (no moments)")
    if training["not_carried"]:
        lines.append(f"not carried {', '.join(training['not_carried'])}")
    if training.get("unread"):
        lines.append(f"not read    {training['unread']}")
    return lines


def _hub_line(hub: dict[str, Any]) -> str:
    """Where a Hub checkpoint was read, and what reading its headers took."""
    asked = f" ({hub['revision']})" if hub.get("revision") else ""
    line = f"hub         {hub['repo']} at {hub['commit']}{asked}"
    if "bytes_transferred" in hub:
        line += f": headers only, {human_bytes(hub['bytes_transferred'])} in {hub['requests']} requests"
    return line


def _partition_args(partition: dict[str, Any] | None) -> str:
    args = {k: v for k, v in (partition or {}).items() if k != "kind"}
    return "(" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")" if args else ""


def render_convert(report: ConvertReport) -> str:
    if report.already_complete:
        return (
            f"{report.output} is already complete ({report.layout}, tp={report.tp}, from {report.source}): its "
            "reshard.json matches this conversion; nothing was rewritten"
        )
    vocab = report.vocab
    lines = [
        f"{report.source} ({report.source_layout}, tp={report.source_tp}) -> {report.output} "
        f"({report.layout}, tp={report.tp})",
        f"{report.tensors} tensors, {human_bytes(report.bytes)} canonical",
        *_mapping_line(report.mapping),
        f"vocab {vocab['original']} (from {vocab['origin']}): {vocab['source_padded']} rows in the source, "
        f"{vocab['target_padded']} per the target"
        if vocab["source_padded"] is not None
        else "no vocab tensors",
    ]
    lines += [f"  {c['tensor']}: {c['old']} -> {c['new']}" for c in report.changed]
    lines += [f"note: {n}" for n in report.notes]
    lines.append(f"manifest {report.manifest}")
    return "\n".join(lines)


def _mapping_line(mapping: dict[str, Any] | None) -> list[str]:
    if not mapping:
        return []
    dropped = f", {mapping['dropped']} dropped" if mapping["dropped"] else ""
    counts = f"{mapping['sources']} tensors became {mapping['targets']}{dropped}"
    return [f"names {mapping['from']} -> {mapping['to']}: {counts}"]


def render_fix(report: FixReport) -> str:
    vocab = report.vocab
    if not report.written:
        return (
            f"{report.source} ({report.source_layout}, tp={report.source_tp}): nothing to fix: no tensor changes "
            f"shape and the vocab is already {vocab['original']} (from {vocab['origin']}); nothing written "
            "(--force writes a copy anyway)"
        )
    lines = [
        f"{report.source} ({report.source_layout}, tp={report.source_tp}) -> {report.output} "
        f"({report.layout}, tp={report.tp})",
        f"vocab {vocab['original']} (from {vocab['origin']}): {vocab['source_padded']} rows in the source, "
        f"{vocab['target_padded']} written"
        if vocab["source_padded"] is not None
        else "no vocab tensors",
    ]
    others = [c for c in report.changed if not c["vocab"]]
    lines += [
        f"  {c['tensor']}: {shape_list(c['old'])} -> {shape_list(c['new'])}" for c in report.changed if c["vocab"]
    ]
    if others:
        verb = "gathered" if report.tp == 1 else "re-sliced"
        lines.append(f"  {len(others)} other tensor(s) {verb} from tp={report.source_tp} to tp={report.tp}")
    if not report.changed:
        lines.append("  no tensor changed shape")
    if report.config_vocab:
        lines.append(f"config.json vocab_size {report.config_vocab[0]} -> {report.config_vocab[1]}")
    lines += [f"note: {n}" for n in report.notes]
    lines.append(f"manifest {report.manifest}")
    return "\n".join(lines)


def render_check(report: CheckReport) -> str:
    lines = [
        f"{report.input}  {report.source}" + (f" (model_type {report.model_type})" if report.model_type else ""),
        *([f"model       {report.model_class} (built on the meta device)"] if report.model_class else []),
        f"plan        {report.plan}, tp={report.tp}" + (", uneven" if report.uneven else ""),
        "",
    ]
    rows = [
        [
            t.name,
            str(t.shape),
            t.rule if t.rule is not None else "-",
            (t.partition or {}).get("kind", "-") + _partition_args(t.partition),
            str(t.rank_shape) if t.rank_shape is not None else "-",
            "; ".join(t.problems),
        ]
        for t in report.tensors
    ]
    lines.append(table(rows, ["tensor", "shape", "rule", "partition", "per rank", "problem"]))
    for problem in report.problems:
        names = problem.tensors
        where = f" ({names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "") + ")" if names else ""
        lines.append(f"{problem.severity}: {problem.message}{where}")
    works = report.tp_sizes_that_work
    also = f" (tp sizes that work: {', '.join(map(str, works))})" if works else ""
    lines.append(f"splits {report.tp} ways" if report.ok else f"cannot be split {report.tp} ways{also}")
    return "\n".join(lines)


def render_verify(result: VerifyResult) -> str:
    """The text the CLI prints and ``reshard.testing`` raises: one line per check, a table of differences."""
    lines = []
    for report in result.reports:
        status = "ok" if report.ok else f"{len(report.differences)} difference(s)"
        lines.append(f"{report.title}: {status} ({report.tensors} tensors checked)")
    rows = [[r.title, d.tensor or "-", d.kind, d.detail, d.file or "-"] for r in result.reports for d in r.differences]
    if rows:
        lines += ["", table(rows, ["check", "tensor", "kind", "detail", "file"])]
    lines.append(f"{result.checkpoint}: {'OK' if result.ok else 'DIFFERENCES FOUND'}")
    return "\n".join(lines)
