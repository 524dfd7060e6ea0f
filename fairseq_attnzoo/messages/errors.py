"""The one exception type for mistakes a user can make with our flags, archs and data.

A :class:`ZooConfigError` message is one line that names the flag (or file) and the fix. In the
fairseq console scripts it is printed as ``fairseq-attnzoo: <message>`` without a traceback
(:mod:`fairseq_attnzoo.messages.one_line`; ``ATTNZOO_TRACEBACK=1`` shows it). It is a
``ValueError``, so code that catches ``ValueError`` keeps working. A plain ``ValueError`` raised by
this package's own code is treated the same way by the console hook, so older validation code
needs no edit.
"""


class ZooConfigError(ValueError):
    """A user error in flags, archs or data: one line naming the flag and the fix."""
