"""kvjax: a functional JAX codebase for measuring what a KV cache costs and saves."""

import setuptools

setuptools.setup(
    name="kvjax",
    version="0.1.0",
    description="Functional JAX/Flax LLM inference with explicit, measurable KV caches.",
    packages=setuptools.find_packages(include=["kvjax", "kvjax.*", "configs"]),
    # The CPU decode-attention kernel's source, built on first use
    # (`kvjax.native_attention`; needs a C++ compiler, else the XLA path).
    package_data={"kvjax": ["native/*.cc"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.4.35",
        "flax>=0.10",
        "optax>=0.2",
        "chex>=0.1.87",
        "absl-py>=2.0",
        "ml_collections>=0.1.1",
        "numpy>=1.26",
        "safetensors>=0.4",
        "orbax-checkpoint>=0.6",
        "matplotlib>=3.7",
    ],
    extras_require={
        # Parity tests against the reference implementation: CPU torch only.
        # gguf (pure Python): the GGUF export round trip in tests/test_gguf.py.
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "torch==2.13.0",
                 "transformers>=4.50", "gguf"],
        "bench": ["torch==2.13.0", "transformers>=4.50"],
        "corpus": ["rdata>=1.0"],
        # The llama.cpp peer (experiments/llamacpp_peer.py, tests/test_gguf.py):
        # builds llama.cpp from source (cmake, a C++ compiler).
        "llamacpp": ["llama-cpp-python==0.3.16", "gguf"],
    },
)
