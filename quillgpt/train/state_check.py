"""A resume's training state, typed and shaped before any of it is restored.

torch's loaders trust what they are given: a mis-shaped optimizer moment reaches AdamW's kernel
(a segmentation fault, not an exception), a generator state of the wrong size is a RuntimeError,
a negative token count or an infinite elapsed time resumes and is written into the next
checkpoint. So every part of the state is checked here first, each by one function, and a
damage is one QuillError naming the file and the field (run_dir words the refusal).

    check_resume_file   what the file alone says: config, counters, RNG streams (when it is read)
    check_against       what must fit the run built from it: weights, optimizer, sampler, scaler
"""

from __future__ import annotations

import math
from typing import Any

import torch

from quillgpt.checkpoint import all_finite, clean_state_dict
from quillgpt.config import MAX_INT, config_from_dict, shown_value
from quillgpt.errors import QuillError
from quillgpt.model.lora import is_adapter
from quillgpt.train.distributed import rng_state

MAX_RANKS = 1 << 16  # rank_rng: one stream a rank
PY_STATE_WORDS, MT_WORDS = 625, 624  # random.getstate()'s words (the last is the position); numpy's keys
CUDA_STATE_BYTES = 16  # torch.cuda.get_rng_state(): seed and offset


def damaged(name: str, field: str, problem: str) -> QuillError:
    """The one line every check raises: the file, the field, what is wrong."""
    return QuillError(f"{name}: {field} {problem}, so the training state is damaged")


def _what(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {shown_value(value)}"[:120]


# --- what the file alone says ------------------------------------------------------------------


def check_resume_file(state: dict[str, Any], name: str) -> None:
    """The parts of a resume state that need no model: called once, where ckpt.pt (or an FSDP
    run's train_state.pt) is read, before its config picks the model."""
    check_config(state, name)
    check_counters(state, name)
    check_rng(state, name)


def check_config(state: dict[str, Any], name: str) -> None:
    """The recorded config through config.py's own validation; the state keeps the typed result
    (a resume builds its model from it)."""
    try:
        state["config"] = config_from_dict(state["config"]).to_dict()
    except QuillError as e:
        raise damaged(name, "'config'", f"is not a valid config ({str(e).split('; ')[0]})") from None


def check_counters(state: dict[str, Any], name: str) -> None:
    """Everything a resume writes back into its next checkpoint: counts ≥ 0, times finite."""
    for key in ("step", "tokens_seen"):
        value = state[key]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
            raise damaged(name, repr(key), f"is {_what(value)}, not a count in [0, 2**62]")
    elapsed = state["elapsed_s"]
    if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or not 0 <= elapsed < math.inf:
        raise damaged(name, "'elapsed_s'", f"is {_what(elapsed)}, not a finite number of seconds ≥ 0")
    best = state["best_val_loss"]
    if isinstance(best, bool) or not isinstance(best, (int, float)) or not best >= 0:  # inf: no evaluation yet
        raise damaged(name, "'best_val_loss'", f"is {_what(best)}, not a loss ≥ 0")
    horizon = state.get("horizon")
    if horizon is not None and (not isinstance(horizon, int) or isinstance(horizon, bool) or not 1 <= horizon <= MAX_INT):
        raise damaged(name, "'horizon'", f"is {_what(horizon)}, not a step count ≥ 1 or None")
    if not isinstance(state.get("budget_ended", False), bool):
        raise damaged(name, "'budget_ended'", f"is {_what(state['budget_ended'])}, not true or false")


def check_rng(state: dict[str, Any], name: str) -> None:
    """Every saved random stream has the layout rng_state writes: python's words, numpy's
    MT19937 keys and position, torch's generator bytes (and CUDA's seed and offset)."""
    streams = state.get("rank_rng")
    if streams is None:
        streams = [state["rng"]]
    elif not isinstance(streams, list) or not 1 <= len(streams) <= MAX_RANKS:
        raise damaged(name, "'rank_rng'", f"is {_what(streams)}, not a list of streams (one a rank)")
    template = rng_state(torch.device("cpu"))
    for rank, saved in enumerate(streams):
        field = "'rng'" if "rank_rng" not in state else f"'rank_rng'[{rank}]"
        if not isinstance(saved, dict):
            raise damaged(name, field, f"is {_what(saved)}, not a mapping of random streams")
        check_like({k: v for k, v in saved.items() if k != "cuda"}, template, f"{field}", name)
        _check_words(saved, field, name)
        cuda = saved.get("cuda")
        if "cuda" in saved and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.shape == (CUDA_STATE_BYTES,)):
            raise damaged(name, f"{field}.cuda", f"is {_what(cuda)}, not CUDA's {CUDA_STATE_BYTES}-byte generator state")


def _check_words(saved: dict[str, Any], field: str, name: str) -> None:
    """The values random.setstate and numpy's set_state take: 32-bit words, a position in range."""
    words = saved["python"][1]
    if not all(0 <= w < 2**32 for w in words[:-1]) or not 1 <= words[-1] <= MT_WORDS:
        raise damaged(name, f"{field}.python", "holds words outside 32 bits or a position outside [1, 624]")
    _, keys, pos, has_gauss, _ = saved["numpy"]
    if not bool(((keys >= 0) & (keys < 2**32)).all()) or not 0 <= pos <= MT_WORDS or has_gauss not in (0, 1):
        raise damaged(name, f"{field}.numpy", "holds keys outside 32 bits, a position outside [0, 624] or a bad gauss flag")


def check_like(saved: Any, template: Any, field: str, name: str) -> None:
    """`saved` has the structure of `template` (what the object writes now): the same keys and
    lengths, tensors of the same dtype and shape, numbers finite and counts ≥ 0."""
    if isinstance(template, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.dtype != template.dtype or saved.shape != template.shape:
            raise damaged(name, field, f"is {_what(saved)}, not {_what(template)}")
    elif isinstance(template, dict):
        if not isinstance(saved, dict) or set(saved) != set(template):
            what = _what(saved) if not isinstance(saved, dict) else "a mapping of other keys"
            raise damaged(name, field, f"is {what}, not a mapping of {sorted(map(str, template))}")
        for key, value in template.items():
            check_like(saved[key], value, f"{field}.{key}", name)
    elif isinstance(template, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(template):
            raise damaged(name, field, f"is {_what(saved)}, not a list of {len(template)}")
        for i, (s, t) in enumerate(zip(saved, template, strict=True)):
            check_like(s, t, f"{field}[{i}]", name)
    elif isinstance(template, bool) or isinstance(saved, bool):
        if type(saved) is not type(template):
            raise damaged(name, field, f"is {_what(saved)}, not true or false")
    elif isinstance(template, int):
        if not isinstance(saved, int) or not 0 <= saved <= MAX_INT:
            raise damaged(name, field, f"is {_what(saved)}, not a count in [0, 2**62]")
    elif isinstance(template, float) or template is None:
        if saved is not None and not (isinstance(saved, (int, float)) and math.isfinite(saved)):
            raise damaged(name, field, f"is {_what(saved)}, not a finite number")
    elif saved != template:
        raise damaged(name, field, f"is {_what(saved)}, not {shown_value(template)}")


# --- what must fit the run built from it -------------------------------------------------------


def check_against(
    state: dict[str, Any],
    name: str,
    model: torch.nn.Module,
    optimizer: Any,
    sampler: Any,
    scaler: torch.amp.GradScaler,
    lora: bool,
) -> None:
    """The parts that must fit the model, optimizer, sampler and scaler the run has built: called
    once, before any of them is restored (an FSDP run's weights and optimizer come from its
    shards, which DCP checks against the model)."""
    if "shards" not in state:
        check_weights(state["model"], name, model.state_dict(), lora)
        check_optimizer(state["optimizer"], name, optimizer)
    check_like(state["sampler"], sampler.state_dict(), "'sampler'", name)
    check_scaler(state["scaler"], name, scaler)


def check_weights(saved: dict[str, torch.Tensor], name: str, expected: dict[str, torch.Tensor], lora: bool) -> None:
    """The tensors the model has, each of its shape (a LoRA run's: its adapters only)."""
    saved = clean_state_dict(saved)
    wanted = {k: v for k, v in expected.items() if is_adapter(k)} if lora else expected
    extra, missing = sorted(set(saved) - set(wanted)), sorted(set(wanted) - set(saved))
    if extra or missing:
        which = f"has the extra tensor {shown_value(extra[0])}" if extra else f"lacks the tensor {shown_value(missing[0])}"
        raise damaged(name, "'model'", f"{which} (this run's model {'adapters' if lora else 'weights'} differ)")
    for key, t in wanted.items():
        if saved[key].shape != t.shape:
            raise damaged(name, f"'model'.{shown_value(key)}", f"has shape {tuple(saved[key].shape)}, the model's is {tuple(t.shape)}")


def check_optimizer(saved: Any, name: str, optimizer: Any) -> None:
    """AdamW's (or Muon + AdamW's) state for exactly the parameters it will step."""
    parts = {"adamw": optimizer.adamw, "muon": optimizer.muon} if hasattr(optimizer, "muon") else None
    if parts is None:
        _check_one_optimizer(saved, "'optimizer'", name, optimizer)
        return
    if not isinstance(saved, dict) or set(saved) != set(parts):
        raise damaged(name, "'optimizer'", f"is not train.optimizer=muon's state (keys {sorted(map(str, parts))})")
    for key, part in parts.items():
        _check_one_optimizer(saved[key], f"'optimizer'.{key}", name, part)


def _check_one_optimizer(saved: Any, field: str, name: str, optimizer: torch.optim.Optimizer) -> None:
    """One torch optimizer's state_dict: its groups as the optimizer's own, each state tensor
    finite and shaped as its parameter, each step count finite and ≥ 0."""
    fresh = optimizer.state_dict()
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise damaged(name, field, f"is {_what(saved)}, not an optimizer state (state, param_groups)")
    groups = saved["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(fresh["param_groups"]):
        raise damaged(name, f"{field}.param_groups", f"is not a list of {len(fresh['param_groups'])} groups")
    for i, (group, own) in enumerate(zip(groups, fresh["param_groups"], strict=True)):
        same_params = isinstance(group, dict) and isinstance(group.get("params"), list) and group["params"] == own["params"]
        if not same_params or set(group) != set(own):
            raise damaged(name, f"{field}.param_groups[{i}]", "does not hold this optimizer's keys and parameters")
        for key, value in own.items():
            if key != "params" and not _setting_like(group[key], value):
                raise damaged(name, f"{field}.param_groups[{i}].{key}", f"is {_what(group[key])}, not a setting like {shown_value(value)}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not isinstance(saved["state"], dict):
        raise damaged(name, f"{field}.state", f"is {_what(saved['state'])}, not a mapping of parameter states")
    for index, entry in saved["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params) or not isinstance(entry, dict):
            raise damaged(name, f"{field}.state", f"has an entry {shown_value(index)} that is no parameter's state")
        for key, value in entry.items():
            _check_moment(value, params[index], f"{field}.state[{index}].{shown_value(key)}", name, key == "step")


def _setting_like(value: Any, own: Any) -> bool:
    """A group's setting of the optimizer's own kind: a flag, a finite number, a tuple of them."""
    if isinstance(own, bool) or own is None:
        return value is None or isinstance(value, bool)
    if isinstance(own, (int, float)):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if isinstance(own, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(own) and all(map(_setting_like, value, own))
    return type(value) is type(own)


def _check_moment(value: Any, param: torch.Tensor, field: str, name: str, is_step: bool) -> None:
    """A step count: one finite number ≥ 0; a moment: a finite float tensor of the parameter's shape."""
    if is_step:
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point() else value
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number <= MAX_INT:
            raise damaged(name, field, f"is {_what(value)}, not a finite step count ≥ 0")
        return
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != param.shape:
        raise damaged(name, field, f"is {_what(value)}, not a float tensor of its parameter's shape {tuple(param.shape)}")
    if not all_finite(value):
        raise damaged(name, field, "holds NaN or infinite values")


def check_scaler(saved: Any, name: str, scaler: torch.amp.GradScaler) -> None:
    """fp16's loss scale: the scaler's own keys, positive finite numbers (a disabled scaler reads nothing)."""
    own = scaler.state_dict()
    if not own:
        if not isinstance(saved, dict):
            raise damaged(name, "'scaler'", f"is {_what(saved)}, not a mapping")
        return
    check_like(saved, own, "'scaler'", name)
    if not all(saved[k] > 0 for k in ("scale", "growth_factor", "backoff_factor", "growth_interval")):
        raise damaged(name, "'scaler'", "holds a scale, factor or interval ≤ 0")
