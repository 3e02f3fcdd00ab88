"""A model's fingerprint: enough to see that a subject changed the models it was handed.

`specaudit.running.guard.ModelGuard` takes one before a decoder call or an engine step and names
what differs after (the contract rule `models-unchanged`), removing the hooks left behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_HOOK_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_hooks")


@dataclass(frozen=True)
class ModelState:
    """A cheap fingerprint of a model: enough to see that a decoder changed it.

    Per tensor: shape, dtype, device, storage address, version counter and float64 sum (one
    reduction per tensor, one device sync in all), so replaced tensors, in-place writes and
    `.data` writes show; plus the config as a dict, the train/eval mode of every module,
    instance-level `forward` overrides and the keys of every hook dict.
    """

    tensors: dict[str, tuple[Any, ...]]
    config: dict[str, Any]
    training: tuple[str, ...]  # modules in training mode
    overrides: tuple[str, ...]  # modules with a `forward` of their own instance
    hooks: dict[tuple[str, str], tuple[int, ...]]  # (module, hook dict) -> hook ids


def model_state(model: torch.nn.Module) -> ModelState:
    named = [(f"parameter {n}", t) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(f"buffer {n}", t) for n, t in model.named_buffers(remove_duplicate=False)]
    with torch.no_grad():
        sums = torch.stack([_tensor_sum(t) for _, t in named]).tolist() if named else []
    tensors = {
        name: (tuple(t.shape), str(t.dtype), str(t.device), t.data_ptr(), _version(t), total)
        for (name, t), total in zip(named, sums)
    }
    modules = list(model.named_modules(remove_duplicate=False))
    config = getattr(model, "config", None)
    return ModelState(
        tensors,
        _config_dict(config),
        tuple(name or "<model>" for name, m in modules if m.training),
        tuple(name or "<model>" for name, m in modules if "forward" in vars(m)),
        {(name or "<model>", d): tuple(getattr(m, d, {})) for name, m in modules for d in HOOK_DICTS},
    )


def _tensor_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.double() if t.is_complex() or t.dtype == torch.bool else t).sum(dtype=torch.float64).cpu()


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return -1


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    try:
        return config.to_dict()
    except Exception:
        return dict(vars(config))


def model_changes(role: str, before: ModelState, model: torch.nn.Module) -> list[str]:
    """What differs between `before` and the model now, one phrase per kind of change."""
    after = model_state(model)
    out: list[str] = []
    for name in sorted(before.tensors.keys() | after.tensors.keys()):
        was, now = before.tensors.get(name), after.tensors.get(name)
        if was != now and not (was and now and was[:5] == now[:5] and _same_sum(was[5], now[5])):
            kind, _, path = name.partition(" ")
            out.append(f"{kind} {_where(role, path)} {_tensor_difference(was, now)}")
    for key in sorted(before.config.keys() | after.config.keys()):
        was, now = before.config.get(key, "<unset>"), after.config.get(key, "<unset>")
        if was != now:
            out.append(f"{role}.config.{key} = {now!r} (was {was!r})")
    if before.training != after.training:
        out.append(f"{role} modules in training mode: {list(after.training)} (were {list(before.training)})")
    if before.overrides != after.overrides:
        out.append(f"{role} forward replaced on the instance of {list(after.overrides)} (was {list(before.overrides)})")
    for (module, kind), ids in after.hooks.items():
        extra = set(ids) - set(before.hooks.get((module, kind), ()))
        if extra:
            what = kind.strip("_").replace("_", " ")[:-1]
            out.append(f"{len(extra)} {what}{'s' if len(extra) > 1 else ''} left on {_where(role, module)}")
    return out


def _where(role: str, path: str) -> str:
    return role if path in ("", "<model>") else f"{role}.{path}"


def _same_sum(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN sums compare equal to themselves


def _tensor_difference(was: tuple[Any, ...] | None, now: tuple[Any, ...] | None) -> str:
    if was is None:
        return "added"
    if now is None:
        return "removed"
    if was[:3] != now[:3]:
        return f"now {list(now[0])} {now[1]} on {now[2]} (was {list(was[0])} {was[1]} on {was[2]})"
    if was[3] != now[3]:
        return "replaced by another tensor"
    return f"written in place (sum {now[5]:.6g}, was {was[5]:.6g})"


def remove_new_hooks(before: ModelState, model: torch.nn.Module) -> int:
    """Remove every hook the decoder left on `model` (so later runs see the model as built)."""
    removed = 0
    for name, module in model.named_modules(remove_duplicate=False):
        for kind in HOOK_DICTS:
            hooks = getattr(module, kind, None)
            if not hooks:
                continue
            for hook_id in set(hooks) - set(before.hooks.get((name or "<model>", kind), ())):
                del hooks[hook_id]
                removed += 1
    return removed


def global_hooks() -> dict[str, tuple[int, ...]]:
    """Ids of torch's global module hooks, which act on every model in the process."""
    from torch.nn.modules import module

    return {kind: tuple(getattr(module, kind, {})) for kind in GLOBAL_HOOK_DICTS}


def global_hook_changes(before: dict[str, tuple[int, ...]]) -> list[str]:
    """Describe and remove global hooks registered since `before`."""
    from torch.nn.modules import module

    out = []
    for kind, ids in before.items():
        hooks = getattr(module, kind, {})
        extra = set(hooks) - set(ids)
        for hook_id in extra:
            del hooks[hook_id]
        if extra:
            out.append(f"{len(extra)} global {kind.strip('_').replace('_', ' ')[7:-1]} left registered")
    return out
