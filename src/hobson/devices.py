"""A device setting checked against the torch and the machine at hand, before any work starts.

``sbatch sbatch/grpo.sh`` defaults to ``DEVICE=cuda``; on a node with a CPU-only torch that used to
end in a 30-line traceback (``Torch not compiled with CUDA enabled``). :func:`check_device` says
instead which setting asked for what, why it cannot be had here, and what to set.
"""

from __future__ import annotations

import os
import re

from hobson.errors import ConfigError

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(device: str, setting: str, where: str = "") -> None:
    """Raise one :class:`ConfigError` naming ``setting`` (and ``where`` else it is set, e.g. "DEVICE
    in the sbatch scripts") unless ``device`` (cpu, cuda, cuda:N) can be used by this process."""
    import torch

    if where:
        device_s = f"{device} ({setting}; {where})"
    else:
        device_s = str(device)

    if not _DEVICE.match(str(device)):
        raise ConfigError(f"{setting} {device_s!r}: use cpu, cuda or cuda:N")
    if device == "cpu":
        return
    if not torch.backends.cuda.is_built():
        raise ConfigError(f"device {device_s}: this torch ({torch.__version__}) was built without CUDA; set {setting} "
                          "cpu, or install a CUDA build of torch on these nodes")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {device_s}: no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); ask the scheduler for a GPU, "
                          f"or set {setting} cpu")
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {device_s}: this process sees {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); set {setting} to one of them")
