"""TorchRec's ways of choosing the tables' optimizer, as our options: a sharder's `fused_params` and
`apply_optimizer_in_backward(optimizer_class, params, kwargs)` on the collection's parameters.

TorchRec's fused tables take their optimizer from both: the sharder's `fused_params` for every table it
shards, and per table the optimizer class and kwargs that `apply_optimizer_in_backward` attached to the
table's weight (these win). Ours take both too, as `EmbeddingConfig` options: what we have is mapped
(SGD, Adagrad, row-wise Adagrad, Adam; lr, eps, weight decay, Adam's betas, stochastic rounding, the cache
share), what we lack is refused in one line naming it, never dropped.

torchrec is not imported here until an optimizer is given as its class or as fbgemm's `EmbOptimType`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from slipcache.errors import SlipcacheError

# fbgemm's EmbOptimType values (and our own names) -> our optimizer
_OPTIMIZER_NAMES = {
    "sgd": "sgd",
    "exact_sgd": "sgd",
    "adagrad": "adagrad",
    "exact_adagrad": "adagrad",
    "rowwise_adagrad": "rowwise_adagrad",
    "row_wise_adagrad": "rowwise_adagrad",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "exact_rowwise_adagrad": "rowwise_adagrad",
    "adam": "adam",
}
# fused_params keys -> our option (None: handled below)
FUSED_PARAM_KEYS = {
    "optimizer": "optimizer",
    "learning_rate": "lr",
    "lr": "lr",
    "eps": "eps",
    "weight_decay": "weight_decay",
    "weight_decay_mode": None,
    "beta1": "beta1",
    "beta2": "beta2",
    "stochastic_rounding": None,
    "cache_load_factor": "cache_size",
}
# an optimizer class's kwargs: those we map, and those accepted only at the value that changes nothing
_KWARGS = {"lr": "lr", "eps": "eps", "weight_decay": "weight_decay"}
_NEUTRAL_KWARGS: dict[str, Any] = {
    "momentum": 0.0,
    "dampening": 0.0,
    "nesterov": False,
    "lr_decay": 0.0,
    "initial_accumulator_value": 0.0,
    "maximize": False,
    "amsgrad": False,
    "foreach": None,
    "differentiable": False,
    "fused": None,
    "capturable": False,
}


def optimizer_name(value: Any) -> str:
    """Our optimizer for an fbgemm `EmbOptimType`, its value, our own name, or an optimizer class
    (torch's SGD / Adagrad / Adam, TorchRec's SGD / Adagrad / RowWiseAdagrad / Adam)."""
    if isinstance(value, type):
        return _optimizer_of_class(value)
    name = str(getattr(value, "value", value)).lower()
    if name not in _OPTIMIZER_NAMES:
        raise SlipcacheError(
            f"optimizer {name!r} is not offered for slipcache's tables; use one of "
            "EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM (sgd, adagrad, rowwise_adagrad, adam)"
        )
    return _OPTIMIZER_NAMES[name]


def _optimizer_of_class(cls: type) -> str:
    classes: dict[type, str] = {torch.optim.SGD: "sgd", torch.optim.Adagrad: "adagrad", torch.optim.Adam: "adam"}
    try:
        from torchrec import optim as trec_optim

        classes.update(
            {
                trec_optim.SGD: "sgd",
                trec_optim.Adagrad: "adagrad",
                trec_optim.RowWiseAdagrad: "rowwise_adagrad",
                trec_optim.Adam: "adam",
            }
        )
    except ImportError:
        pass
    if cls not in classes:
        raise SlipcacheError(
            f"optimizer {cls.__module__}.{cls.__qualname__} is not offered for slipcache's tables; use "
            "torch.optim.SGD / Adagrad / Adam or torchrec.optim.RowWiseAdagrad"
        )
    return classes[cls]


def fused_params_options(fused_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A sharder's `fused_params` as our options; keys we lack are refused in one line naming them."""
    if not fused_params:
        return {}
    if not isinstance(fused_params, Mapping):
        raise SlipcacheError(f"fused_params must be a dict, got {type(fused_params).__name__}")
    unknown = [str(k) for k in fused_params if k not in FUSED_PARAM_KEYS]
    if unknown:
        raise SlipcacheError(
            f"fused_params {', '.join(map(repr, unknown))} not offered for slipcache's tables "
            f"(offered: {', '.join(FUSED_PARAM_KEYS)})"
        )
    options: dict[str, Any] = {}
    for key, value in fused_params.items():
        target = FUSED_PARAM_KEYS[key]
        if key == "optimizer":
            options["optimizer"] = optimizer_name(value)
        elif key == "weight_decay_mode":
            mode = str(getattr(value, "name", value)).upper()
            if mode not in ("NONE", "L2", "0", "1"):
                raise SlipcacheError(
                    f"fused_params weight_decay_mode {mode} is not offered: slipcache's weight decay is L2 "
                    "(added to the gradient); use WeightDecayMode.L2"
                )
        elif key == "stochastic_rounding":
            options["rounding"] = "stochastic" if value else "nearest"
        elif target is not None:
            options[target] = _number(f"fused_params {key}", value)
    return options


def in_backward_options(param: Any) -> dict[str, Any] | None:
    """The options `apply_optimizer_in_backward` attached to `param` (None: it was not called on it)."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    settings = getattr(param, "_optimizer_kwargs", [{}] * len(classes))
    distinct = {(cls, repr(sorted(kw.items()))) for cls, kw in zip(classes, settings, strict=False)}
    if len(distinct) > 1:
        raise SlipcacheError("apply_optimizer_in_backward was called on a table with two optimizers; give it one")
    cls, kwargs = classes[-1], dict(settings[-1])
    options: dict[str, Any] = {"optimizer": optimizer_name(cls)}
    betas = kwargs.pop("betas", None)
    if betas is not None:
        options["beta1"], options["beta2"] = (_number("betas", b) for b in betas)
    refused = []
    for key, value in kwargs.items():
        if key in _KWARGS:
            options[_KWARGS[key]] = _number(key, value)
        elif key not in _NEUTRAL_KWARGS or value != _NEUTRAL_KWARGS[key]:
            refused.append(f"{key}={value!r}")
    if refused:
        raise SlipcacheError(
            f"apply_optimizer_in_backward({cls.__qualname__}) with {', '.join(refused)} is not offered for "
            "slipcache's tables (offered: lr, eps, weight_decay, betas)"
        )
    return options


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SlipcacheError(f"{name} must be a number, got {value!r}")
    return float(value)
