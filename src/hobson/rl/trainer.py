"""The training side of the RL loop: one model (actor or critic) under DeepSpeed, or plain torch.

DeepSpeed is the default (``--trainer deepspeed``): ZeRO stage 0, a torch optimizer object
(SGD without momentum unless configured; DeepSpeed's own "AdamW" would compile FusedAdam), a
constant LambdaLR, fp32 or fp16 with a static loss scale (128) and fp32 master weights.
``--trainer torch`` runs the same steps with a plain optimizer, for CPU tests only (fp32 only).

DeepSpeed needs ``RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT`` even for one process (else
it looks for mpi4py); :func:`single_process_env` sets them when absent, on a free port so
concurrent runs on one host never collide.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from hobson.errors import ConfigError


@contextlib.contextmanager
def single_process_env() -> Iterator[None]:
    """Set the rendezvous variables DeepSpeed needs, if absent, for the duration of an initialize.

    They are removed again afterwards, so that processes this one starts later (tests, launchers)
    do not inherit a port that this process's group still holds. A second initialize in the same
    process finds the group already up and needs no rendezvous.
    """
    added = []
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        added.append("MASTER_PORT")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        if key not in os.environ:
            os.environ[key] = value
            added.append(key)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def build_optimizer(name: str, params: Any, lr: float, args: dict[str, Any]) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer {name!r} is not a torch.optim class (e.g. SGD, AdamW)")
    if name == "SGD":
        args = {"momentum": 0.0, **args}  # the anchor's default: plain SGD
    return cls(params, lr=lr, **args)


def _constant(_: int) -> float:
    # a module-level function (not a lambda) so the scheduler's state_dict pickles
    return 1.0


class ModelTrainer:
    """forward / backward / step for one model; ``state_dict`` holds optimizer, scheduler, loss scaler."""

    def __init__(
        self,
        module: nn.Module,
        *,
        backend: str,
        precision: str,
        optimizer: str,
        optimizer_args: dict[str, Any],
        lr: float,
        loss_scale: float,
        micro_batch: int,
        recompute: bool,
        grad_clip: float = 0.0,
    ) -> None:
        self.backend = backend
        self.grad_clip = grad_clip
        self.precision = precision
        module.gradient_checkpointing = recompute
        params = [p for p in module.parameters() if p.requires_grad]
        opt = build_optimizer(optimizer, params, lr, optimizer_args)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _constant)
        if precision == "fp16" and next(module.parameters()).device.type == "cpu":
            # DeepSpeed's CPU accelerator refuses fp16 ("Type fp16 is not supported on your device")
            raise ConfigError("fp16 training needs a CUDA device; on CPU use --precision fp32")
        if backend == "deepspeed":
            import deepspeed

            config: dict[str, Any] = {
                "train_micro_batch_size_per_gpu": micro_batch,
                "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 0},
                "zero_allow_untested_optimizer": True,
                # global-norm clip of the unscaled gradients before the step (0: none)
                "gradient_clipping": float(grad_clip),
                "steps_per_print": 1 << 30,
                "wall_clock_breakdown": False,
            }
            if precision == "fp16":
                # static scale (loss_scale != 0 disables dynamic scaling). DeepSpeed's FP16 optimizer
                # keeps fp32 master weights and turns each step's fp16 gradients into fp32 before
                # the update; with gradient_accumulation_steps 1 nothing accumulates in fp16.
                # (ZeRO 0 refuses grad_accum_dtype fp32 with an fp16 model: "unsupported mix".)
                config["fp16"] = {"enabled": True, "loss_scale": loss_scale}
            with single_process_env():
                engine, ds_opt, _, ds_sched = deepspeed.initialize(
                    model=module, optimizer=opt, lr_scheduler=sched, config=config
                )
            self.engine: Any = engine
            self.module: nn.Module = engine.module
            self.optimizer: Any = ds_opt
            self.scheduler: Any = ds_sched
        elif backend == "torch":
            if precision != "fp32":
                raise ConfigError("the plain torch trainer runs fp32 only")
            self.engine = module
            self.module = module
            self.optimizer = opt
            self.scheduler = sched
        else:
            raise ConfigError(f"trainer {backend!r}: supported deepspeed, torch")

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.engine(*args, **kwargs)

    def train(self) -> None:
        self.engine.train()

    def backward(self, loss: Tensor) -> None:
        if self.backend == "deepspeed":
            self.engine.backward(loss)
        else:
            loss.backward()

    def grad_norm(self) -> float:
        """L2 norm of the (unscaled) gradients now held, before any clipping; call between backward and step."""
        scale = self.loss_scale() or 1.0
        total = 0.0
        for p in self.module.parameters():
            if p.grad is not None:
                total += float(p.grad.detach().float().pow(2).sum())
        return total**0.5 / scale

    def step(self) -> None:
        if self.backend == "deepspeed":
            self.engine.step()  # optimizer step, scheduler step, zero_grad
        else:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

    def loss_scale(self) -> float | None:
        scaler = getattr(self.optimizer, "cur_scale", None)
        return float(scaler) if scaler is not None else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loss_scale": self.loss_scale(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
