"""What one model's build hands on to later code (the sublayers' shared state, whether it is a
checkpoint's, the flags that bound its length, the split fairseq filtered last) is scoped to the
thread (or task) that builds it: two models built at once in one process never see each other's.
Each test runs two builds in two threads, in lockstep so that both are open at once."""

import contextvars
import threading
from argparse import Namespace

import fairseq_attnzoo  # noqa: F401  (registers the sublayers)
from fairseq import options, tasks
from fairseq_attnzoo.compat import data
from fairseq_attnzoo.messages.lengths import length_flags, length_limits
from fairseq_attnzoo.models import registry, sublayers
from zoo_testlib import TINY_MT, USER_DIR, build, to_flags


def both_at_once(first, second):
    """Run ``first(meet)`` and ``second(meet)`` in two threads; ``meet()`` waits for the other
    thread's ``meet()`` (each calls it the same number of times). Returns their results."""
    barrier, out, errors = threading.Barrier(2, timeout=30), {}, []

    def run(name, fn):
        try:
            out[name] = fn(barrier.wait)
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(n, f)) for n, f in (("a", first),
                                                                        ("b", second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out["a"], out["b"]


def test_two_builds_share_nothing_between_their_sublayers():
    def build(name):
        def steps(meet):
            with sublayers.sharing_scope() as shared:
                shared["model"] = name
                meet()  # both builds open
                seen = sublayers.current_shared().get("model")
                meet()  # neither closed before the other looked
            return seen, sublayers.current_shared()
        return steps

    assert both_at_once(build("a"), build("b")) == (("a", {}), ("b", {}))


def test_a_checkpoints_build_and_a_command_lines_build_at_once():
    def build(from_checkpoint):
        def steps(meet):
            def build_model(cfg, task, from_checkpoint):
                meet()  # both builds open
                seen = registry.building_from_checkpoint()
                meet()
                return seen
            return registry.noting_origin(build_model)(None, None, from_checkpoint)
        return steps

    assert both_at_once(build(True), build(False)) == (True, False)
    assert registry.building_from_checkpoint() is False


def test_a_models_length_flag_is_not_forgotten_by_another_build():
    """A Synthesizer model notes --synth-max-len; a stock model built meanwhile in another thread
    forgets the limits of the model built before it there, not this one's."""
    plain = Namespace(encoder_layers=1, decoder_layers=1)

    def synthesizer(meet):
        sublayers.validate_sublayer_args(plain)
        sublayers.note_length_limit("--synth-max-len", 10)
        meet()
        meet()  # the other model is built
        return length_flags(10)

    def stock(meet):
        meet()
        sublayers.validate_sublayer_args(plain)
        meet()
        return length_flags(10)

    ours, theirs = both_at_once(synthesizer, stock)
    assert ours == "--synth-max-len (now 10)"
    assert theirs.startswith("--max-source-positions/--max-target-positions")


def test_runs_started_from_one_context_keep_their_own_length_limits():
    """Two runs started from one context (as asyncio starts its tasks: ``copy_context()``), after
    a model was built there: what one run notes is neither in the other's limits nor in the
    context both started from."""
    sublayers.forget_length_limits()  # a model was built in this context before

    def run(flag, value):
        sublayers.note_length_limit(flag, value)
        return length_limits()

    try:
        first = contextvars.copy_context().run(run, "--synth-max-len", 10)
        second = contextvars.copy_context().run(run, "--my-max-len", 20)
        assert (first, second) == ({"--synth-max-len": 10}, {"--my-max-len": 20})
        assert length_limits() == {}
    finally:
        sublayers.forget_length_limits()


def test_two_runs_one_after_the_other_keep_their_own_length_limits(mt_data):
    """One thread, two runs: a Synthesizer model notes --synth-max-len; the stock transformer
    fairseq builds next (``fairseq.models.build_model``, as the compat row
    ``fairseq_model_from_checkpoint`` wraps it) has no limit of ours, so a skipped example of its
    run names fairseq's position flags, not the Synthesizer's."""
    try:
        build("transformer_synth_dense", mt_data, ["--synth-max-len", "32"])
        assert length_limits() == {"--synth-max-len": 32}
        assert length_flags(32) == "--synth-max-len (now 32)"
        stock = options.parse_args_and_arch(options.get_training_parser(), [
            mt_data, "--user-dir", USER_DIR, "--arch", "transformer", "--cpu",
            "--max-source-positions", "32", "--max-target-positions", "32", *to_flags(TINY_MT)])
        tasks.setup_task(stock).build_model(stock)
        assert length_limits() == {}
        assert length_flags(32).startswith("--max-source-positions/--max-target-positions")
    finally:
        sublayers.forget_length_limits()


def test_the_score_line_notes_the_subset_of_its_own_run():
    """Two generations at once: the one whose split lost examples says so on its score line, the
    other (nothing skipped) does not."""
    class Task:
        datasets = {}

    def generation(skip):
        def steps(meet):
            kept = data.reporting_skipped(lambda self, idx, ds, mp, ignore: idx[skip:])
            kept(Task(), list(range(10)), object(), 100)
            meet()  # both filtered
            return data.subset_note()
        return steps

    with_skipped, without = both_at_once(generation(2), generation(0))
    assert with_skipped.startswith(" [a subset: scored 8 of 10 sentences, 2 longer")
    assert without == ""
