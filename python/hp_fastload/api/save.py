"""Export: ``save(model, path)``, the load run backwards, every rank writing its own regions of the output.

Owns the released layout (keys, shapes and dtypes as transformers' ``save_pretrained`` writes them: tied
tensors dropped and the conversions reverted by transformers' own code, run on meta tensors of the global
shapes, so no data moves), the deterministic file layout (transformers' shard split, safetensors' header and
data order), the temporary sibling directory and its atomic rename, the choice of one writer per replicated
region, the write batches (the load plan of each rank's local shards against the virtual checkpoint, handed
to the engine in the write direction; device shards through pinned double-buffered host slabs), the torch
fallback for targets whose conversion has no exact region inverse, and the cross-rank agreement that makes a
failure on any rank leave nothing at ``path``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from hp_fastload.api.request import plan_request
from hp_fastload.convert.adapter import check_adapter
from hp_fastload.dist.agree import interrupts_between_steps
from hp_fastload.dist.collectives import (
    agree_in_save,
    broadcast_object,
    check_fallbacks_agree,
    check_visible,
    gather_objects,
)
from hp_fastload.errors import PlanError
from hp_fastload.execute.staging import DEFAULT_BATCH_BYTES
from hp_fastload.execute.write import (
    WriteStats,
    create_files,
    finish_files,
    fsync_dir,
    sync_written,
    write_regions,
    write_whole,
)
from hp_fastload.formats import INDEX_NAME
from hp_fastload.model.peft import adapter_tensors, is_peft_model, merged, skeleton, write_adapter_config
from hp_fastload.model.targets import Target, build_targets
from hp_fastload.model.wrappers import unwrapped
from hp_fastload.planning import front
from hp_fastload.planning.adapter import AdapterError, released_layout
from hp_fastload.planning.context import LoadContext
from hp_fastload.planning.export import (
    ExportLayout,
    check_coverage,
    check_writers,
    conversions,
    export_layout,
    forward_rules,
    planned_bytes,
)
from hp_fastload.planning.items import LoadPlan
from hp_fastload.runtime import gc_paused, is_rank0
from hp_fastload.source.index import CheckpointIndex


@dataclass
class SaveReport:
    """What ``save`` wrote. ``bytes_written``: this rank's positioned writes (tensor data);
    ``bytes_written_by_rank``: every rank's, indexed by rank. ``fallbacks``: checkpoint keys whose conversion
    had no exact region inverse, computed with torch from the gathered tensor and written by rank 0."""

    path: str
    files: list[str]
    tensors: int
    total_bytes: int
    bytes_written: int
    bytes_written_by_rank: list[int]
    fallbacks: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"saved {self.tensors} tensors in {len(self.files)} files ({self.total_bytes / 1e9:.3f} GB) to "
            f"{self.path} in {self.seconds:.2f} s; this rank wrote {self.bytes_written / 1e9:.3f} GB"
            + (f"; {len(self.fallbacks)} tensors through torch" if self.fallbacks else "")
        )


def _check_destination(path: Path, overwrite: bool) -> None:
    if path.is_symlink():  # the swap would replace the link, not what it points to
        raise FileExistsError(
            f"{path} is a symbolic link (to {os.readlink(path)}); refusing to replace it: pass the directory it "
            "points to"
        )
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory; refusing to replace it")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise FileExistsError(f"{path} is a non-empty directory; pass overwrite=True to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)  # as save_pretrained's makedirs


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two directory entries (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc != 0:
        errno = ctypes.get_errno()
        if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the file system cannot exchange
            return False
        raise OSError(errno, os.strerror(errno), str(b))
    return True


def _publish(tmp: Path, path: Path, overwrite: bool) -> None:
    """Moves the finished ``tmp`` to ``path``: a plain rename, or, over an existing directory, an atomic
    exchange (the old directory is removed only once the new one is in place and its entry synced).

    Without ``RENAME_EXCHANGE`` the old directory is moved aside first; if moving the new one in then fails,
    the old one is put back before the error propagates. Once the new directory is at ``path`` the save has
    succeeded: an old directory that cannot be removed is left (hidden, next to ``path``) with a warning."""
    _check_destination(path, overwrite)  # again: something may have appeared there while the ranks wrote
    if not path.exists() or not any(path.iterdir()):
        os.rename(tmp, path)  # over an empty directory too: rename(2) replaces it atomically
        fsync_dir(path.parent)
        return
    if _exchange(tmp, path):
        old = tmp  # tmp now holds the previous directory
    else:
        old = path.with_name(f".{path.name}.hp_old-{secrets.token_hex(4)}")
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)  # the user's directory back at path
            raise
    fsync_dir(path.parent)  # the new entry durable before the previous directory goes
    try:
        shutil.rmtree(old)
    except OSError as exc:
        warnings.warn(
            f"hp_fastload.save: the checkpoint is at {path}, but its previous directory could not be removed "
            f"and is left at {old} ({exc})",
            stacklevel=3,
        )


@interrupts_between_steps()
@gc_paused()
def save(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    weights_mapping: Iterable[Any] | None = None,
    overwrite: bool = False,
    threads: int | None = None,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    state_dict_adapter: Any = None,
    adapter_only: bool = False,
    adapter_name: str = "default",
    merge: bool = False,
) -> SaveReport:
    """Write ``model`` as a Hugging Face checkpoint at ``path``: what ``save_pretrained`` of the gathered
    model writes, without gathering. Every rank of the default process group calls it together.

    Keys, shapes and dtypes are the released ones (ties removed, conversions reverted by transformers, from
    ``weights_mapping``, else ``model._weight_conversions``, else the model's transformers mapping); the
    files are split by ``max_shard_size`` as transformers does. Every rank writes the bytes of its own local
    shards into a temporary sibling directory (one replica per replicated region); the directory is renamed
    into place only when every rank succeeded. A failure on any rank raises on every rank and leaves nothing
    at ``path``. An existing non-empty directory is refused unless ``overwrite=True`` (then swapped
    atomically). Returns a :class:`SaveReport`.

    ``state_dict_adapter`` (instead of ``weights_mapping``): any object with torchtitan's ``StateDictAdapter``
    protocol; the files hold the keys, shapes and dtypes its ``to_hf`` gives (after the model's own
    ``state_dict`` hooks, as torchtitan's HF export), and each model tensor's elements go where the traced
    ``from_hf`` (with the model's ``load_state_dict`` pre-hooks) reads them from. Tensors ``to_hf`` does not
    map are not written; a conversion that is not an exact rearrangement raises ``AdapterError``.

    ``adapter_only=True`` (a PEFT model): what peft's ``save_pretrained`` writes for the gathered model, the
    adapter ``adapter_name`` alone: ``adapter_model.safetensors`` (the keys of peft's own
    ``get_peft_model_state_dict``) with ``adapter_config.json`` and the model card, every rank writing the
    regions of its own adapter shards, nothing gathered. ``merge=True`` (a PEFT model): what
    ``save_pretrained`` writes after peft's ``merge_and_unload()`` of the gathered model: each rank adds the
    LoRA delta of its own regions to its base shards (peft's own ``get_delta_weight`` on the gathered factors,
    which are small), the model is saved as a transformers model, and the shards and modules are restored after.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save() needs an nn.Module, got {type(model).__name__}")
    start = time.perf_counter()
    path = Path(os.path.abspath(os.fspath(path)))
    adapter = check_adapter(state_dict_adapter) if state_dict_adapter is not None else None
    if adapter is not None and weights_mapping is not None:
        raise ValueError(
            "state_dict_adapter= converts the whole state dict; it cannot be combined with weights_mapping="
        )
    if merge:
        return _save_merged(model, path, adapter_only, adapter_name, max_shard_size, weights_mapping, overwrite)
    stem = "model"
    peft_model: nn.Module | None = None
    if adapter_only:
        if adapter is not None or weights_mapping is not None:
            raise ValueError(
                "adapter_only=True saves peft's own adapter layout: no weights_mapping or state_dict_adapter"
            )
        peft_model = unwrapped(model)
        if not is_peft_model(peft_model):
            raise TypeError(f"adapter_only=True needs a PEFT model (peft.get_peft_model), got {type(model).__name__}")
        tensors = agree_in_save("Naming the adapter's tensors", lambda: adapter_tensors(peft_model, adapter_name))
        model, weights_mapping, stem, max_shard_size = skeleton(tensors.items()), [], "adapter_model", 1 << 62
    rules = None if adapter is not None else forward_rules(model, weights_mapping)
    agree_in_save("Checking the save destination", lambda: _check_destination(path, overwrite))
    layout: ExportLayout = agree_in_save(
        "Planning the save layout",
        lambda: export_layout(
            model,
            rules,
            max_shard_size,
            None if adapter is None else released_layout(model, adapter, build_targets(model)),
            stem,
        ),
    )
    token, first_path = broadcast_object((secrets.token_hex(6), str(path)))
    tmp = path.with_name(f".{path.name}.hp_save-{token}")
    stats = WriteStats()
    created = done = False
    try:
        created = True
        agree_in_save("Creating the output files", lambda: create_files(tmp, layout) if is_rank0() else None)
        agree_in_save("Finding the output files", lambda: check_visible(tmp, path, first_path))
        planned_pair: tuple[LoadPlan, LoadContext] = agree_in_save(
            "Planning the save",
            # a load of the released layout, not strict (ties, the tensors to_hf does not map)
            lambda: front.plan(
                model,
                CheckpointIndex.open(tmp),
                plan_request(model, weights_mapping=rules, state_dict_adapter=adapter, loader="dcp", strict=False),
            ),
        )
        save_plan, context = planned_pair
        try:
            agree_in_save("Checking the save plan", lambda: check_coverage(save_plan))
            groups, fallback = _fallback_groups(save_plan, context)
            if adapter is not None:
                agree_in_save("Checking the adapter's save", lambda: _exact_only(groups))
            planned = gather_objects(
                agree_in_save("Planning the writers", lambda: planned_bytes(save_plan, context, fallback, groups))
            )
            check_writers(planned, layout)  # the same list on every rank: all raise or none
            check_fallbacks_agree(gather_objects([keys for keys, _ in groups]))  # likewise
            agree_in_save(
                "Writing the checkpoint",
                lambda: write_regions(save_plan, context, fallback, threads, batch_bytes, stats),
            )
            fallbacks = broadcast_object(_run_fallbacks(model, rules, context.index, groups, threads, stats))
            agree_in_save("Syncing the written files", lambda: sync_written(save_plan, stats.files, tmp))
        finally:
            context.index.release_maps()
        if peft_model is not None:
            agree_in_save(
                "Writing the adapter's config",
                lambda: write_adapter_config(peft_model, adapter_name, tmp) if is_rank0() else None,
            )
        agree_in_save("Finishing the checkpoint", lambda: finish_files(tmp, layout, model) if is_rank0() else None)
        agree_in_save("Publishing the checkpoint", lambda: _publish(tmp, path, overwrite) if is_rank0() else None)
        done = True
    finally:
        if created and not done and is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
    by_rank = gather_objects(stats.bytes_written)
    return SaveReport(
        path=str(path),
        files=[f.name for f in layout.files] + ([INDEX_NAME] if layout.index is not None else []),
        tensors=len(layout.released),
        total_bytes=sum(f.size for f in layout.files),
        bytes_written=stats.bytes_written,
        bytes_written_by_rank=[int(b) for b in by_rank],
        fallbacks=list(fallbacks),
        seconds=time.perf_counter() - start,
    )


def _save_merged(
    model: nn.Module,
    path: Path,
    adapter_only: bool,
    adapter_name: str,
    max_shard_size: int | str,
    weights_mapping: Iterable[Any] | None,
    overwrite: bool,
) -> SaveReport:
    peft_model = unwrapped(model)
    if adapter_only or not is_peft_model(peft_model):
        raise ValueError("merge=True saves a PEFT model's base with its adapter merged (not with adapter_only=True)")
    with contextlib.ExitStack() as stack:  # the merge entered on every rank (or none), undone on the way out
        inner = agree_in_save(
            "Merging the adapter into the base shards", lambda: stack.enter_context(merged(peft_model, adapter_name))
        )
        return save(inner, path, max_shard_size=max_shard_size, weights_mapping=weights_mapping, overwrite=overwrite)


def _exact_only(groups: list[tuple[list[str], list[Target]]]) -> None:
    """Through a state-dict adapter every tensor is written by its traced regions: there is no reverse
    conversion to run on gathered tensors (transformers' revert knows nothing of the adapter)."""
    if groups:
        names = ", ".join(t.name for _, targets in groups[:3] for t in targets)
        raise AdapterError(
            f"the state_dict_adapter's conversion of {names} is not an exact rearrangement of elements (an "
            "elementwise op, or an untraced group): it cannot be saved as region writes; use torchtitan's own "
            "export (dcp_save(to_hf=True))"
        )


def _fallback_groups(
    save_plan: LoadPlan, context: LoadContext
) -> tuple[list[tuple[list[str], list[Target]]], set[str]]:
    """Targets the region writes cannot invert exactly: deferred groups (untraceable conversions) and
    region reads with an elementwise post-op. Each entry: (checkpoint keys, targets), in plan order."""
    groups: list[tuple[list[str], list[Target]]] = []
    names: set[str] = set()
    for deferred in save_plan.deferred:
        targets = list({id(t): t for t in map(context.target, deferred.claims.values())}.values())
        groups.append((list(dict.fromkeys(deferred.keys)), targets))
        names.update(t.names[0] for t in targets)
    for name, items in save_plan.region_reads.items():
        if items.post is not None:  # some item has an elementwise post-op
            groups.append((sorted(set(items.keys)), [context.target(name)]))
            names.add(name)
    return groups, names


def _run_fallbacks(
    model: nn.Module,
    rules: list[Any] | None,
    index: CheckpointIndex,
    groups: list[tuple[list[str], list[Target]]],
    threads: int | None,
    stats: WriteStats,
) -> list[str]:
    """Gathers each fallback group's targets (every rank, same order), reverts them with transformers on rank
    0 and writes the checkpoint tensors whole there. Returns the keys written this way (on rank 0; [] on the others).

    One agreement per group: the gathers of a group are collectives, so a rank whose revert or write of a
    group failed must not go on to the next group's gathers while the others wait in the agreement (the
    ranks would sit in different collectives: gloo aborts the process, NCCL hangs)."""
    from transformers.core_model_loading import revert_weight_conversion

    rank0 = is_rank0()

    def one_group(keys: list[str], targets: list[Target]) -> list[str]:
        with torch.no_grad():  # every collective of the group first, then the local work that may fail
            gathered = [t.tensor.full_tensor() if t.is_dtensor else t.tensor.detach() for t in targets]  # type: ignore[attr-defined]
        if not rank0:
            return []
        state = {alias: full.cpu() for target, full in zip(targets, gathered, strict=True) for alias in target.names}
        with conversions(model, rules):
            reverted = revert_weight_conversion(cast(Any, model), state)
        missing = [key for key in keys if key not in reverted]
        if missing:
            raise PlanError(f"the reverse conversion of {', '.join(t.name for t in targets)} did not give {missing}")
        write_whole(index, {key: reverted[key] for key in keys}, threads, stats)
        return keys

    written: list[str] = []
    for keys, targets in groups:
        written.extend(
            agree_in_save(f"Writing {keys[0]} (converted with torch)", lambda k=keys, t=targets: one_group(k, t))
        )
    return written
