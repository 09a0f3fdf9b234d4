"""The ``deepspeed`` layout: DeepSpeed ZeRO checkpoints as ``engine.save_checkpoint`` writes them (HF Trainer,
LLaMA-Factory, TRL, OpenRLHF), read without DeepSpeed and opened without torch (the pickles are read structurally,
:mod:`reshard.layouts.deepspeed.pickles`).

::

    <root>/latest                                               the tag folder's name (``global_step{N}``)
    <root>/<tag>/mp_rank_00_model_states.pt                     ZeRO-0/1/2: ``module`` (training dtype), shapes
    <root>/<tag>/zero_pp_rank_{dp}_mp_rank_00_model_states.pt   ZeRO-3: one per data-parallel rank, ``module`` empty
    <root>/<tag>/[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt   each rank's piece of the fp32 master

The model is the fp32 master weights, rebuilt from the optimizer files as DeepSpeed's ``zero_to_fp32`` does
(:mod:`reshard.layouts.deepspeed.zero`), each parameter read as byte ranges of the partitions
(:mod:`reshard.layouts.deepspeed.pieces`); frozen parameters and buffers come from the model states, tied
weights from ``shared_params``. ``--weights module`` takes the training-dtype ``module`` copy instead (ZeRO-0/1/2).
"pp_rank" in these names is the DATA-parallel rank; a tensor-parallel ``mp_rank`` other than 00
(Megatron-DeepSpeed) is refused by name.
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from reshard.config import find_config
from reshard.dtypes import TensorHeader, code_from_name
from reshard.errors import CorruptFileError, MissingRankError, ReshardError
from reshard.formats.torch_zip.structure import TensorRecord, read_structure
from reshard.layouts.base import SourceCheckpoint, TensorRef
from reshard.layouts.deepspeed.pickles import Pickled
from reshard.layouts.deepspeed.pickles import read as read_pickled
from reshard.layouts.deepspeed.pieces import Piece, PiecesReader
from reshard.layouts.deepspeed.training import native_state, universal_state
from reshard.layouts.deepspeed.zero import Flat, Segment, zero2_pieces, zero3_pieces
from reshard.layouts.optimizers import STATE_SLOTS
from reshard.layouts.training import TrainingState, split_state_name, state_name
from reshard.options import MAX_RANKS, ReadOptions
from reshard.ranks import listed

NAME = "deepspeed"
# The per-parameter state read beside the masters: every slot of an optimizer reshard carries (Adam's moments, SGD's
# momentum, ...); any other key is named by the training state and refused by the planner.
MOMENTS = STATE_SLOTS
LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # ds_to_universal's, beside latest
UNIVERSAL = "zero"  # a universal checkpoint's folder of per-parameter files
SAT_CONFIG = "model_config.json"  # SwissArmyTransformer saves through DeepSpeed too: such a folder stays ``sat``
MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Files of DeepSpeed features reshard does not rebuild, refused by name.
PIPELINE_FILE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
EXPERT_FILE = re.compile(r"^(?:layer_\d+_expert_\d+_mp_rank_\d+_model|expp_rank_\d+_mp_rank_\d+_optim)_states\.pt$")
REQUIRED = ("module", "param_shapes", "buffer_names", "ds_version")
MAX_PICKLE = 64 << 20  # a model-states data.pkl: names and shapes, far below this
WEIGHTS = ("master", "module")  # the copies --weights chooses from
WIDENED = ("F16", "BF16")  # 16-bit floats read as float32 beside the fp32 masters
SHOWN_TAGS = 8  # tag folders named in the refusal of a root with several


def detect(path: Path) -> bool:
    """A DeepSpeed root (``latest`` naming a tag folder) or tag folder: ZeRO-3 model-states files, or a
    model-states file whose pickle records ``ds_version`` and ``param_shapes``; not under SAT's
    ``model_config.json``."""
    if not path.is_dir() or (path / SAT_CONFIG).is_file() or (path.parent / SAT_CONFIG).is_file():
        return False
    try:
        return tag_folder(path) is not None
    except SeveralTagsError:  # a DeepSpeed root all the same: opening it says which tags it holds
        return True
    except (OSError, ReshardError):
        return False


class SeveralTagsError(ReshardError):
    """A root with several tag folders and no ``latest`` naming one of them."""


def _is_tag_folder(folder: Path) -> bool:
    """ZeRO-3 model-states files, a rank-0 model-states file that DeepSpeed pickled, or ZeRO optimizer files with no
    model-states file (refused then, naming it). An optimizer file beside rank files of a plain state dict is not
    enough: such a folder is read as loose rank files."""
    names = [child.name for child in folder.iterdir()]
    if any(ZERO3_MODEL_STATES.match(n) for n in names):
        return True
    states = sorted(n for n in names if MODEL_STATES.match(n))
    if not states:
        return any(OPTIM_STATES.match(n) for n in names)
    return _pickles_deepspeed_keys(folder / states[0])


def _pickles_deepspeed_keys(file: Path) -> bool:
    """Whether the top-level dict of a torch archive names ``ds_version`` and ``param_shapes`` (its ``data.pkl``
    only is read, by the structure-only unpickler)."""
    try:
        with zipfile.ZipFile(file) as archive:
            pickled = next((i for i in archive.infolist() if i.filename.endswith("/data.pkl")), None)
            if pickled is None or pickled.file_size > MAX_PICKLE:
                return False
            obj = read_structure(archive.read(pickled))
    except Exception:  # noqa: BLE001 - any unreadable file is simply not DeepSpeed's
        return False
    return isinstance(obj, Mapping) and "ds_version" in obj and "param_shapes" in obj


def tag_folder(path: Path) -> Path | None:
    """The tag folder to read for ``path``: itself, the one ``latest`` names (else ``latest_universal``: the
    folder ``ds_to_universal`` wrote), or the only one inside; several inside and none named are refused, naming
    them (DeepSpeed's own ``zero_to_fp32`` then needs the tag too)."""
    if _is_tag_folder(path):
        return path
    for name in (LATEST, LATEST_UNIVERSAL):
        tracker = path / name
        if tracker.is_file():
            with tracker.open("rb") as handle:  # a tag is a short name; never read a damaged tracker whole
                tag = handle.read(4096).decode("utf-8", "replace").strip()
            if not tag or "/" in tag or "\\" in tag or tag in (".", ".."):
                raise CorruptFileError(f"does not name a checkpoint folder: {tag!r}", path=tracker)
            folder = path / tag
            if folder.is_dir() and _is_tag_folder(folder):
                return folder
    tags = sorted((c for c in path.iterdir() if c.is_dir() and _is_tag_folder(c)), key=_natural)
    if len(tags) > 1:
        latest = path / LATEST
        why = f"{latest.name!r} names none of them" if latest.is_file() else f"no {LATEST!r} file names one"
        names = listed([t.name for t in tags[:SHOWN_TAGS]], len(tags))
        raise SeveralTagsError(
            f"holds {len(tags)} DeepSpeed checkpoints ({names}) and {why}",
            path=path,
            hint=f"pass the folder of the one to read, e.g. {tags[-1]}; DeepSpeed's zero_to_fp32 needs the tag too",
        )
    return tags[0] if tags else None


def _natural(folder: Path) -> tuple[int | str, ...]:
    """``global_step10`` after ``global_step9``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", folder.name))


def _numbered(folder: Path, pattern: re.Pattern[str]) -> dict[tuple[int, ...], Path]:
    found: dict[tuple[int, ...], Path] = {}
    for child in sorted(folder.iterdir()):
        match = pattern.match(child.name)
        if match:
            key = tuple(int(g) for g in match.groups())
            if key in found:
                raise ReshardError(
                    f"{found[key].name} and {child.name} both hold rank {key[0]}", path=folder, hint="keep one"
                )
            found[key] = child
    return found


def _refuse_other_features(folder: Path, model: dict, zero3: dict, optim: dict) -> None:
    """Tensor-parallel, pipeline and expert-parallel DeepSpeed checkpoints, refused by name."""
    for child in sorted(folder.iterdir()):
        if PIPELINE_FILE.match(child.name):
            raise ReshardError(
                "a DeepSpeed pipeline (PipelineModule) checkpoint: its per-layer files are not read",
                path=child,
                hint="reshard reads DeepSpeed ZeRO checkpoints of one model (HF Trainer, TRL, ...)",
            )
        if EXPERT_FILE.match(child.name):
            raise ReshardError("a DeepSpeed expert-parallel (MoE) checkpoint: expert files are not read", path=child)
    tp_ranks = {key[0] for key in model} | {key[1] for key in zero3} | {key[1] for key in optim}
    if tp_ranks - {0}:
        other = min(tp_ranks - {0})
        raise ReshardError(
            f"a tensor-parallel DeepSpeed checkpoint (mp_rank_{other:02d} files, Megatron-DeepSpeed): "
            "reshard reads DeepSpeed's data parallelism (ZeRO) only",
            path=folder,
            hint="write it with tensor parallelism 1, or convert it with Megatron-DeepSpeed's own tools",
        )


def _load(file: Path, options: ReadOptions) -> Pickled:
    """A DeepSpeed file's pickled dict, read structurally (:mod:`reshard.layouts.deepspeed.pickles`)."""
    pickled = read_pickled(file, trust_pickle=options.trust_pickle)
    if not isinstance(pickled.obj, Mapping):
        raise CorruptFileError(f"holds a {type(pickled.obj).__name__}, not a DeepSpeed checkpoint dict", path=file)
    return pickled


def _header(tensor: TensorRecord, file: Path, key: str) -> TensorHeader:
    """The header of a tensor the pickle rebuilds; an error for dtypes safetensors cannot hold."""
    code = code_from_name(tensor.dtype)
    if code is None:
        raise CorruptFileError(
            f"dtype torch.{tensor.dtype} is not supported (safetensors has no code for it)", path=file, tensor=key
        )
    return TensorHeader(tensor.sizes, code)


def _segment(pickled: Pickled, key: str, tensor: Any) -> Segment:
    if not isinstance(tensor, TensorRecord) or len(tensor.sizes) != 1 or tensor.dtype != "float32":
        got = f"torch.{tensor.dtype} of shape {list(tensor.sizes)}" if isinstance(tensor, TensorRecord) else None
        raise CorruptFileError(
            f"is {got or type(tensor).__name__}, not a flat float32 partition", path=pickled.file, tensor=key
        )
    piece = pickled.piece(key, tensor)
    return Segment(pickled.file, piece.position, tensor.sizes[0], 4, key)


def _shapes(value: Any, file: Path, key: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, Mapping) or not all(
        isinstance(n, str) and isinstance(s, tuple) and all(type(d) is int and d >= 0 for d in s)
        for n, s in value.items()
    ):
        raise CorruptFileError("is not a mapping of parameter names to shapes", path=file, tensor=key)
    return {name: tuple(shape) for name, shape in value.items()}


def _osd(obj: dict[str, Any], file: Path) -> dict[str, Any]:
    osd = obj.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        raise CorruptFileError("no optimizer_state_dict: not a ZeRO optimizer file", path=file)
    return dict(osd)


def _partition_count(osd: dict[str, Any], file: Path) -> int:
    count = osd.get("partition_count")
    counts = count if isinstance(count, list) else [count]
    if not counts or not all(type(c) is int and 1 <= c <= MAX_RANKS for c in counts):
        raise CorruptFileError(f"partition_count is {count!r}", path=file, tensor="partition_count")
    return max(counts)


def _ranks_in_order(found: dict[tuple[int, ...], Path], what: str, folder: Path, dp: int | None) -> list[Path]:
    """The files of data-parallel ranks 0 .. n-1 in order; a missing one named."""
    by_rank = {key[0]: path for key, path in found.items()}
    count = max(by_rank) + 1 if dp is None else dp
    extra = sorted(r for r in by_rank if r >= count)
    if extra:
        raise ReshardError(
            f"{by_rank[extra[0]].name} is of data-parallel rank {extra[0]} but the checkpoint records {count} ranks",
            path=folder,
            hint="remove the stray file",
        )
    missing = [r for r in range(count) if r not in by_rank]
    if missing:
        names = listed([f"{what} of data-parallel rank {r}" for r in missing], len(missing))
        raise MissingRankError(f"missing {names} ({count} ranks wrote this checkpoint)", path=folder)
    return [by_rank[r] for r in range(count)]


@dataclass
class _Tensors:
    """What a checkpoint's tensors are made of, filled as the files are read."""

    states: Pickled  # rank 0's model states
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    headers: dict[str, TensorHeader] = field(default_factory=dict)
    described: dict[str, str] = field(default_factory=dict)
    widened: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def states_file(self) -> Path:
        return self.states.file

    @property
    def module(self) -> Mapping[str, Any]:
        return self.states.obj["module"]

    def from_module(self, name: str) -> None:
        """``name`` as the module copy holds it (training dtype): a byte range of the model-states file."""
        tensor = self.module[name]
        self.pieces[name] = [self.states.piece(f"module.{name}", tensor)]
        self.headers[name] = _header(tensor, self.states_file, name)


def discover(path: Path, options: ReadOptions) -> SourceCheckpoint:
    """Read a DeepSpeed checkpoint from its pickles (no tensor byte read, torch not imported)."""
    weights = options.weights
    if weights not in WEIGHTS:
        raise ReshardError(f"--weights {weights!r} is not one of {', '.join(WEIGHTS)}")
    folder = tag_folder(path)
    if folder is None:
        raise MissingRankError("no DeepSpeed checkpoint folder ('latest' names none)", path=path)
    model, zero3, optim = (_numbered(folder, p) for p in (MODEL_STATES, ZERO3_MODEL_STATES, OPTIM_STATES))
    _refuse_other_features(folder, model, zero3, optim)
    if model and zero3:
        raise ReshardError("holds both ZeRO-0/1/2 and ZeRO-3 model-states files", path=folder, hint="keep one run's")
    if not model and not zero3:
        raise MissingRankError(
            "no mp_rank_00_model_states.pt (ZeRO-0/1/2) or zero_pp_rank_*_mp_rank_00_model_states.pt (ZeRO-3): "
            "the parameter names and shapes are only there",
            path=folder,
        )
    universal = not optim and (folder / UNIVERSAL).is_dir()
    training: TrainingState | None = None
    state_pieces: dict[str, list[Piece]] = {}  # each trainable parameter's moments, by state_name
    first: Pickled | None = None  # rank 0's optimizer file
    common: Pickled | None = None  # a universal checkpoint's zero/optimizer_state.pt
    states_files = [model[(0,)]] if model else _ranks_in_order(zero3, "zero_pp_rank_*_model_states.pt", folder, None)
    found = _Tensors(_model_states(states_files[0], options))
    states = found.states.obj
    if zero3 and weights == "module":
        raise ReshardError("ZeRO-3 keeps no module copy of the weights", path=folder, hint="drop --weights module")
    if weights == "module" or not (optim or universal):
        if zero3:
            raise MissingRankError("no *_optim_states.pt files: ZeRO-3 keeps its weights only there", path=folder)
        for name in found.module:
            found.from_module(name)
        why = "--weights module" if optim else "no optimizer files (ZeRO-0, or saved without them)"
        found.notes.append(f"DeepSpeed module copy read as it is ({why}); the fp32 master weights are not used")
        shared: dict[str, str] = {}
    else:
        recorded = states.get("dp_world_size")
        dp = recorded if type(recorded) is int and 1 <= recorded <= MAX_RANKS else None
        if universal:
            if zero3:
                states_files = _ranks_in_order(zero3, "zero_pp_rank_*_model_states.pt", folder, dp)
            stage, origin, moments = _universal(
                folder / UNIVERSAL, states, found, options, zero3=bool(zero3), state_pieces=state_pieces
            )
            common = _common(folder / UNIVERSAL, options, found.notes)
        else:
            optim_files = _ranks_in_order(optim, "*_optim_states.pt", folder, dp)
            dp = len(optim_files)
            if zero3:
                states_files = _ranks_in_order(zero3, "zero_pp_rank_*_model_states.pt", folder, dp)
            stage = _master(folder, states, states_files, optim_files, zero3=bool(zero3), options=options,
                            pieces=found.pieces, headers=found.headers, state_pieces=state_pieces)  # fmt: skip
            origin = f"rebuilt from {dp} optimizer files"
            first = _load(optim_files[0], options)
            moments = _moments(first)
        for name in found.pieces:
            found.described[name] = f"fp32 master weight {origin}"
        shared = _rest(states, states_files, options, found, zero3=bool(zero3))
        shapes = [_shapes(g, found.states_file, "param_shapes") for g in states["param_shapes"]]
        beside = path if folder != path else None
        if first is not None:
            training = native_state(found.states, first, shapes, beside=beside)
        elif common is not None:
            training = universal_state(found.states, common, shapes, moments, beside=beside)
        found.notes.append(
            f"DeepSpeed ZeRO-{stage} over {dp or '?'} data-parallel ranks (ds_version {states.get('ds_version')}): "
            f"fp32 master weights {origin}" + ("" if zero3 else "; --weights module takes the module copy instead")
        )
        if moments:
            carried = f"optimizer state beside the weights: {', '.join(moments)} (--with-optimizer carries it)"
            found.notes.append(carried)
    source = _source(path, folder, found, shared, options)
    if training is not None and state_pieces:
        training = replace(training, tensors=(_state_refs(folder, state_pieces, found.headers),))
    source.training = training
    return source


def _state_refs(
    folder: Path, state_pieces: dict[str, list[Piece]], headers: dict[str, TensorHeader]
) -> dict[str, TensorRef]:
    """The moments as lazy references, each float32 at its parameter's shape."""
    shaped = {key: TensorHeader(headers[split_state_name(key)[0]].shape, "F32") for key in state_pieces}
    pieces = {key: tuple(parts) for key, parts in state_pieces.items()}
    reader = PiecesReader(folder, pieces, shaped, {key: "optimizer state, from the optimizer files" for key in pieces})
    return {key: TensorRef(key, 0, reader, key, header) for key, header in shaped.items()}


def _model_states(file: Path, options: ReadOptions) -> Pickled:
    """Rank 0's model-states file, checked to be DeepSpeed's of one tensor-parallel rank."""
    pickled = _load(file, options)
    states = pickled.obj
    missing = [k for k in REQUIRED if k not in states]
    if missing:
        raise CorruptFileError(f"no {', '.join(missing)}: not a DeepSpeed model-states file", path=file)
    if states.get("mp_world_size") not in (None, 1):
        raise ReshardError(
            f"mp_world_size is {states['mp_world_size']!r}: a tensor-parallel DeepSpeed checkpoint is not read",
            path=file,
        )
    if not isinstance(states["module"], Mapping):
        raise CorruptFileError("'module' is not a state dict", path=file, tensor="module")
    return pickled


def _rest(
    states: dict[str, Any], states_files: list[Path], options: ReadOptions, found: _Tensors, *, zero3: bool
) -> dict[str, str]:
    """Frozen parameters, buffers and what else the module holds beside the fp32 masters; the tied weights."""
    _frozen(found.states, states_files, options, found.pieces, found.headers, zero3=zero3, notes=found.notes)
    for name in _names(states.get("buffer_names"), states_files[0], "buffer_names"):
        if name in found.module and name not in found.pieces:
            found.from_module(name)
    shared = _shared(states.get("shared_params"), states_files[0])
    leftover = [n for n in found.module if n not in found.pieces and n not in shared]
    if leftover and zero3:
        why = "is in the module but in no parameter group, frozen parameter or buffer"
        raise CorruptFileError(why, path=states_files[0], tensor=leftover[0])
    for name in leftover:
        found.from_module(name)
    if leftover:
        found.notes.append(
            f"{len(leftover)} tensors have no fp32 master (frozen under ZeRO-1, or not parameters): "
            f"read from the {found.headers[leftover[0]].code} module copy ({listed(leftover, len(leftover))})"
        )
    narrow = [name for name, header in found.headers.items() if header.code in WIDENED]
    for name in narrow:
        found.widened[name] = found.headers[name].code
        found.headers[name] = TensorHeader(found.headers[name].shape, "F32")
        found.described.setdefault(name, f"{found.widened[name]} in the model states, widened to F32")
    if narrow:
        found.notes.append(
            f"{len(narrow)} 16-bit tensors without an fp32 master (frozen parameters, buffers) widened to float32, "
            f"as zero_to_fp32 writes them: {listed(narrow, len(narrow))}"
        )
    return shared


def _source(
    path: Path, folder: Path, found: _Tensors, shared: dict[str, str], options: ReadOptions
) -> SourceCheckpoint:
    """The checkpoint as one rank, in the module's order; a tied weight reads its owner's bytes."""
    pieces = {k: tuple(v) for k, v in found.pieces.items()}
    reader = PiecesReader(folder, pieces, found.headers, found.described, found.widened)
    refs: dict[str, TensorRef] = {}
    for name in [*found.module, *(n for n in found.pieces if n not in found.module)]:
        key = name if name in found.pieces else shared.get(name, name)
        if key in found.pieces:
            refs[name] = TensorRef(name, 0, reader, key, found.headers[key])
        elif name in shared:
            raise CorruptFileError(f"shared with {key!r}, which no file holds", path=found.states_file, tensor=name)
    if shared:
        found.notes.append(f"tied weights (shared_params): {', '.join(f'{a} = {o}' for a, o in shared.items())}")
    source = SourceCheckpoint(path, NAME, [refs], config=find_config(folder, options.config))
    source.notes.extend(found.notes)
    return source


def _universal(
    zero: Path,
    states: dict[str, Any],
    found: _Tensors,
    options: ReadOptions,
    *,
    zero3: bool,
    state_pieces: dict[str, list[Piece]],
) -> tuple[int, str, list[str]]:
    """The fp32 master of every trainable parameter from ``ds_to_universal``'s ``zero/<name>/fp32.pt``: ZeRO-1/2
    ``{"param": tensor, "cat_dim": 0}``, ZeRO-3 a flat tensor (``checkpoint/ds_to_universal.py``); returns the stage,
    where the weights come from and the optimizer state skipped."""
    shapes = {n: s for g in states["param_shapes"] for n, s in _shapes(g, found.states_file, "param_shapes").items()}
    skipped: set[str] = set()
    for name, shape in shapes.items():
        file = zero / name / "fp32.pt"
        if not file.is_file():
            raise MissingRankError("no fp32.pt for this parameter in the universal checkpoint", path=file, tensor=name)
        found.pieces[name] = [_whole_float32(file, name, shape, options)]
        found.headers[name] = TensorHeader(shape, "F32")
        skipped.update(p.stem for p in file.parent.iterdir() if p.name != file.name)
        for moment in MOMENTS:
            moment_file = file.parent / f"{moment}.pt"
            if moment_file.is_file():
                state_pieces[state_name(name, moment)] = [_whole_float32(moment_file, name, shape, options)]
    return (3 if zero3 else _stage(states)), "from ds_to_universal's zero/<name>/fp32.pt", sorted(skipped)


def _whole_float32(file: Path, name: str, shape: tuple[int, ...], options: ReadOptions) -> Piece:
    """Where one of ``ds_to_universal``'s per-parameter files (``{"param": tensor, "cat_dim": 0}``, ZeRO-3: the flat
    tensor) keeps ``name``'s float32 values in C order."""
    stored = read_pickled(file, trust_pickle=options.trust_pickle)
    tensor = stored.obj.get("param") if isinstance(stored.obj, Mapping) else stored.obj
    if (
        not isinstance(tensor, TensorRecord)
        or tensor.dtype != "float32"
        or math.prod(tensor.sizes) != math.prod(shape)
    ):
        got = f"torch.{tensor.dtype} {list(tensor.sizes)}" if isinstance(tensor, TensorRecord) else None
        why = f"holds {got or type(tensor).__name__}, not the float32 {list(shape)} of {name}"
        raise CorruptFileError(why, path=file, tensor=name)
    return stored.piece(name, tensor)


def _common(zero: Path, options: ReadOptions, notes: list[str]) -> Pickled | None:
    """A universal checkpoint's ``zero/optimizer_state.pt``: the optimizer's param groups and common state; without
    it (DeepSpeed's ``load_universal`` needs it) the weights are read all the same, and a note says so."""
    file = zero / "optimizer_state.pt"
    if not file.is_file():
        notes.append(f"no {UNIVERSAL}/{file.name} (ds_to_universal writes it): the training state is not read")
        return None
    return read_pickled(file, trust_pickle=options.trust_pickle)


def _master(
    folder: Path,
    states: dict[str, Any],
    states_files: list[Path],
    optim_files: list[Path],
    *,
    zero3: bool,
    options: ReadOptions,
    pieces: dict[str, list[Piece]],
    headers: dict[str, TensorHeader],
    state_pieces: dict[str, list[Piece]],
) -> int:
    """Fill ``pieces`` and ``headers`` with the fp32 master of every trainable parameter, and ``state_pieces`` with
    its Adam moments (by :func:`state_name`); returns the stage.

    A moment's flat partition is the fp32 partition's, padded to the ranks' common size: each rank's is read up to
    its fp32 partition's length, so the parameters lie at the same offsets in both."""
    dp = len(optim_files)
    key = "fp32_flat_groups" if zero3 else "single_partition_of_fp32_groups"
    groups: list[list[Segment]] = []
    moments: dict[str, list[list[Segment]]] = {}
    paddings = None
    for rank, file in enumerate(optim_files):
        pickled = _load(file, options)
        osd = _osd(pickled.obj, file)
        if key not in osd:
            other = "single_partition_of_fp32_groups" if zero3 else "fp32_flat_groups"
            why = "a ZeRO-1/2 optimizer file beside ZeRO-3 model states" if other in osd else "no fp32 partitions"
            raise CorruptFileError(f"no {key}: {why}", path=file)
        count = _partition_count(osd, file)
        if count != dp:
            raise ReshardError(
                f"written by {count} data-parallel ranks but {dp} optimizer files are in the folder",
                path=file,
                tensor="partition_count",
                hint="every rank's *_optim_states.pt of one save must be present, and no other",
            )
        flats = osd[key]
        if not isinstance(flats, list | tuple) or not flats:
            raise CorruptFileError(f"{key} is not a list of tensors", path=file, tensor=key)
        groups.append([_segment(pickled, f"{key}[{g}]", t) for g, t in enumerate(flats)])
        for moment, segments in _moment_segments(pickled, osd, groups[-1]).items():
            moments.setdefault(moment, []).append(segments)
        if rank == 0 and not zero3:
            paddings = osd.get("param_alignment_paddings")
    param_shapes = states["param_shapes"]
    if not isinstance(param_shapes, list):
        raise CorruptFileError("is not a list of groups", path=states_files[0], tensor="param_shapes")
    shapes = [_shapes(g, states_files[0], "param_shapes") for g in param_shapes]
    merged = {name: shape for group in shapes for name, shape in group.items()}
    if paddings is not None and not _int_lists(paddings):
        raise CorruptFileError(
            "is not a list of lists of integers", path=optim_files[0], tensor="param_alignment_paddings"
        )

    def placed(ranks: list[list[Segment]]) -> dict[str, list[Piece]]:
        if zero3:
            return zero3_pieces(merged, [Flat(tuple(rank)) for rank in ranks], path=states_files[0])
        if len({len(rank) for rank in ranks}) != 1:
            raise CorruptFileError("the optimizer files hold different numbers of parameter groups", path=folder)
        per_group = [Flat(tuple(rank[g] for rank in ranks)) for g in range(len(ranks[0]))]
        return zero2_pieces(shapes, per_group, paddings, dp, path=states_files[0])

    for name, parts in placed(groups).items():
        pieces[name] = parts
        headers[name] = TensorHeader(merged[name], "F32")
    for moment, ranks in moments.items():
        if len(ranks) == dp:  # a moment every rank keeps
            state_pieces.update({state_name(name, moment): parts for name, parts in placed(ranks).items()})
    return 3 if zero3 else _stage(states)


def _moment_segments(pickled: Pickled, osd: dict[str, Any], fp32: list[Segment]) -> dict[str, list[Segment]]:
    """This rank's flat partition of each Adam moment, one per group, cut to its fp32 partition's length; a moment
    not kept for every group is left out (the planner refuses its parameters by name)."""
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    state = inner.get("state") if isinstance(inner, Mapping) else None
    groups = inner.get("param_groups") if isinstance(inner, Mapping) else None
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        return {}
    # torch's optimizer over the flat partitions: its parameters, group after group, are the partitions in order
    indices = [i for group in groups if isinstance(group, Mapping) for i in group.get("params") or ()]
    if len(indices) != len(fp32):
        return {}
    found: dict[str, list[Segment]] = {}
    for index, master in zip(indices, fp32, strict=True):
        entry = state.get(index)
        for moment in MOMENTS:
            tensor = entry.get(moment) if isinstance(entry, Mapping) else None
            if tensor is None:
                continue
            where = f"optimizer_state_dict.state[{index}].{moment}"
            segment = _segment(pickled, where, tensor)
            if segment.numel < master.numel:
                raise CorruptFileError(
                    f"holds {segment.numel} elements but its group's fp32 partition {master.numel}",
                    path=pickled.file,
                    tensor=where,
                )
            found.setdefault(moment, []).append(replace(segment, numel=master.numel))
    return {moment: segments for moment, segments in found.items() if len(segments) == len(fp32)}


def _int_lists(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(p, list) and all(type(x) is int for x in p) for p in value)


def _stage(states: dict[str, Any]) -> int:
    """ZeRO-1 or 2, as the config records it (both lay out the optimizer files alike)."""
    config = states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    stage = zero.get("stage") if isinstance(zero, Mapping) else None
    return stage if stage in (1, 2) else 2


def _frozen(
    states: Pickled,
    states_files: list[Path],
    options: ReadOptions,
    pieces: dict[str, list[Piece]],
    headers: dict[str, TensorHeader],
    *,
    zero3: bool,
    notes: list[str],
) -> None:
    """Frozen parameters (no gradient, so no fp32 master): whole in rank 0's model states under ZeRO-2, one
    fragment per rank under ZeRO-3 (concatenated and cut to size, like trainable ones); ZeRO-1 records none."""
    if states.obj.get("frozen_param_shapes") is None:
        return
    shapes = _shapes(states.obj["frozen_param_shapes"], states_files[0], "frozen_param_shapes")
    if not shapes:
        return
    every = [states] + [_load(f, options) for f in states_files[1:]] if zero3 else [states]
    for name, shape in shapes.items():
        fragments: list[tuple[Piece, TensorRecord]] = []
        for rank_states in every:
            held = rank_states.obj.get("frozen_param_fragments")
            if not isinstance(held, Mapping) or name not in held:
                raise CorruptFileError("a frozen parameter without its fragment", path=rank_states.file, tensor=name)
            fragments.append((rank_states.piece(f"frozen_param_fragments.{name}", held[name]), held[name]))
        dtypes = {tensor.dtype for _, tensor in fragments}
        if len(dtypes) != 1:
            why = f"fragments of dtypes {sorted(f'torch.{d}' for d in dtypes)}"
            raise CorruptFileError(why, path=states_files[0], tensor=name)
        header = _header(fragments[0][1], states_files[0], name)
        itemsize = fragments[0][1].itemsize
        segments = [Segment(p.file, p.position, p.length // itemsize, itemsize, name) for p, _ in fragments]
        flat = Flat(tuple(segments))
        numel = math.prod(shape)
        if flat.numel < numel:
            why = f"fragments of {flat.numel} elements for {numel}"
            raise CorruptFileError(why, path=states_files[0], tensor=name)
        pieces[name] = flat.span(0, numel)
        headers[name] = TensorHeader(shape, header.code)
    notes.append(f"{len(shapes)} frozen parameters read from the model states")


def _names(value: Any, file: Path, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(n, str) for n in value):
        raise CorruptFileError("is not a list of names", path=file, tensor=key)
    return list(value)


def _shared(value: Any, file: Path) -> dict[str, str]:
    """``alias -> owner`` of tied weights (only rank 0's file fills it)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise CorruptFileError("is not a mapping of names", path=file, tensor="shared_params")
    return dict(value)


def _moments(pickled: Pickled) -> list[str]:
    """The names of the optimizer state reshard does not carry (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``)."""
    osd = _osd(pickled.obj, pickled.file)
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    state = inner.get("state") if isinstance(inner, Mapping) else None
    if isinstance(inner, list):  # ZeRO-1/2 keep one state per group
        state = {i: s for i, g in enumerate(inner) if isinstance(g, Mapping) for s in [g]}
    names: set[str] = set()
    if isinstance(state, Mapping):
        for entry in state.values():
            if isinstance(entry, Mapping):
                names.update(str(k) for k in entry)
    return sorted(names)
