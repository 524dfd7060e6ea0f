"""What a user reads when something is wrong, in one place.

* :mod:`.errors`: :class:`~.errors.ZooConfigError`, the one exception type for mistakes a user can
  make with our flags, archs and data (one line naming the flag and the fix).
* :mod:`.one_line`: the line a console script ends with instead of a traceback (our errors, the
  hints, Ctrl-C in fairseq-train).
* :mod:`.hints`: the hint rules, one line each for a fairseq/torch error a user causes.
* :mod:`.parser_hints`: what a one-line parser error adds (the closest arch or flag, the task).
* :mod:`.lengths`: the flags that bound an example's length, noted by the model built last.
* :mod:`.command`: what the messages know of the running command (its name, its flags).

The compat rows that hook these lines into fairseq's commands (the excepthook, the parsers) are
in :mod:`fairseq_attnzoo.compat.console`. This package imports nothing else of ours but the
checkpoint readers (:mod:`fairseq_attnzoo.checkpoints`).
"""
