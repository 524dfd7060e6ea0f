"""hydra's override parser, memoised in the processes that run many fairseq commands (tests only).

Every fairseq command composes its config with hydra (``convert_namespace_to_omegaconf``): one
override string a command-line argument -- about 250, most of them the same from one command to
the next (``common.log_interval=100``, ...) -- each parsed by hydra's ANTLR grammar. In a process
that runs many commands in turn (a pytest worker's in-process ``run_cli``, tests/ddp_runner.py's
runs) that parsing was about 40 % of the config's time and the config about half of a DDP test
run's. :func:`memoize_override_parsing` keeps each string's parse (hydra's ``Override``) and
hands out a deep copy of it the next time the same string comes, with the same grammar
functions: the override hydra would have parsed, without parsing it again. A string that does
not parse is parsed every time (hydra raises its own error). Console commands (the
``fairseq-*`` scripts, tests/console_server.py) keep hydra as it ships: they run as a user's
would. tests/test_hydra_testlib.py checks a command's composed config against hydra's own.
"""

import copy


def memoize_override_parsing():
    """Memoise ``OverridesParser.parse_rule`` by (string, rule, grammar functions). Idempotent."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parse_rule = OverridesParser.parse_rule
    if getattr(parse_rule, "memo", None) is not None:
        return
    memo = {}

    def memoized(self, s, rule_name):
        key = (s, rule_name, tuple(sorted(self.functions.functions)))
        if key not in memo:
            memo[key] = parse_rule(self, s, rule_name)
        return copy.deepcopy(memo[key])

    memoized.memo = memo
    memoized.stock = parse_rule  # (hydra's, for the test)
    OverridesParser.parse_rule = memoized
