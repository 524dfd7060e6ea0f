from setuptools import find_packages, setup

setup(
    name="fairseq-attnzoo",
    version="0.1.0",
    description="Attention and memory variants (AOP, Synthesizer, collaborative MHA, product-key "
    "memory, adaptive span, All-Attention) as fairseq architectures",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="MIT",
    packages=find_packages(include=["fairseq_attnzoo", "fairseq_attnzoo.*"]),
    python_requires=">=3.9",
    # torch is deliberately not a hard requirement: install your own build (CPU or CUDA) first.
    install_requires=["fairseq-fixed>=0.12.3", "sacrebleu>=2.0", "sentencepiece"],
    extras_require={
        "test": ["pytest"],
        "analysis": ["matplotlib", "tensorly", "tqdm"],
    },
    entry_points={
        "console_scripts": [
            "attnzoo-archs = fairseq_attnzoo.cli.archs:main",
            "attnzoo-sample = fairseq_attnzoo.cli.sample:main",
            "attnzoo-average-checkpoints = fairseq_attnzoo.cli.average_checkpoints:main",
            "attnzoo-collab-reparametrize = fairseq_attnzoo.cli.collab_reparametrize:cli_main",
            "attnzoo-plot = fairseq_attnzoo.cli.plot:main",
        ],
    },
)
