"""One-line hints for common user errors in the fairseq command-line tools.

Installed only when the running program is a fairseq console script and our plugin was loaded
(``--user-dir``). fairseq's traceback is printed unchanged; one line naming the problem and the fix
follows it."""

import os
import sys


def hint_for(exc: BaseException):
    data = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if isinstance(exc, FileNotFoundError):
        missing = exc.filename or ""
        if data and os.path.abspath(str(missing)) == os.path.abspath(data):
            return (f"data directory {data} does not exist: pass the directory written by "
                    "fairseq-preprocess (for the demo corpus run `make data`)")
        if os.path.basename(str(missing)).startswith("dict."):
            return (f"{missing} is missing: {data} is not a binarised fairseq data directory; run "
                    "fairseq-preprocess on your text first (for the demo corpus run `make data`)")
    if "xla_device" in str(exc):  # no torch_xla: fairseq's --bf16 turned on --tpu
        return ("fairseq 0.12's --bf16 implies --tpu (torch_xla) and does not run on GPUs: use "
                "--amp (fp16 autocast, fp32 weights) or --fp16 (docs/precision.md)")
    if "Could not infer language pair" in str(exc):
        return (f"{data} has no binarised language pair (dict.SRC.txt / train.SRC-TGT.*.bin): run "
                "fairseq-preprocess first, or pass --source-lang/--target-lang")
    return None


def install():
    prog = os.path.basename(sys.argv[0] if sys.argv else "")
    if not prog.startswith("fairseq-") or getattr(sys.excepthook, "_attnzoo", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        hint = hint_for(exc)
        if hint:
            print(f"fairseq-attnzoo: {hint}", file=sys.stderr)

    hook._attnzoo = True
    sys.excepthook = hook
