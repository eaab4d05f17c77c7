"""hobson: a Slurm HPC batch-script suite with a Python launcher for training language models.

Ranges, not pins: GPU images bring their own torch. On a CPU machine install
``torch==2.13.0`` first (the CPU wheel on disk) and repeat that pin in every later pip
command so nothing pulls a multi-GB CUDA build (the README's set-up command does this).
"""

from setuptools import find_packages, setup

CORE = [
    "torch>=2.7",
    "numpy>=1.24",
    "pyyaml>=6.0",
    "tqdm>=4.60",
    "safetensors>=0.4",
    "tokenizers>=0.20",
    "transformers>=4.56",
    "matplotlib>=3.7",
    "submitit>=1.5",
]
TRAIN = ["peft>=0.13", "accelerate>=1.0", "tensorboard>=2.14"]
RL = ["deepspeed>=0.15", "math-verify>=0.7", "tensorboard>=2.14"]
AWS = ["boto3>=1.34"]
# `gpu`: the Triton kernels a CUDA training step picks up when they import (gated_delta_rule: auto,
# chain_kernel: auto); a CPU host has no use for them
GPU = ["flash-linear-attention>=0.6", "liger-kernel>=0.8.5"]
# `serve`: an ASGI framework and its server; httpx is what the tests talk to it with
SERVE = ["starlette>=0.37", "uvicorn>=0.30"]
# pytest-timeout: a hung test fails on its own (with its stacks) instead of stalling CI to its limit
# (not triton, which the decode kernels' CPU test would run in its interpreter: installed beside
# CPU torch it breaks the vLLM overlay, which inherits this site-packages and cannot remove it)
DEV = ["pytest>=8", "pytest-timeout>=2.1", "pytest-xdist>=3.5", "ruff>=0.6", "moto[server]>=5.0", "scipy>=1.10",
       "httpx>=0.27"]

# The launcher, the job entry points and the AWS runner stay top-level folders of the checkout
# (``python launch/submit.py``, ``python -m jobs.<name>`` from the repo root) but are installed
# inside the hobson package, so site-packages gains no ``launch``/``jobs``/``aws`` of its own and
# no code has to put the checkout on sys.path. They are listed by hand: find_packages("src") does
# not see folders outside src/. An editable install (the README's `pip install -e .`) resolves
# them to these folders, so REPO_ROOT (hobson.records) and Path(__file__) stay in the checkout.
PACKAGE_DIR = {
    "hobson.launch": "launch",
    "hobson.launch.backends": "launch/backends",
    "hobson.jobs": "jobs",
    "hobson.aws": "aws",
}

setup(
    name="hobson",
    version="0.1.0",
    description="Slurm batch-script suite with a Python launcher for LM training recipes and RL",
    python_requires=">=3.10",
    package_dir={"": "src", **PACKAGE_DIR},
    packages=[*find_packages("src"), *PACKAGE_DIR],
    include_package_data=True,
    package_data={"hobson.rl": ["default_data.jsonl", "start/*/*"]},
    # `hobson ARGS` is `python launch/submit.py ARGS`; the wrapper exits with main()'s return value
    entry_points={"console_scripts": ["hobson = hobson.launch.submit:main"]},
    install_requires=CORE,
    extras_require={
        "train": TRAIN,
        "rl": RL,
        "aws": AWS,
        "gpu": GPU,
        "serve": TRAIN + SERVE,
        "dev": DEV + TRAIN + RL + AWS + SERVE,
        "all": TRAIN + RL + AWS + SERVE + DEV,
    },
)
