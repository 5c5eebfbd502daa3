"""Checkpoint and resume: model and optimizer through ``torch.distributed.checkpoint`` (DCP), the rest per rank.

One checkpoint is one directory::

    <directory>/
      step-00000100/
        .metadata, __0_0.distcp, ...   model and optimizer, written by DCP (sharded under FSDP)
        rank-00000.pt, ...             per rank: RNG states, GradScaler, LR scheduler, ``extra``
        COMPLETE                       JSON (step, world size, redline version, time), written last

A save writes ``step-00000100.partial/``; when every rank has written its part, rank 0 writes ``COMPLETE``
and renames the directory to ``step-00000100/`` (atomic on one filesystem). A process killed at any point
leaves the previous complete checkpoint as it was; the next save removes the ``.partial`` leftovers. After a
save the newest ``keep`` complete checkpoints stay and older ones are deleted; so are any of a later step
than the one saved (left by a run this one did not resume from), with a warning, or a resume would pick them.

Model and optimizer states go through DCP's ``get_state_dict``/``set_state_dict``, so the same code serves a
plain module, a DDP-wrapped one and an FSDP2 (``fully_shard``) one, whose parameters and optimizer states are
saved sharded, each rank writing its shards. Loading with another world size:

- DDP (replicated): the model and optimizer load whatever the world size (DCP keeps one copy of a replicated
  tensor); a single process can load a checkpoint written by 8 ranks and the other way round.
- FSDP2: DCP reshards on load: each rank reads the slices of the saved shards its new shard covers, so
  8 ranks can resume what 4 wrote (or a single unsharded process can read it).
- ZeRO-1 (``ZeroRedundancyOptimizer``, whose state DCP's state_dict API cannot read): the model goes
  through DCP, each rank's optimizer shard into its own file; it loads with the same world size only.
- tensor parallelism: parameters are DTensors, saved sharded as FSDP2's are. A projection packing q, k
  and v (GPT-2's ``c_attn``, whose ``_StridedShard`` DCP refuses) is saved as its three projections under
  ``<name>.packed0`` ... (each rank its shares of each, no gather), so another tensor-parallel degree can
  load it; a run without tensor parallelism names it whole and cannot load those (nor the other way): the
  load says so (``_packing_differs``) rather than which key DCP missed.
- per-rank state: with the same world size each rank gets its own RNG states and ``extra`` back; with
  another one every rank reads rank 0's file (scaler, scheduler, ``extra``) and the RNG states are left as
  the caller seeded them (with a warning), since the ranks' random streams no longer correspond.

Collectives: ``save`` and ``load_latest`` must be called by every rank (they barrier); ``latest_step`` only
reads the directory and may be called by any rank alone. The directory must be on a filesystem every rank
sees (a shared one across nodes).

A checkpoint is code: DCP's ``.metadata`` is a pickle, which runs what it names when read. ``load_latest``
refuses a directory someone other than this user or root could have written or swapped
(``redline.files.check_trusted``) and loads only from the folder that check resolved (one that was not there
at the check is not resumed from), and ``save`` writes nothing its group or everyone may write.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import shutil
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, TypeGuard, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from redline import __version__
from redline.env import REDLINE_TEST_SLOW_SAVE_S
from redline.errors import BadInput, RedlineError, one_line
from redline.files import Trusted, check_trusted, drop_write_for_others, read_user_bytes, refuse_non_folder
from redline.runtime.tensor_parallel import join_packed, packed_dim, split_packed
from redline.units import MiB

if TYPE_CHECKING:  # imported when used only: see _is_zero
    from torch.distributed.optim import ZeroRedundancyOptimizer

_T = TypeVar("_T")

# the optimizer's state dict keyed by parameter name throughout ("param_groups.<name>.lr"): torchtitan's choice,
# and what pipeline stages need (a nested "param_groups" list is one object DCP writes from one rank only)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
MARKER = "COMPLETE"
# the micro-batch a restart must use after an out-of-memory inside a gradient collective (see record_micro_batch)
MICRO_BATCH_FILE = ".micro-batch.json"
ATTEMPTS_FILE = ".attempts"  # how many times a run started on this directory (hidden, like the record)
# of the COMPLETE marker, the per-rank files and the state's layout (2: the optimizer's flattened, each
# parameter's group settings under its own name, so pipeline ranks holding different parameters do not
# overwrite each other's; 3: a packed tensor-parallel parameter and its optimizer states saved as their
# projections, "<name>.packed<i>", see _unpack). A format-2 checkpoint loads as before: it holds no packed
# parameter, which format 2 could not save.
FORMAT = 3
PACKED = ".packed"
MARKER_LIMIT_BYTES = MiB  # a COMPLETE marker, the attempts count, the micro-batch record: a few bytes of JSON

_STEP_DIR = re.compile(r"step-(\d{8,})")
_OURS = re.compile(r"step-\d{8,}(\.partial|\.trash)?")
_RANK_FILE_KEYS = frozenset(
    ("optimizer_state_saved", "zero_optimizer_shard", "rng", "scaler", "scheduler", "extra_json")
)
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class _Readable(NamedTuple):
    """A checkpoint this rank can load: its folder, its COMPLETE marker and this rank's file."""

    path: Path
    marker: dict[str, Any]
    per_rank: dict[str, Any]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or part of one not restored; training goes on."""


class Checkpointer:
    """Save and restore a training run's state under ``directory``, keeping the newest ``keep`` checkpoints.

    Rank and world size come from ``torch.distributed`` when a process group is initialised (read at each
    call), else 0 and 1.
    """

    def __init__(self, directory: str | Path, *, keep: int = 2) -> None:
        if keep < 1:
            raise BadInput(f"a checkpointer keeps at least 1 checkpoint, not {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.restored_states: dict[str, Any] = {}  # the ``states`` of the checkpoint load_latest restored

    @property
    def rank(self) -> int:
        return dist.get_rank() if _distributed() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if _distributed() else 1

    # ------------------------------------------------------------------------------------------- save

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        scheduler: Any = None,
        extra: dict | None = None,
        states: dict[str, Any] | None = None,
    ) -> Path:
        """Write the checkpoint of ``step`` (every rank calls this) and return its directory.

        ``extra`` is a plain JSON-serialisable dict kept per rank (data position, epoch, micro-batch ...);
        ``load_latest`` returns it as ``json.loads`` reads it back. ``states``: more objects with a
        ``state_dict()``, by name, saved per rank; ``load_latest`` leaves what it read in ``restored_states``.
        A checkpoint of the same step replaces the old one; complete checkpoints of later steps (from a run this
        one did not resume) are removed with a warning, since a resume would otherwise pick them over this
        run's.
        """
        if step < 0:
            raise BadInput(f"a checkpoint step is 0 or more, not {step}")
        try:
            extra_json = json.dumps(extra or {})
        except (TypeError, ValueError) as exc:
            raise BadInput(f"checkpoint extra must be a JSON-serialisable dict: {exc}") from None
        self._check_layout()
        rank, world = self.rank, self.world_size
        final = self.directory / _dir_name(step)
        partial = final.with_name(final.name + ".partial")

        if rank == 0:
            self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
            self._remove_leftovers()
        _barrier()  # no rank writes into a .partial directory rank 0 is still removing
        partial.mkdir(mode=0o755, parents=True, exist_ok=True)

        had_optimizer_state = bool(optimizer.state)
        state, zero_shard = _sharded_state(model, optimizer)
        try:
            with _single_process_quiet():
                dcp.save(state, checkpoint_id=partial, no_dist=not _distributed())
        except CheckpointException as exc:  # raised on every rank; a BaseException, which user code rarely catches
            raise RedlineError(f"checkpoint {partial} not saved: {_one_line(exc)}") from exc

        per_rank = {
            "format": FORMAT,
            "step": step,
            "rank": rank,
            "world_size": world,
            "optimizer_state_saved": had_optimizer_state,
            "zero_optimizer_shard": zero_shard,
            "rng": _rng_states(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra_json": extra_json,
            "states": {name: state.state_dict() for name, state in (states or {}).items()},
        }
        error = None
        try:
            _write_synced(partial / _rank_file(rank), lambda f: torch.save(per_rank, f))
        except OSError as exc:  # a full disk on one rank must not leave the others waiting below
            error = _one_line(exc)
        _pause_for_tests()
        # also the barrier that puts every rank's files on disk before COMPLETE says so
        error = _first_error_of_all_ranks(error)
        if error is not None:
            raise RedlineError(f"checkpoint {partial} not saved: {error}")

        if rank == 0:
            try:
                self._commit(step, world, partial, final)
            except OSError as exc:
                error = _one_line(exc)
        # also the barrier that keeps every rank from returning (and perhaps loading) before the rename
        error = _first_error_of_all_ranks(error)
        if error is not None:
            raise RedlineError(f"checkpoint {partial} not saved: {error}")
        return final

    def _commit(self, step: int, world: int, partial: Path, final: Path) -> None:
        """Rank 0, once every rank's files are on disk: COMPLETE, the rename, then the older checkpoints go."""
        marker = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "redline_version": __version__,
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        _write_synced(partial / MARKER, lambda f: f.write(json.dumps(marker, indent=1).encode()))
        drop_write_for_others(partial)  # whatever the umask: a resume refuses what others may write
        replaced = final.with_name(final.name + ".trash")
        if final.exists():  # the same step saved again
            final.rename(replaced)
        partial.rename(final)  # the commit point
        _sync_dir(self.directory)
        shutil.rmtree(replaced, ignore_errors=True)
        self._prune(step)

    def _remove_leftovers(self) -> None:
        for path in self.directory.iterdir():
            if path.is_dir() and path.suffix in (".partial", ".trash") and _OURS.fullmatch(path.name):
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self, saved_step: int) -> None:
        """Keep ``saved_step`` and the newest ``keep - 1`` complete checkpoints before it; delete the rest."""
        older = [(s, p) for s, p in self._step_dirs() if s < saved_step and _read_marker(p, s) is not None]
        kept = {saved_step} | {s for s, _ in sorted(older, reverse=True)[: self.keep - 1]}
        for s, path in self._step_dirs():
            if s in kept:
                continue
            if s > saved_step:
                warnings.warn(
                    f"removing checkpoint {path}: it is newer than step {saved_step}, which this run just saved",
                    CheckpointWarning,
                    stacklevel=4,
                )
            # renamed first, so a kill during the deletion leaves no half-deleted checkpoint under a valid name
            trash = path.with_name(path.name + ".trash")
            path.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------------------------------- load

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint with a valid COMPLETE marker, None when there is none.
        Reads the directory only (no collective, no check that the files load)."""
        self._check_layout()
        for step, path in self._step_dirs():  # newest first
            if _read_marker(path, step) is not None:
                return step
        return None

    # ------------------------------------------------------------------------------ attempts

    def count_start(self) -> int:
        """This start's number among the starts of the run on this directory (0 for the first), counted in
        ``ATTEMPTS_FILE``: restarts that resume from one checkpoint (crashes before the next) are told apart.
        Collective: rank 0 counts and tells the others."""
        number = [0]
        if self.rank == 0:
            path = self.directory / ATTEMPTS_FILE
            try:
                number[0] = int(read_user_bytes(path, "attempts file", limit_bytes=MARKER_LIMIT_BYTES)) + 1
            except (BadInput, ValueError):  # none yet, or not ours (a FIFO in its place is not waited on)
                number[0] = 0
            self.directory.mkdir(parents=True, exist_ok=True)
            _replace_file(path, str(number[0]).encode())
        if _distributed():
            dist.broadcast_object_list(number, src=0)
        return number[0]

    # ------------------------------------------------------------------------------ micro-batch record

    def record_micro_batch(self, micro_batch: int, accumulation: int) -> None:
        """Remember a smaller micro-batch for the restart after an out-of-memory the ranks could not agree on
        in place (``MICRO_BATCH_FILE``, hidden so the layout check ignores it). Any ONE rank may call this,
        alone; a record never grows the micro-batch: a smaller one already there stays."""
        recorded = self.recorded_micro_batch()
        if recorded is not None and recorded[0] <= micro_batch:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"micro_batch": micro_batch, "accumulation": accumulation}).encode()
        _replace_file(self.directory / MICRO_BATCH_FILE, payload)

    @property
    def micro_batch_path(self) -> Path:
        return self.directory / MICRO_BATCH_FILE

    def clear_micro_batch(self) -> None:
        """Forget the recorded micro-batch: the run it was for has completed."""
        with contextlib.suppress(FileNotFoundError):
            self.micro_batch_path.unlink()

    def recorded_micro_batch(self) -> tuple[int, int] | None:
        """``(micro_batch, accumulation)`` recorded by ``record_micro_batch``; None if none (or unreadable)."""
        try:
            path = self.directory / MICRO_BATCH_FILE
            data = json.loads(read_user_bytes(path, "micro-batch record", limit_bytes=MARKER_LIMIT_BYTES))
            micro, accumulation = int(data["micro_batch"]), int(data["accumulation"])
        except (BadInput, ValueError, TypeError, KeyError):
            return None
        return (micro, accumulation) if micro >= 1 and accumulation >= 1 else None

    def load_latest(
        self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None, scheduler: Any = None
    ) -> tuple[int, dict] | None:
        """Restore the newest checkpoint that loads, in place (every rank calls this); return its
        ``(step, extra)``, or None when the directory holds no checkpoint.

        A checkpoint that fails to load (a missing COMPLETE marker, a truncated file, a state that does not
        fit the model) is skipped with a CheckpointWarning and the one before it is tried; BadInput when none
        loads. A failed attempt may have overwritten some parameters before failing; the next attempt
        overwrites them all.
        """
        self._check_layout()
        # before any file is read, on every rank (each sees the files as it sees them), and refused on all
        trusted, refusal = _trusted(self.directory)
        refusal = _first_error_of_all_ranks(refusal)
        if refusal is not None:
            raise BadInput(refusal)
        # listed from the folder checked, never from the path again; a folder that was not there when checked
        # is not resumed from (one made since, or a symlink repointed since, was never checked)
        names = [] if self.rank != 0 or trusted is None else _step_names(trusted.path)
        if _distributed():
            # every rank tries the same checkpoints in the same order, whatever each one's view of the directory
            box = [names]
            dist.broadcast_object_list(box, src=0)
            names = box[0]
        if not names:
            return None
        failures = []
        for step, name in names:
            error = self._try_load(step, trusted, name, model, optimizer, scaler, scheduler)
            if isinstance(error, tuple):
                return error
            failures.append(f"{name}: {error}")
            if self.rank == 0:
                warnings.warn(
                    f"checkpoint {self.directory / name} does not load ({error}); falls back to the one before it",
                    CheckpointWarning,
                    stacklevel=2,
                )
        raise BadInput(f"no checkpoint in {self.directory} loads ({'; '.join(failures)})")

    def _try_load(
        self,
        step: int,
        trusted: Trusted | None,
        name: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        scheduler: Any,
    ) -> tuple[int, dict[str, Any]] | str:
        """``(step, extra)`` once the checkpoint ``name`` in the ``trusted`` folder is restored, else why not
        (the same answer on every rank)."""
        # agreed before dcp.load, a collective: a rank that skipped it would leave the others waiting in it
        readable = _agreed(self._read_own_file(step, trusted, name, optimizer))
        if isinstance(readable, str):
            return readable
        path, marker, per_rank = readable
        same_world = marker["world_size"] == self.world_size
        # a ZeroRedundancyOptimizer's checkpoint holds its shard, another's none (_read_own_file checked)
        zero = optimizer if _is_zero(optimizer) else None
        state: dict[str, dict[str, Any]]
        error = None
        try:
            if zero is not None:
                state = {"model": get_model_state_dict(model)}
            else:
                # the template: every key get_state_dict gives (it fills an empty optimizer's state); of the
                # optimizer's, those saved, the group settings alone where it had no state yet
                model_state, template = get_state_dict(model, optimizer, options=FLAT)
                saved = template if per_rank["optimizer_state_saved"] else _groups_only(template)
                state = {"model": _unpack(model_state), "optim": _unpack(saved)}
                error = _packing_differs(state["model"], dcp.FileSystemReader(path).read_metadata())
        except Exception as exc:
            error = _one_line(exc)
        error = _first_error_of_all_ranks(error)  # agreed before dcp.load, a collective, as above
        if error is not None:
            return error
        try:
            with _single_process_quiet():
                dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
            if zero is None:
                state = {"model": _repack(model_state, state["model"]), "optim": _repack(saved, state["optim"])}
        except (Exception, CheckpointException) as exc:
            error = _one_line(exc)
        error = _first_error_of_all_ranks(error)
        if error is not None:
            return error

        if zero is not None:
            set_model_state_dict(model, state["model"])
            zero.optim.load_state_dict(per_rank["zero_optimizer_shard"])
            # the outer parameter groups are what a scheduler sets and what step() copies into the shard
            for outer, inner in zip(zero.param_groups, zero.optim.param_groups, strict=True):
                outer.update({key: value for key, value in inner.items() if key != "params"})
        else:
            optim = template | state["optim"]
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim, options=FLAT)
            if not per_rank["optimizer_state_saved"]:
                optimizer.state = defaultdict(dict)
        if scaler is not None and per_rank["scaler"]:  # a disabled GradScaler saves {}
            scaler.load_state_dict(per_rank["scaler"])
        if scheduler is not None and per_rank["scheduler"] is not None:
            scheduler.load_state_dict(per_rank["scheduler"])
        self.restored_states = per_rank.get("states") or {}  # a checkpoint of an older redline has none
        if same_world:
            _set_rng_states(per_rank["rng"])
        elif self.rank == 0:
            warnings.warn(
                f"checkpoint {path} was written by {marker['world_size']} ranks and is loaded by {self.world_size}: "
                "model and optimizer restored, RNG states not (every rank uses rank 0's scaler, scheduler and extra)",
                CheckpointWarning,
                stacklevel=3,
            )
        return step, json.loads(per_rank["extra_json"])

    def _read_own_file(
        self, step: int, trusted: Trusted | None, name: str, optimizer: torch.optim.Optimizer
    ) -> _Readable | str:
        """The checkpoint ``name`` in the ``trusted`` folder, its COMPLETE marker and this rank's file, or why
        they cannot be used; reads nothing collective."""
        path = _checked_step(trusted, name)
        if isinstance(path, str):
            return path
        marker = _read_marker(path, step)
        if marker is None:
            return f"no valid {MARKER} marker"
        if not isinstance(marker.get("format"), int) or marker["format"] > FORMAT:
            return f"its format {marker.get('format')!r} is not one this redline reads (up to {FORMAT})"
        same_world = marker["world_size"] == self.world_size
        file_name = _rank_file(self.rank if same_world else 0)
        try:
            per_rank = torch.load(path / file_name, weights_only=True)
            missing = sorted(_RANK_FILE_KEYS - per_rank.keys())
            if missing:
                return f"its {file_name} lacks {', '.join(missing)}"
            json.loads(per_rank["extra_json"])
        except Exception as exc:
            return _one_line(exc)
        zero = per_rank["zero_optimizer_shard"] is not None
        if zero != _is_zero(optimizer):
            kinds = ("a ZeroRedundancyOptimizer", "another optimizer")
            return f"saved with {kinds[not zero]}, loaded into {kinds[zero]}"
        if zero and not same_world:
            return f"its ZeroRedundancyOptimizer shards are for {marker['world_size']} ranks"
        return _Readable(path, marker, per_rank)

    # ------------------------------------------------------------------------------------------- layout

    def _step_dirs(self) -> list[tuple[int, Path]]:
        return [(step, self.directory / name) for step, name in _step_names(self.directory)]

    def _check_layout(self) -> None:
        """BadInput when ``directory`` is not ours: a file, or a directory of things none of which is a
        checkpoint of ours (hidden files aside)."""
        refuse_non_folder(self.directory, "checkpoint directory")
        if not self.directory.is_dir():
            return
        names = [p.name for p in self.directory.iterdir() if not p.name.startswith(".")]
        if names and not any(_OURS.fullmatch(name) for name in names):
            raise BadInput(f"{self.directory} is not a redline checkpoint directory (it holds {names[0]!r} ...)")


# ----------------------------------------------------------------------------------------------- helpers


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _is_zero(optimizer: torch.optim.Optimizer) -> TypeGuard[ZeroRedundancyOptimizer]:
    # not imported here: torch.distributed.optim scripts its optimizers with TorchScript on import (slow, and
    # deprecation warnings); when nobody imported it, the optimizer is not one of its classes
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict | None]:
    """What ``dcp.save`` writes (the model's state, and the optimizer's unless ZeRO-1 keeps it), and ZeRO-1's
    shard of the optimizer states, which this rank saves in its own file (None otherwise)."""
    if _is_zero(optimizer):
        return {"model": get_model_state_dict(model)}, optimizer.optim.state_dict()
    had_optimizer_state = bool(optimizer.state)
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    if not had_optimizer_state:
        # get_state_dict initialises an empty optimizer's state with a zero-gradient step (Adam's step count
        # becomes 1); a save must not change the run, so the state goes back to empty, saved so
        optimizer.state = defaultdict(dict)
        optim_state = _groups_only(optim_state)
    return {"model": _unpack(model_state), "optim": _unpack(optim_state)}, None


def _unpack(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each packed tensor-parallel DTensor (``packed_dim``: GPT-2's ``c_attn`` weight and bias,
    their optimizer states) replaced by its projections under ``<name>.packed<i>``, plain-sharded DTensors
    whose local tensors are views of this rank's share: DCP saves those (it refuses ``_StridedShard``), and
    loads into them in place. Every other entry as it is."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if packed_dim(value) is None:
            out[key] = value
            continue
        for i, part in enumerate(split_packed(value)):
            out[f"{key}{PACKED}{i}"] = part
    return out


def _repack(template: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """``template``'s keys with what DCP loaded into ``_unpack(template)``: the projections written back into
    their packed tensors, every other entry as loaded (DCP loads tensors in place, replaces other values)."""
    out = {}
    for key, value in template.items():
        found = packed_dim(value)
        if found is None:
            out[key] = loaded[key]
        else:
            join_packed(value, [loaded[f"{key}{PACKED}{i}"] for i in range(found[1])])
            out[key] = value
    return out


def _packing_differs(model_state: dict[str, Any], metadata: Any) -> str | None:
    """Why the checkpoint ``metadata`` describes cannot load into ``model_state`` (``_unpack``'s) where one side
    holds a packed projection (GPT-2's ``c_attn``) as its projections, ``<name>.packed<i>`` (saved under tensor
    parallelism, of any degree), and the other whole (without it): DCP would only say a key is missing. None
    where they agree."""
    saved = metadata.state_dict_metadata.keys()
    for key in model_state:
        name = key.removesuffix(f"{PACKED}0")
        if name != key and f"model.{key}" not in saved and f"model.{name}" in saved:
            return (
                f"it holds {name} whole (saved without tensor parallelism), which this run splits over its "
                "tensor-parallel ranks: resume it without tensor parallelism"
            )
        if name == key and f"model.{key}" not in saved and f"model.{key}{PACKED}0" in saved:
            return (
                f"it holds {name} as its packed projections (saved under tensor parallelism), which this run "
                "holds whole: resume it with tensor parallelism (a degree that divides the heads)"
            )
    return None


def _groups_only(optim_state: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state dict's parameter-group settings, without the per-parameter state."""
    return {key: value for key, value in optim_state.items() if key.startswith("param_groups.")}


def _dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _read_marker(path: Path, step: int) -> dict | None:
    """The COMPLETE marker of ``path`` when it is valid JSON and names ``step``, else None."""
    try:
        marker = json.loads(read_user_bytes(path / MARKER, "checkpoint marker", limit_bytes=MARKER_LIMIT_BYTES))
    except (BadInput, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("step") != step:
        return None
    if not isinstance(marker.get("world_size"), int) or marker["world_size"] < 1:
        return None
    return marker


def _step_names(directory: Path) -> list[tuple[int, str]]:
    """(step, name) of each checkpoint folder in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path.name))
    return sorted(found, reverse=True)


def _trusted(directory: Path) -> tuple[Trusted | None, str | None]:
    """The checkpoint folder as checked (None: nothing there), or why the checkpoints in ``directory`` may not
    be loaded (someone else could have written them or swapped them)."""
    try:
        return check_trusted(directory, "checkpoint directory"), None
    except BadInput as exc:
        return None, str(exc)


def _checked_step(trusted: Trusted | None, name: str) -> Path | str:
    """The checkpoint ``name`` inside the folder checked, or why not: this rank found no folder to check (its
    view of a folder the ranks should share differs), or the folder was replaced since its check."""
    if trusted is None:
        return "the checkpoint directory was not there when this rank checked it"
    try:
        return trusted.confirm("checkpoint directory") / name
    except BadInput as exc:
        return str(exc)


def _write_synced(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through ``write(file)`` and fsync, so a rename after it never publishes a file still in cache."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _replace_file(path: Path, payload: bytes) -> None:
    """``path`` replaced by ``payload`` atomically (a reader sees the old content or the new, never half) and
    durably: written to a scratch file of this process, fsynced, renamed over it, the directory fsynced."""
    scratch = path.with_name(f"{path.name}.{os.getpid()}")
    _write_synced(scratch, lambda f: f.write(payload))
    os.replace(scratch, path)
    _sync_dir(path.parent)


def _sync_dir(path: Path) -> None:
    """fsync a directory, so a rename in it survives a power loss (not just a killed process)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _pause_for_tests() -> None:
    """The ``REDLINE_TEST_SLOW_SAVE_S`` hook, read at every save: a test kills a process in the middle of one."""
    seconds = float(os.environ.get(REDLINE_TEST_SLOW_SAVE_S) or 0)
    if seconds > 0:
        time.sleep(seconds)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns at every call in a single process that it assumes one; that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


def _one_line(exc: BaseException) -> str:
    """An exception as one short line; of DCP's CheckpointException, which carries each rank's error and
    traceback, the first rank's error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return one_line(exc, limit_chars=240)


def _first_error_of_all_ranks(error: str | None) -> str | None:
    """The first rank's error when any rank failed, on every rank, so all fall back together."""
    if not _distributed():
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def _agreed(outcome: _T | str) -> _T | str:
    """This rank's ``outcome`` when no rank failed (a failure is its error, a str), else the first rank's error,
    on every rank (``_first_error_of_all_ranks``)."""
    error = _first_error_of_all_ranks(outcome if isinstance(outcome, str) else None)
    return outcome if error is None else error


def _rng_states() -> dict[str, Any]:
    """Python's, torch's CPU and (when CUDA is in use) current-device generators, numpy's legacy global one.

    Only the current CUDA device: asking every rank for all devices' states would create a CUDA context on
    every GPU from every rank.
    """
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return states
    legacy = np.random.get_state()  # a tuple: the global generator is an MT19937 (a dict for any other)
    if not isinstance(legacy, tuple):
        return states
    kind, keys, pos, has_gauss, cached_gaussian = legacy
    # as a tensor, so the file loads with torch.load(weights_only=True)
    states["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian)
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if "numpy" in states:
        with contextlib.suppress(ImportError):
            import numpy as np

            kind, keys, pos, has_gauss, cached_gaussian = states["numpy"]
            np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
