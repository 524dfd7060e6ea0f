"""What a user reads when something is wrong, in one place.

* :mod:`.errors`: :class:`~.errors.ZooConfigError`, the one exception type for mistakes a user can
  make with our flags, archs and data (one line naming the flag and the fix).
* :mod:`.cli_hints`: the fairseq console scripts' excepthook (one line instead of a traceback),
  one-line parser errors, the root logger's level, and the flags that bound an example's length.
* :mod:`.hydra`: hydra's deprecation warnings in fairseq's config loading, filtered.
* :mod:`.known_warnings`: torch's and fairseq's warnings known to be harmless in fairseq's
  commands (pin_memory without an accelerator, fairseq's torch.cuda.amp.autocast), filtered.

The compat entries that change what fairseq prints (``fairseq_cli_hints``,
``fairseq_root_log_level``, ``fairseq_train_parser_one_line``, ``fairseq_parser_one_line``,
``hydra_deprecation_warnings``, ``torch_pin_memory_without_accelerator``,
``fairseq_cuda_amp_autocast``) are rows of the table in :mod:`fairseq_attnzoo.compat.fixes`;
their code is here. This package imports nothing else of ours.
"""
