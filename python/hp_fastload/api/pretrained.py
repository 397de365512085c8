"""``hp_fastload.from_pretrained``: a training script's whole prologue in one call.

Owns the sequence a trainer writes by hand before its first step: read the checkpoint's config, build the
transformers model on the meta device (under transformers' own ``from_pretrained`` init contexts), parallelize
it (the caller's ``parallelize(model)``, or transformers' own ``DistributedConfig`` through the same
``prepare_distribute_model`` / ``maybe_distribute_model`` that transformers applies to its meta model),
materialize it with ``to_empty``, fill it with :func:`hp_fastload.load` (which re-ties tied weights and
recomputes the non-persistent buffers, see ``finalize``) and put it in eval mode, as transformers does. Every
rank calls it with the same arguments. A torchtitan model (``model_factory`` and ``state_dict_adapter``) goes
through torchtitan's trainer's sequence instead: built on meta, parallelized, ``to_empty``, its own
``init_weights``, then the load through the adapter.

It does not read tensors itself, decide regions, or apply conversion rules: ``load`` does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hp_fastload.api.load import load
from hp_fastload.api.peft import adapter_only_repo, base_of_adapter, fill_adapter, peft_wrapper, resolve_adapter_dir
from hp_fastload.dist.agree import agree, interrupts_between_steps, resolve_location_each
from hp_fastload.dist.bounded import agree_bounded
from hp_fastload.errors import CheckpointMismatchError
from hp_fastload.model.finalize import initialize_missing
from hp_fastload.model.peft import inner_model, is_peft_model
from hp_fastload.model.wrappers import unwrapped
from hp_fastload.planning.items import LoadReport
from hp_fastload.runtime import dist_active, interrupts_deferred
from hp_fastload.source.config import read_config
from hp_fastload.source.location import Location
from hp_fastload.source.objstore import ObjectLocation


def _model_class(auto_class: Any) -> Any:
    import transformers

    if auto_class is None:
        return transformers.AutoModelForCausalLM
    if isinstance(auto_class, str):
        found = getattr(transformers, auto_class, None)
        if found is None:
            raise ValueError(f"auto_class={auto_class!r} is not a class of transformers")
        return found
    return auto_class


def _dtype(dtype: Any, config: Any, location: Location) -> torch.dtype:
    """``None`` or ``"auto"``: the config's dtype, else the checkpoint's (:func:`_checkpoint_dtype`), as
    transformers v5's ``from_pretrained`` (whose default is ``"auto"``) chooses."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if dtype is None:
            return _checkpoint_dtype(location)
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype")
    return value


def _checkpoint_dtype(location: Location) -> torch.dtype:
    """transformers' choice for a config without a dtype: the index's ``metadata.dtype``, else the first
    floating dtype (float8/float4 skipped) among the tensors of the first shard in name order (in key order),
    else that shard's first tensor's dtype; float32 for an empty checkpoint. Headers only (and the index: a
    bad one is a ``HeaderError`` naming it)."""
    from hp_fastload.source.index import CheckpointIndex, index_metadata

    if isinstance(location, ObjectLocation):
        index = CheckpointIndex.open(location)
        if not index.files:
            return torch.float32
        first = min(index.files, key=lambda f: location.relative(f.path))
        return _first_dtype(first)
    folder = location if location.is_dir() else location.parent
    if location.is_dir():
        named = index_metadata(folder).get("dtype")
        value = getattr(torch, str(named).removeprefix("torch."), None) if named else None
        if isinstance(value, torch.dtype):
            return value
    index = CheckpointIndex.open(location)
    if not index.files:
        return torch.float32
    first = min(index.files, key=lambda f: os.path.relpath(f.path, folder))
    return _first_dtype(first)


def _first_dtype(first: Any) -> torch.dtype:
    """The first floating dtype (float8/float4 skipped) among ``first``'s tensors in key order, else its first
    tensor's dtype (see ``_checkpoint_dtype``)."""
    dtypes = [first.torch_dtype(key) for key in sorted(first.keys())]
    for value in dtypes:
        if value.is_floating_point and "float8_" not in str(value) and "float4_" not in str(value):
            return value
    return dtypes[0] if dtypes else torch.float32


def _init_contexts(dtype: torch.dtype, cls: Any, config: Any) -> list[Any]:
    """transformers' own model-init contexts of ``from_pretrained``: meta device, ``dtype`` as the default, ties
    deferred until the weights are loaded (a tied lm_head would hide from the tp plan's parameter names), and the
    module fusions ``config.fusion_config`` asks for (transformers >= 5.25: fused modules replace their originals
    while the model is built, their weight transforms load and save the original checkpoint layout; refused on
    older releases, whose own fused loads are wrong)."""
    from transformers import PreTrainedModel

    contexts = list(PreTrainedModel.get_init_context(dtype, False, False, None))
    fusion = getattr(config, "fusion_config", None)
    if not fusion:
        return contexts
    version = getattr(sys.modules.get("transformers"), "__version__", "?")
    try:
        from transformers.fusion_mapping import get_fusion_patch_mapping
        from transformers.models.auto.auto_factory import _get_model_class
        from transformers.monkey_patching import apply_patches
    except ImportError as exc:
        # 5.23 and 5.24 register fusions process-wide, and their own fused loads miss the fused weights (a
        # Qwen2-VL's patch projection is left uninitialized): there is no correct reference to load against
        raise ValueError(
            f"fusion_config={fusion!r}: module fusion loads correctly from transformers 5.25 on; transformers "
            f"{version} is older (pip install 'transformers>=5.25'), or build the model without fusion_config"
        ) from exc
    concrete = _get_model_class(config, cls._model_mapping) if hasattr(cls, "_model_mapping") else cls
    return [*contexts, apply_patches(get_fusion_patch_mapping(concrete, config, fusion))]


def _default_device(bound: Any) -> torch.device:
    if bound is not None:
        return torch.device(bound)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if dist_active() else 0)
    return torch.device("cpu")


@interrupts_between_steps()
def from_pretrained(
    path_or_hub_id: str | os.PathLike[str],
    *,
    parallelize: Callable[[nn.Module], Any] | None = None,
    distributed_config: Any = None,
    device: str | torch.device | None = None,
    dtype: Any = None,
    auto_class: Any = None,
    model_factory: Callable[[], nn.Module] | None = None,
    state_dict_adapter: Any = None,
    revision: str | None = None,
    strict: bool = True,
    share: str | None = None,
    ranks_per_node: int | None = None,
    output_loading_info: bool = False,
    peft_config: Any = None,
    adapter: str | os.PathLike[str] | None = None,
    adapter_name: str = "default",
    is_trainable: bool = False,
    fusion_config: Mapping[str, Any] | None = None,
    **config_overrides: Any,
) -> Any:
    """A parallelized transformers model filled from ``path_or_hub_id``; ``(model, report)`` with
    ``output_loading_info=True``.

    Steps, on every rank: the checkpoint's ``config.json`` (``config_overrides`` applied, as
    ``AutoConfig.from_pretrained`` takes them) → ``auto_class`` (default ``AutoModelForCausalLM``; a class or
    its name) built on the meta device in ``dtype`` (default ``"auto"``: the config's, else the checkpoint's,
    as transformers chooses) → parallelized by ``parallelize(model)`` (FSDP2 / TP / EP, anything that turns
    parameters into DTensors in place; a returned module replaces the model) or by transformers'
    ``DistributedConfig`` (tp, fsdp, ep plans of the model) →
    ``to_empty(device)`` (default: the device transformers bound this rank to, else ``cuda:LOCAL_RANK``, else
    CPU) → :func:`hp_fastload.load` with ``strict`` (tied weights re-tied, non-persistent buffers recomputed
    through the model's own init; with ``strict=False``, what the checkpoint lacks initialized by the model's own
    ``initialize_weights()``, as transformers does; ``share`` and ``ranks_per_node`` as :func:`hp_fastload.load`
    takes them: ``share="job"`` reads each checkpoint byte once per job) → ``eval()``.

    ``fusion_config`` (transformers >= 5.25, as its ``from_pretrained`` takes it; else ``config.fusion_config``;
    a ``ValueError`` on older releases):
    the module fusions the model is built with (``{"patch_embeddings": True}``: Conv3d patch embeddings as one
    flattened Linear); the checkpoint keeps the original layout, read through the fusions' weight transforms.

    A model that is not a transformers one (torchtitan's): ``model_factory`` builds it, called with no
    argument on the meta device (``model_factory=model_config.build``), and ``state_dict_adapter`` (torchtitan's
    ``StateDictAdapter``, e.g. ``Llama3StateDictAdapter(model_config, None)``) maps the checkpoint to it, as
    :func:`hp_fastload.load` takes it. ``config.json`` is then not read (the factory holds the config), so
    ``auto_class``, ``dtype``, ``distributed_config`` and config overrides are refused. The steps are
    torchtitan's trainer's: built on meta → ``parallelize(model)`` (torchtitan's own parallelize function, its
    other arguments bound: ``lambda m: parallelize_llama(m, parallel_dims=..., ...)``) → ``to_empty(device)`` →
    the model's own ``init_weights(buffer_device=None)`` (a torchtitan ``BaseModel``: its buffers, rotary
    caches and MoE counters, and what the adapter does not map, as ``expert_bias``) → the load → ``eval()``.
    Any other module gets no init: its non-persistent buffers are listed in ``LoadReport.unfilled_buffers``.

    PEFT: ``peft_config=LoraConfig(...)`` wraps the meta model with ``get_peft_model`` before ``parallelize``
    (which then lays out the PEFT model), loads the base and initializes the adapter as ``get_peft_model`` does on
    one process (the same values after the same ``torch.manual_seed``); ``adapter=path`` (a directory of
    peft's ``save_pretrained`` or a Hub repo) wraps it with the adapter's own config and reads the adapter
    (:func:`hp_fastload.load_adapter`), trainable with ``is_trainable=True`` (as ``PeftModel.from_pretrained``).
    A ``path`` that holds only an adapter loads its base from the adapter's ``base_model_name_or_path``.

    Not covered: quantized checkpoints, ``device_map`` offloading, remote code; build such a model yourself and
    call ``hp_fastload.load`` on it.
    """
    if parallelize is not None and distributed_config is not None:
        raise ValueError("pass either parallelize or distributed_config, not both")
    if parallelize is not None and not callable(parallelize):
        raise TypeError(f"parallelize must be a callable taking the model, got {type(parallelize).__name__}")
    overrides = config_overrides if fusion_config is None else {**config_overrides, "fusion_config": fusion_config}
    _check_factory(model_factory, auto_class, dtype, distributed_config, overrides)
    if peft_config is not None and adapter is not None:
        raise ValueError("pass either peft_config (a fresh adapter) or adapter (a saved one), not both")
    peft = peft_config is not None or adapter is not None
    if peft and (model_factory is not None or distributed_config is not None):
        raise ValueError(
            "a PEFT adapter needs a transformers model laid out by parallelize= (not model_factory, nor "
            "distributed_config)"
        )
    location = resolve_location_each(path_or_hub_id, revision)
    adapter_dir = agree("Resolving the adapter", lambda: resolve_adapter_dir(adapter, revision)) if adapter else None
    if model_factory is None and adapter is None and peft_config is None:
        only_adapter = agree("Looking for an adapter", lambda: adapter_only_repo(location, path_or_hub_id, revision))
        if only_adapter is not None:  # an adapter repo: its base model, then the adapter
            adapter_dir, peft = only_adapter, True
            location = resolve_location_each(base_of_adapter(only_adapter), None)
    wrap = peft_wrapper(peft_config, adapter_dir, adapter_name, is_trainable) if peft else None
    # Each step that can fail on one rank alone is agreed on: the others raise too instead of waiting in
    # load's first collective.
    if model_factory is None:
        config = agree("Reading the checkpoint's config.json", lambda: read_config(location, config_overrides))
        if fusion_config is not None:
            config.fusion_config = copy.deepcopy(dict(fusion_config))
        _agree_config(config)
    agree("Checking accelerate's settings", refuse_rank0_broadcast)
    # The user's parallelize may enter collectives of its own; if it fails on some ranks only, the others may be
    # waiting in one of them: the outcomes travel through the store, and a failed rank raises within seconds.
    # (So may a torchtitan init_weights: DTensor's random generator agrees on its seed.)
    if model_factory is not None:
        factory = model_factory
        built: tuple[nn.Module, bool] = agree_bounded(
            "Building, parallelizing and initializing the model",
            lambda: _build_from_factory(factory, parallelize, device),
        )
        model, initialized = built
    else:
        model = agree_bounded(
            "Building and parallelizing the model",
            lambda: _build(location, config, auto_class, dtype, parallelize, distributed_config, device, wrap),
        )
        initialized = False
    # an s3:// URL or a path
    report: LoadReport = load(
        model,
        str(location),
        strict=strict,
        state_dict_adapter=state_dict_adapter,
        share=share,
        ranks_per_node=ranks_per_node,
    )
    if initialized:  # the model's own init_weights made its non-persistent buffers, before the load
        report = dataclasses.replace(report, unfilled_buffers=())
    if peft:
        report = fill_adapter(model, adapter_dir, adapter_name, report)
    # strict=False: what the checkpoint does not hold is fresh from to_empty (whatever the allocator left there);
    # transformers initializes it. Agreed on every rank (the collective does not depend on the report).
    agree(
        "Initializing the tensors the checkpoint does not hold",
        lambda: initialize_missing(_transformers_model(model)) if report.missing_keys else None,
    )
    model.eval()
    return (model, report) if output_loading_info else model


def _transformers_model(model: nn.Module) -> nn.Module:
    model = unwrapped(model)
    return inner_model(model) if is_peft_model(model) else model


def refuse_rank0_broadcast() -> None:
    """``ValueError`` when accelerate is set to load ``cpu_ram_efficient_loading``: its ``prepare`` then rebuilds
    the model by broadcasting rank 0's full state dict to the others, the opposite of every rank reading its own
    share (and on a meta model, rank 0 fails inside ``prepare`` while the others wait in its broadcast)."""
    import sys

    if "accelerate" not in sys.modules:
        return
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return
    plugin = AcceleratorState._shared_state.get("fsdp_plugin")
    if plugin is not None and getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "accelerate's FSDP plugin has cpu_ram_efficient_loading=True: its prepare() fills the model by "
            "broadcasting rank 0's full state dict to every rank, the opposite of hp_fastload's reads (each rank "
            "reads only its own shards). Set cpu_ram_efficient_loading=False (FSDP_CPU_RAM_EFFICIENT_LOADING=false, "
            "or fsdp_cpu_ram_efficient_loading: false in accelerate's config); hp_fastload never holds the full "
            "model on any rank"
        )


def _agree_config(config: Any) -> None:
    """Every rank raises :class:`~hp_fastload.CheckpointMismatchError` unless the ranks read the same config
    (``load`` compares the safetensors files, not ``config.json``; node-local copies can differ in it)."""
    if not dist_active() or torch.distributed.get_world_size() == 1:
        return
    mine = hashlib.blake2b(config.to_json_string(use_diff=False).encode(), digest_size=16).hexdigest()
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    with interrupts_deferred():
        torch.distributed.all_gather_object(gathered, mine)
    differing = [rank for rank, digest in enumerate(gathered) if digest != gathered[0]]
    if differing:
        more = f" (and {len(differing) - 1} more ranks)" if len(differing) > 1 else ""
        raise CheckpointMismatchError(
            "the ranks read different configs from the checkpoint's config.json (with config_overrides): rank "
            f"{differing[0]}'s differs from rank 0's{more}. Pass every rank the same checkpoint and the same overrides"
        )


def _check_factory(
    model_factory: Any, auto_class: Any, dtype: Any, distributed_config: Any, config_overrides: dict[str, Any]
) -> None:
    """``model_factory`` is a callable, and none of the arguments it replaces (those that read or apply the
    checkpoint's ``config.json``) is given with it."""
    if model_factory is None:
        return
    if not callable(model_factory) or isinstance(model_factory, nn.Module):
        raise TypeError(
            f"model_factory must be a callable with no arguments that builds the model (e.g. model_config.build), "
            f"got {type(model_factory).__name__}"
        )
    given = [
        name
        for name, value in (("auto_class", auto_class), ("dtype", dtype), ("distributed_config", distributed_config))
        if value is not None
    ]
    given += sorted(config_overrides)
    if given:
        raise ValueError(
            f"model_factory builds the model from its own config; {', '.join(given)} "
            f"{'applies' if len(given) == 1 else 'apply'} to a transformers model built from config.json: "
            "set them in the factory's config (torchtitan: the model config, its parallelize function for dtypes)"
        )


def _is_torchtitan_model(model: nn.Module) -> bool:
    if "torchtitan" not in sys.modules:  # a torchtitan model implies torchtitan is imported
        return False
    try:
        from torchtitan.protocols.model import BaseModel
    except ImportError:  # pragma: no cover - another torchtitan version
        return False
    return isinstance(model, BaseModel)


def _build_from_factory(
    factory: Callable[[], nn.Module], parallelize: Callable[[nn.Module], Any] | None, device: Any
) -> tuple[nn.Module, bool]:
    """The model ``factory`` builds on meta, parallelized, materialized on ``device`` and, for a torchtitan
    model, initialized by its own ``init_weights`` (as torchtitan's trainer does before loading); and whether
    it was."""
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_factory returned {type(model).__name__}, not an nn.Module")
    if parallelize is not None:
        model = _parallelized(model, parallelize)
    model.to_empty(device=device if device is not None else _default_device(None))
    inner = unwrapped(model)
    if not _is_torchtitan_model(inner):
        return model, False
    with torch.no_grad():
        inner.init_weights(buffer_device=None)
    return model, True


def _parallelized(model: nn.Module, parallelize: Callable[[nn.Module], Any]) -> nn.Module:
    """``parallelize(model)`` applied in place; a module it returns replaces the model."""
    returned = parallelize(model)
    return returned if isinstance(returned, nn.Module) else model


def _build(
    location: Location,
    config: Any,
    auto_class: Any,
    dtype: Any,
    parallelize: Callable[[nn.Module], Any] | None,
    distributed_config: Any,
    device: str | torch.device | None,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """The model on meta (wrapped by ``wrap``: a PEFT model), parallelized, materialized on ``device`` (not yet
    filled)."""
    cls = _model_class(auto_class)
    torch_dtype = _dtype(dtype, config, location)
    with contextlib.ExitStack() as stack:
        for context in _init_contexts(torch_dtype, cls, config):
            stack.enter_context(context)
        if hasattr(cls, "from_config"):
            model = cls.from_config(config, dtype=torch_dtype)
        else:
            model = cls._from_config(config, dtype=torch_dtype)
        if wrap is not None:  # on meta: the adapter's modules draw nothing from the generator here
            model.tie_weights()
            model = wrap(model)
    bound = None
    if distributed_config is not None:
        distributed_config, bound, mesh_manager = type(model).prepare_distribute_model(distributed_config)
        model = type(model).maybe_distribute_model(model, distributed_config, mesh_manager)
    elif parallelize is not None:
        model.tie_weights()  # the user's layout sees tied weights as one parameter (FSDP2 cannot tie later)
        model = _parallelized(model, parallelize)
    model.to_empty(device=device if device is not None else _default_device(bound))
    return model
