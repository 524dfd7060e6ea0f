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
    # the plain PyTorch modules need torch alone (install your own CPU or CUDA build first and
    # pip keeps it); the fairseq architectures, tasks and commands need the "fairseq" extra. Its
    # fairseq-fixed compiles against the installed torch: install torch, numpy and cython first
    # and pass --no-build-isolation (scripts/install.sh, `make install`)
    install_requires=["torch"],
    extras_require={
        "fairseq": ["fairseq-fixed>=0.12.3", "sacrebleu>=2.0", "sentencepiece"],
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
