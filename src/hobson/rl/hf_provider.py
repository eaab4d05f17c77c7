"""A provider for plain HF causal LMs (Llama, Qwen3, ...): enough to publish and serve them.

Publications of plain models go through the same writer (:func:`hobson.rl.publication.publish`)
as the looped ones: ``config.json`` plus safetensors under the model's own ``state_dict`` names,
a tied ``lm_head.weight`` written as its own copy (safetensors refuses shared storage; vLLM and
``from_pretrained`` both accept it). The RL loop does not train these models yet: there is no
critic or trainer-side forward for them (see the report of issue 5).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from hobson.models.common import DEFAULT_MAX_SHARD_BYTES, DTYPE_NAMES, write_checkpoint


class HFCausalLMProvider:
    model_type = "hf-causal-lm"

    def config(self, source: Any) -> Any:
        from transformers import AutoConfig

        return source if not isinstance(source, (str, os.PathLike)) else AutoConfig.from_pretrained(str(source))

    def build_actor(self, config: Any, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()

    def load(self, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu", **_: Any):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()

    def _export_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").clone().contiguous() for k, v in model.state_dict().items()}

    def export(
        self,
        model: nn.Module,
        out_dir: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> list:
        tensors = self._export_tensors(model)
        if dtype is not None:
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        config = model.config.to_dict()
        config["torch_dtype"] = DTYPE_NAMES[dtype or next(model.parameters()).dtype]
        return write_checkpoint(out_dir, tensors, config, max_shard_bytes)
