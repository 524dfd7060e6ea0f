"""hydra's deprecation warnings in fairseq's config loading (compat entry
``hydra_deprecation_warnings``): about 20 lines on stderr before every command's output."""

import functools
import warnings
from typing import Optional

#: what hydra 1.1-1.3 warns about fairseq 0.12's use of its API and config files (UserWarning)
HYDRA_DEPRECATIONS = (
    r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental",
    r"\s*The version_base parameter is not specified",
    r"In '[^']*': Usage of deprecated keyword in package header",
    r"\s*'[^']*' is validated against ConfigStore schema with the same name",
    r"\s*The strict flag in the compose API is deprecated",
)


def quiet_hydra_deprecations(fn, finds_caller: bool = False):
    """``fn`` (hydra's initialize or compose, as fairseq calls them) without hydra's deprecation
    warnings about fairseq's use of hydra: about 20 lines on stderr before every command's
    output, none of them actionable by a user. Only those messages, only while ``fn`` runs.
    ``finds_caller``: ``fn`` resolves a relative config path from its caller's file
    (``caller_stack_depth``): this wrapper's frame is skipped."""

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        if finds_caller:
            kwargs["caller_stack_depth"] = kwargs.get("caller_stack_depth", 1) + 1
        with warnings.catch_warnings():
            for message in HYDRA_DEPRECATIONS:
                warnings.filterwarnings("ignore", message=message, category=UserWarning)
            return fn(*args, **kwargs)

    return quiet


def hydra_in_fairseq() -> Optional[str]:
    """None when fairseq's config loading calls hydra.experimental's initialize and compose."""
    try:
        import hydra.experimental as experimental
        from fairseq.dataclass import utils
    except ImportError as e:
        return f"target not found ({e})"
    if utils.initialize is experimental.initialize and utils.compose is experimental.compose:
        return None
    return ("fairseq.dataclass.utils does not call hydra.experimental's initialize/compose "
            "(another fairseq version)")
