"""PEFT models seen under the names of the checkpoints they load from and save to.

A PEFT model (``peft.get_peft_model``) wraps a transformers model as ``base_model.model.<...>`` and each targeted
module as a tuner layer: ``<name>.base_layer`` (the original module) next to the adapter's own modules
(``lora_A.<adapter>``, ``lora_B.<adapter>``, ...); ``modules_to_save`` wraps a module as ``original_module`` next
to one trained copy per adapter. Two checkpoints fill such a model, each under its own names:

- the **base** checkpoint (``model.safetensors``) holds the inner model's tensors under the inner model's names,
  before its conversion rules: a tuner layer's ``base_layer`` and a wrapper's ``original_module`` are forwarding
  children no checkpoint names (as ``torch.compile``'s ``_orig_mod``), and the adapters are in no base checkpoint;
- the **adapter** checkpoint (``adapter_model.safetensors``) holds what peft's own ``get_peft_model_state_dict``
  gives: the adapter's tensors under names without the adapter's name, the ``modules_to_save`` copies under
  their module's name.

This module builds, for each, a *skeleton*: a plain ``nn.Module`` tree that registers the model's own tensor
objects (DTensor shards or plain) under the checkpoint's names, so that planning, reading and saving run on it as
on any module and write the model's memory. It never copies or reallocates a tensor. It does not resolve
conversion rules (``convert``) or read anything.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_fastload.errors import AdapterMismatchError, TargetError
from hp_fastload.model.wrappers import WRAPPED_CHILDREN, own_class


def _peft_class(module: str, name: str) -> Any:
    if "peft" not in sys.modules:  # a PEFT model implies peft is imported
        return None
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError):  # pragma: no cover - another peft layout
        return None


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (under ``fully_shard``'s class swap too)."""
    cls = _peft_class("peft.peft_model", "PeftModel")
    return cls is not None and isinstance(model, cls)


def _is_tuner_layer(module: nn.Module) -> bool:
    cls = _peft_class("peft.tuners.tuners_utils", "BaseTunerLayer")
    return cls is not None and isinstance(module, cls)


def _is_auxiliary_wrapper(module: nn.Module) -> bool:
    cls = _peft_class("peft.utils.other", "AuxiliaryTrainingWrapper")
    return cls is not None and isinstance(module, cls)


def inner_model(peft_model: Any) -> nn.Module:
    """The transformers model a PEFT model wraps (``get_base_model()``), whose conversion rules the base
    checkpoint follows."""
    if _peft_config(peft_model).is_prompt_learning:
        raise TargetError(
            f"{type(peft_model).__name__}: prompt-learning adapters ({_peft_config(peft_model).peft_type}) keep their "
            "virtual tokens outside the model's modules; only adapters injected into modules (LoRA and the other "
            "tuners) are supported"
        )
    return peft_model.get_base_model()


def _peft_config(peft_model: Any, adapter_name: str | None = None) -> Any:
    configs = peft_model.peft_config
    name = adapter_name if adapter_name is not None else peft_model.active_adapter
    if name not in configs:
        raise TargetError(f"the PEFT model has no adapter {name!r} (its adapters: {', '.join(map(repr, configs))})")
    return configs[name]


def refuse_quantized_base(peft_model: Any) -> None:
    """QLoRA: a base model quantized by bitsandbytes keeps packed 4-bit / 8-bit parameters that only its own
    quantizer fills; hp_fastload loads float models (and FP8/MXFP4 checkpoints into them)."""
    inner = peft_model.get_base_model()
    quantizer = getattr(inner, "hf_quantizer", None)
    packed = [type(t).__name__ for t in inner.parameters() if type(t).__module__.startswith("bitsandbytes")][:1]
    if quantizer is not None or packed:
        what = type(quantizer).__name__ if quantizer is not None else packed[0]
        raise TargetError(
            f"the PEFT model's base is quantized ({what}: QLoRA): its packed parameters are filled by its own "
            "quantizer, not from a float checkpoint; load the base with transformers' from_pretrained "
            "(quantization_config=...) before get_peft_model, or fine-tune a float base (bf16) with hp_fastload"
        )


def resharded(model: nn.Module) -> None:
    """Put every ``fully_shard`` module of ``model`` back in its sharded state. A root module keeps its parameters
    unsharded after a forward (FSDP2 skips the root's reshard, expecting a backward), and while unsharded the
    registered parameters are the gathered tensors: the views built here must name the sharded ones."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def prefix_of(peft_model: Any, inner: nn.Module) -> str:
    """The name of ``inner`` inside ``peft_model`` (``"base_model.model"`` for LoRA)."""
    for name, module in peft_model.named_modules():
        if module is inner:
            return name
    raise TargetError(f"{type(inner).__name__} is not a submodule of the PEFT model")  # pragma: no cover


@dataclass
class BaseView:
    """The inner model's tensors under the base checkpoint's names, and what the base checkpoint does not fill.

    ``skeleton`` registers the base tensors (parameters and persistent buffers, tied ones under every name).
    ``adapter_keys`` are the PEFT model's adapter tensors (full names, as ``peft_model.named_parameters()``
    gives them), which a base load leaves as they are. ``copies`` pairs each ``modules_to_save`` copy tensor
    (its full name, the tensor) with the original tensor it starts as: peft copies the module when it wraps it,
    so after a base load each copy is filled from its original."""

    skeleton: nn.Module
    adapter_keys: tuple[str, ...]
    copies: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]


def base_view(peft_model: Any) -> BaseView:
    """The :class:`BaseView` of ``peft_model``: walk the inner model, drop the forwarding children of tuner
    layers (``base_layer``) and of ``modules_to_save`` wrappers (``original_module``) from the names, and set
    the adapter modules apart."""
    inner = inner_model(peft_model)
    resharded(peft_model)
    prefix = prefix_of(peft_model, inner)
    base: list[tuple[str, torch.Tensor]] = []
    adapters: list[str] = []
    copies: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
        for key, param in module._parameters.items():
            if param is not None:
                yield key, param
        for key, buf in module._buffers.items():
            if buf is not None and key not in module._non_persistent_buffers_set:
                yield key, buf

    def walk(module: nn.Module, name: str, real: str) -> None:
        base.extend((f"{name}.{key}" if name else key, t) for key, t in tensors(module))
        wrapper = _is_tuner_layer(module) or _is_auxiliary_wrapper(module)
        adapter_children = set(getattr(module, "adapter_layer_names", ())) if wrapper else set()
        for child_name, child in module._modules.items():
            if child is None:
                continue
            child_real = f"{real}.{child_name}" if real else child_name
            if child_name in adapter_children:
                for key, t in child.named_parameters(remove_duplicate=False):
                    adapters.append(f"{child_real}.{key}")
                    if own_class(module).__name__ == "ModulesToSaveWrapper":
                        original = _original_of(module, key)
                        if original is not None:
                            copies.append((f"{child_real}.{key}", t, original))
                continue
            forwarding = child_name in WRAPPED_CHILDREN or (wrapper and child_name in ("base_layer", "original_module"))
            walk(child, name if forwarding else (f"{name}.{child_name}" if name else child_name), child_real)

    walk(inner, "", prefix)
    module: Any = skeleton(base)
    module.config = getattr(inner, "config", None)  # for the config.json comparison of a strict failure
    return BaseView(module, tuple(adapters), tuple(copies))


def _original_of(wrapper: nn.Module, copy_key: str) -> torch.Tensor | None:
    """The tensor of ``wrapper.original_module`` that the copy's ``<adapter>.<name>`` was copied from."""
    _adapter, _, name = copy_key.partition(".")
    original = wrapper.original_module
    assert isinstance(original, nn.Module)
    found = dict(original.named_parameters(remove_duplicate=False)).get(name)
    return found


def adapter_tensors(peft_model: Any, adapter_name: str) -> dict[str, torch.Tensor]:
    """The adapter checkpoint's key -> the model tensor it fills, as peft's own ``get_peft_model_state_dict``
    names them (what ``save_pretrained`` writes and ``PeftModel.from_pretrained`` reads): the model's tensor
    objects themselves, matched by identity. A value peft computes rather than selects (no tensor of the model
    is it) cannot be loaded into or saved from shards: ``TargetError`` naming it."""
    from peft import get_peft_model_state_dict

    _peft_config(peft_model, adapter_name)
    resharded(peft_model)
    state: dict[str, torch.Tensor] = {}
    for name, module in _named_modules_unwrapped(peft_model):
        for key, param in module._parameters.items():
            if param is not None:
                state[f"{name}.{key}" if name else key] = param
        for key, buf in module._buffers.items():
            if buf is not None and key not in module._non_persistent_buffers_set:
                state[f"{name}.{key}" if name else key] = buf
    by_id = {id(t): t for t in state.values()}
    selected = get_peft_model_state_dict(peft_model, state_dict=dict(state), adapter_name=adapter_name)
    out: dict[str, torch.Tensor] = {}
    for key, value in selected.items():
        if id(value) not in by_id:
            raise TargetError(
                f"adapter tensor {key}: peft computes it from the model's tensors instead of selecting one; "
                "it cannot be read into or written from the local shards"
            )
        out[key] = value
    if not out:
        raise TargetError(f"the PEFT model's adapter {adapter_name!r} has no tensors")
    return out


def _named_modules_unwrapped(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``named_modules`` with the names ``state_dict`` gives: forwarding wrapper children
    (:data:`WRAPPED_CHILDREN`) dropped, as their state-dict hooks drop them."""
    canonical: dict[str, str] = {"": ""}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if module_name:
            parent, _, leaf = module_name.rpartition(".")
            above = canonical[parent]
            canonical[module_name] = above if leaf in WRAPPED_CHILDREN else f"{above}.{leaf}" if above else leaf
        yield canonical[module_name], module


def adapter_config(peft_model: Any, adapter_name: str) -> Any:
    """The live ``PeftConfig`` of ``adapter_name``."""
    return _peft_config(peft_model, adapter_name)


def skeleton(named: Iterable[tuple[str, torch.Tensor]]) -> nn.Module:
    """A module tree registering each tensor under its dotted name (parameters as parameters, tensors as
    persistent buffers); one tensor under several names is one tensor (a tie) there too."""
    root = nn.Module()
    for name, tensor in named:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        if isinstance(tensor, nn.Parameter):
            module.register_parameter(leaf, tensor)
        else:
            module.register_buffer(leaf, tensor, persistent=True)
    return root


@torch.no_grad()
def fill_copies(view: BaseView) -> list[str]:
    """Fill each ``modules_to_save`` copy from its original (loaded), shard by shard; return their names.

    peft's copy of a module is the module as it was when wrapped: the base weights. Under FSDP2 and any
    layout that gives the copy its original's placements on the same mesh, each rank copies its own shard;
    a copy laid out otherwise is a ``TargetError`` (load the adapter, which holds the copy, instead)."""
    from torch.distributed.tensor import DTensor

    filled = []
    for name, copy, original in view.copies:
        if isinstance(copy, DTensor) != isinstance(original, DTensor) or copy.shape != original.shape:
            raise TargetError(f"{name}: laid out unlike the module it copies; cannot be filled from its shards")
        if isinstance(copy, DTensor):
            assert isinstance(original, DTensor)
            if copy.device_mesh != original.device_mesh or copy.placements != original.placements:
                raise TargetError(
                    f"{name}: placements {copy.placements} differ from its original's {original.placements}; "
                    "cannot be filled from the local shards"
                )
            copy.to_local().copy_(original.to_local())
        else:
            copy.copy_(original)
        filled.append(name)
    return filled


#: The fields of an adapter's config that decide its tensors' names, shapes or values in the forward: an adapter
#: saved with other values than the model's adapter would load into the wrong places or scale wrongly.
COMPARED_CONFIG_FIELDS = (
    "peft_type",
    "r",
    "lora_alpha",
    "target_modules",
    "target_parameters",
    "exclude_modules",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "use_rslora",
    "bias",
    "lora_bias",
    "fan_in_fan_out",
    "layers_to_transform",
    "layers_pattern",
    "trainable_token_indices",
)


def _normalized(value: Any) -> Any:
    if isinstance(value, set | frozenset | list | tuple):
        return sorted(map(str, value))
    if hasattr(value, "value") and not isinstance(value, int | float | str):  # peft's enums
        return str(value.value)
    return value


def check_adapter_config(saved: dict[str, Any], peft_model: Any, adapter_name: str, where: str) -> None:
    """Raise :class:`AdapterMismatchError` listing every field of :data:`COMPARED_CONFIG_FIELDS` on which the
    saved ``adapter_config.json`` (``saved``) and the model's adapter ``adapter_name`` disagree."""
    live = _peft_config(peft_model, adapter_name).to_dict()
    differences = []
    for field_name in COMPARED_CONFIG_FIELDS:
        if field_name not in saved and field_name not in live:
            continue
        theirs, ours = _normalized(saved.get(field_name)), _normalized(live.get(field_name))
        if theirs != ours:
            differences.append(f"{field_name} {theirs!r} in the file, {ours!r} in the model")
    if differences:
        raise AdapterMismatchError(
            f"the adapter at {where} does not fit the model's adapter {adapter_name!r}: {'; '.join(differences)}. "
            "Wrap the model with the adapter's own config (peft.PeftConfig.from_pretrained(path)), or pass "
            "adapter=path to hp_fastload.from_pretrained, which does"
        )


def check_adapter_keys(file_keys: Iterable[str], model_keys: Iterable[str], where: str) -> None:
    """Raise :class:`AdapterMismatchError` when the adapter file and the model's adapter hold other tensors."""
    file_set, model_set = set(file_keys), set(model_keys)
    missing, extra = sorted(model_set - file_set), sorted(file_set - model_set)
    if missing or extra:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} of the model's adapter tensors are not in the file ({', '.join(missing[:3])})"
            )
        if extra:
            parts.append(f"{len(extra)} tensors of the file are not in the model's adapter ({', '.join(extra[:3])})")
        raise AdapterMismatchError(f"the adapter at {where} does not fit the model: {'; '.join(parts)}")


def write_adapter_config(peft_model: Any, adapter_name: str, directory: Any) -> None:
    """``adapter_config.json`` (and the model card) as peft's ``save_pretrained`` writes them, step for step on the
    live config (its ``target_modules`` set is written in the set's own order, so a copy could order it
    otherwise): the base model's name recorded when the config has none (kept, as peft keeps it),
    ``inference_mode`` True while writing, and the base model's class as ``auto_mapping`` when the config has no
    task type."""
    config = _peft_config(peft_model, adapter_name)
    inner = peft_model.get_base_model()
    card = getattr(peft_model, "create_or_update_model_card", None)
    if callable(card):
        card(str(directory))
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = inner.__dict__.get("name_or_path", None) or None
    auto_mapping = None
    if config.task_type is None:
        base_class = own_class(inner)
        auto_mapping = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    inference_mode = config.inference_mode
    config.inference_mode = True
    try:
        config.save_pretrained(str(directory), auto_mapping_dict=auto_mapping)
    finally:
        config.inference_mode = inference_mode


def _creation_order(inner: nn.Module) -> list[tuple[str, Any]]:
    """The tuner layers in the order peft created them (and drew their initial values): the targeted modules in
    module order, then the targeted parameters (``ParamWrapper``), module by module, each chain of wrappers on
    one module from the innermost (the first parameter wrapped) out."""
    modules: list[tuple[str, Any]] = []
    parameters: list[tuple[str, Any]] = []
    seen: set[int] = set()
    module: Any
    for name, module in inner.named_modules():
        if not _is_tuner_layer(module) or id(module) in seen:
            continue
        if own_class(module).__name__ != "ParamWrapper":
            modules.append((name, module))
            continue
        chain = []
        while _is_tuner_layer(module) and own_class(module).__name__ == "ParamWrapper":
            chain.append((name, module))
            seen.add(id(module))
            name, module = f"{name}.base_layer", module.base_layer
        parameters.extend(reversed(chain))
    return modules + parameters


@torch.no_grad()
def init_adapter(peft_model: Any, adapter_name: str) -> list[str]:
    """Initialize the LoRA adapter ``adapter_name`` of a PEFT model materialized by ``to_empty`` as peft's
    ``get_peft_model`` initializes it on a single process, and return the names written.

    peft creates, per targeted ``Linear`` in module order, ``lora_A = nn.Linear(in, r)`` and ``lora_B =
    nn.Linear(r, out)`` (each drawing its default init) and then resets them (``init_lora_weights``: True is
    Kaiming-uniform A, ``"gaussian"`` is normal A with std 1/r, B zero; False keeps the defaults). The same draws
    are made here on full tensors of the global shapes, in the same order from the same generator, and each
    rank keeps its own region (``distribute_tensor`` without communication): after ``torch.manual_seed(s)`` on
    every rank, the values are those of ``torch.manual_seed(s); get_peft_model(model, config)``, whatever the
    layout. LoRA on ``Linear`` modules and on parameters (``target_parameters``: MoE experts, ``ParamWrapper``)
    is covered; initializations computed from the base weights (PiSSA, OLoRA, EVA, LoftQ, DoRA's magnitudes...),
    embedding and convolution LoRA are refused: initialize on one process, save the adapter, load it."""
    import math

    from torch.distributed.tensor import DTensor, distribute_tensor

    config = _peft_config(peft_model, adapter_name)
    init = getattr(config, "init_lora_weights", None)
    if type(config.peft_type).__name__ != "PeftType" or str(config.peft_type.value) != "LORA":
        raise TargetError(f"initializing a fresh {config.peft_type} adapter on shards is not supported: LoRA only")
    if not (init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")):
        raise TargetError(
            f"init_lora_weights={init!r} computes the adapter from the base weights; on shards only True, False "
            "and 'gaussian' are supported: initialize it on one process, save the adapter, and load it (adapter=)"
        )
    if getattr(config, "use_dora", False):
        raise TargetError("DoRA's magnitudes are computed from the full base weights: initialize on one process")

    def write(tensor: torch.Tensor, full: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor.to_local().copy_(
                distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            )
        else:
            tensor.copy_(full)

    written = []
    for name, module in _creation_order(inner_model(peft_model)):
        if adapter_name not in getattr(module, "lora_A", {}):
            continue
        if own_class(module).__name__ not in ("Linear", "ParamWrapper"):
            raise TargetError(
                f"{name}: {own_class(module).__name__} LoRA cannot be initialized on shards (Linear and experts' "
                "parameters only)"
            )
        lora_a, lora_b = module.lora_A[adapter_name], module.lora_B[adapter_name]
        rank = module.r[adapter_name]
        # the draws peft's own nn.Linear(in, r) and nn.Linear(r, out) make (r x experts for a ParamWrapper)
        (a_out, a_in), (b_out, b_in) = lora_a.weight.shape, lora_b.weight.shape
        full_a = nn.Linear(a_in, a_out, bias=False).weight.detach()
        full_b_module = nn.Linear(b_in, b_out, bias=lora_b.bias is not None)
        full_b = full_b_module.weight.detach()
        if init is True:
            nn.init.kaiming_uniform_(full_a, a=math.sqrt(5))
        elif isinstance(init, str):
            nn.init.normal_(full_a, std=1 / rank)
        if init is not False:
            full_b.zero_()
            if full_b_module.bias is not None:
                full_b_module.bias.detach().zero_()
        # peft moves the fresh factors to the base layer's float dtype, and then casts them to the adapter's
        # (float32 under a bf16 base): the values pass through the base's dtype
        get_param = getattr(module, "get_param", None)  # a ParamWrapper: the wrapped parameter's dtype
        base_weight = get_param() if callable(get_param) else getattr(module.get_base_layer(), "weight", None)
        through = base_weight.dtype if base_weight is not None and base_weight.dtype.is_floating_point else None
        write(lora_a.weight, full_a.to(through or full_a.dtype).to(lora_a.weight.dtype))
        write(lora_b.weight, full_b.to(through or full_b.dtype).to(lora_b.weight.dtype))
        written += [f"{name}.lora_A.{adapter_name}.weight", f"{name}.lora_B.{adapter_name}.weight"]
        if lora_b.bias is not None:
            bias = full_b_module.bias.detach()
            write(lora_b.bias, bias.to(through or bias.dtype).to(lora_b.bias.dtype))
            written.append(f"{name}.lora_B.{adapter_name}.bias")
    return written


@contextlib.contextmanager
def merged(peft_model: Any, adapter_name: str) -> Iterator[nn.Module]:
    """The inner model as peft's ``merge_and_unload()`` would leave it, for the duration of the block: each LoRA
    ``Linear``'s delta (peft's own ``get_delta_weight``, computed on the full adapter factors, which are small)
    added to the base weight's local shard as ``merge`` adds it, each tuner layer replaced by its base layer and
    each ``modules_to_save`` wrapper by the adapter's copy. On exit the modules and the base weights' local
    shards are put back as they were (the original values restored, not the delta subtracted).

    Every rank must enter it together (the adapter factors are gathered). LoRA on parameters (MoE experts),
    DoRA and other variants, and ``lora_bias`` are refused (``TargetError``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    resharded(peft_model)
    inner = inner_model(peft_model)
    tuners = {name for name, m in inner.named_modules() if _is_tuner_layer(m) or _is_auxiliary_wrapper(m)}
    outermost = [
        (name, module)
        for name, module in inner.named_modules()
        if name in tuners and not any(name.startswith(t + ".") for t in tuners)
    ]
    saved_values: list[tuple[torch.Tensor, torch.Tensor]] = []
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        with torch.no_grad():
            for name, module in outermost:
                if _is_auxiliary_wrapper(module):
                    if own_class(module).__name__ != "ModulesToSaveWrapper":
                        raise TargetError(f"{name}: {own_class(module).__name__} cannot be merged on shards")
                    replacement = module.modules_to_save[adapter_name]
                else:
                    if own_class(module).__name__ != "Linear" or getattr(module, "lora_variant", {}).get(adapter_name):
                        raise TargetError(
                            f"{name}: merging {own_class(module).__name__} LoRA (or a variant such as DoRA) on "
                            "shards is not supported: LoRA on Linear modules only"
                        )
                    if module.lora_bias.get(adapter_name):
                        raise TargetError(f"{name}: merging lora_bias on shards is not supported")
                    replacement = module.get_base_layer()
                    if adapter_name in module.lora_A:
                        weight = replacement.weight
                        delta = _delta_weight(module, adapter_name)
                        local = weight.to_local() if isinstance(weight, DTensor) else weight.data
                        if isinstance(weight, DTensor):
                            delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None)
                            delta = delta.to_local()
                        saved_values.append((local, local.clone()))
                        local += delta  # as peft's merge: base_layer.weight.data += delta_weight
                parent_name, _, leaf = name.rpartition(".")
                parent = inner.get_submodule(parent_name) if parent_name else inner
                swapped.append((parent, leaf, module))
                setattr(parent, leaf, replacement)
        yield inner
    finally:
        for parent, leaf, module in reversed(swapped):
            setattr(parent, leaf, module)
        with torch.no_grad():
            for local, original in saved_values:
                local.copy_(original)


def _delta_weight(module: Any, adapter_name: str) -> torch.Tensor:
    """peft's own ``get_delta_weight`` of one LoRA ``Linear``, run on the full (gathered) factors: the factors
    are swapped in for the call and put back."""
    factors = [module.lora_A[adapter_name], module.lora_B[adapter_name]]
    originals = [f._parameters["weight"] for f in factors]
    try:
        for factor, original in zip(factors, originals, strict=True):
            full = original.full_tensor() if hasattr(original, "full_tensor") else original
            factor._parameters["weight"] = nn.Parameter(full.detach(), requires_grad=False)
        delta: torch.Tensor = module.get_delta_weight(adapter_name)
        return delta
    finally:
        for factor, original in zip(factors, originals, strict=True):
            factor._parameters["weight"] = original
