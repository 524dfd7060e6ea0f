"""Runs ``fairseq-hydra-train`` (fairseq_cli.hydra_train.cli_main, the console script's code)
once per argument list, in this one fresh process: the first run imports our plugin only through
``common.user_dir``, as a user's would; one interpreter start instead of one per config.

    python tests/hydra_runner.py '[["--config-dir", D, "--config-name", N, "k=v", ...], ...]'
"""
import json
import sys

from fairseq_cli import hydra_train


def main():
    for argv in json.loads(sys.argv[1]):
        sys.argv = ["fairseq-hydra-train"] + argv
        print(f"@@ run {argv[3]}", flush=True)
        try:
            hydra_train.cli_main()
        except SystemExit as e:  # hydra exits on a failed job
            if e.code:
                raise
        print(f"@@ done {argv[3]}", flush=True)


if __name__ == "__main__":
    main()
