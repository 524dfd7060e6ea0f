"""The generic sweep: every registered zoo arch, no per-arch list to maintain.

For each distinct wiring (``zoo_testlib.wiring``: presets that differ only in sizes the tests
shrink away share one; each preset name still builds and is checked against its wiring's, below),
at tiny sizes: build through fairseq's argument parsing and ``build_model``; forward + backward on a
padded batch; incremental decoding == full forward (also after beam-search reordering);
fairseq-train -> fairseq-generate / fairseq-eval-lm -> resume from checkpoint_last.pt (in ``make
test-fast`` for one arch of each model class and task only). The training run is conftest's
``trained``, shared with the other tests that need a tiny checkpoint of an arch. The 2-process DDP
check is in ``test_ddp.py``, the reduced-precision one in ``test_precision.py``.
"""

import math
import os

import pytest
import torch

from zoo_testlib import (USER_DIR, build, decoder_inputs, eval_flags, hooks, incremental_vs_full,
                         is_lm, json_logs, model_class, one_per_wiring, run_cli, sweep_train_flags,
                         wiring, wirings, zoo_archs)
from zoo_testlib import decode_steps as _decode_steps
from zoo_testlib import lm_extra as _lm_extra
from zoo_testlib import sweep_batch as _batch

ARCHS = zoo_archs()
#: the first arch of each distinct wiring -> every arch of that wiring
WIRINGS = wirings(ARCHS)


def test_sweep_is_not_empty():
    assert "attnzoo_transformer" in ARCHS and "attnzoo_lm" in ARCHS
    assert sorted(a for same in WIRINGS.values() for a in same) == ARCHS
    # size presets share their base's wiring; a preset with another sublayer or option does not
    assert WIRINGS["adaptive_span_lm"] == ["adaptive_span_lm", "adaptive_span_lm_large",
                                           "attnzoo_adaptive_span_lm"]
    assert {"adaptive_span_lm_small", "transformer_aop_h16", "attnzoo_lm_sdpa",
            "transformer_collab_fork"} <= set(WIRINGS)


def _shapes(model):
    return [(n, type(m).__name__) for n, m in model.named_modules()] + [
        (n, tuple(t.shape)) for n, t in model.state_dict().items()]


@pytest.mark.parametrize("arch", ARCHS)
def test_preset_builds_its_wiring(arch, data_for):
    """Every preset name: built from the preset through fairseq (tiny sizes, no training), the
    same modules and parameter shapes -- and so the same parameter count -- as the first arch of
    its wiring, which the checks below run; and at the preset's own sizes (on the meta device:
    shapes, no memory) a model with more parameters than the tiny one."""
    from fairseq import options, tasks

    first = next(a for a, same in WIRINGS.items() if arch in same)
    assert wiring(arch) == wiring(first)
    _, _, model, _ = build(arch, data_for(arch))
    count = sum(p.numel() for p in model.parameters())
    assert count > 0
    if first != arch:
        _, _, ref, _ = build(first, data_for(first))
        assert _shapes(model) == _shapes(ref), f"{arch} is not wired like {first}"
        assert count == sum(p.numel() for p in ref.parameters())
    # the preset's own sizes: every flag of the tiny run but the sizes
    head = [data_for(arch), "--user-dir", USER_DIR, "--arch", arch, "--task",
            model_class(arch).zoo_task, "--cpu"] + list(hooks(arch).flags)
    args = options.parse_args_and_arch(options.get_training_parser(), head)
    task = tasks.setup_task(args)
    with torch.device("meta"):
        full = task.build_model(args)
    assert sum(p.numel() for p in full.parameters()) > count, arch


@pytest.mark.parametrize("arch", one_per_wiring(ARCHS))
def test_forward_backward(arch, data_for):
    args, task, model, criterion = build(arch, data_for(arch), _lm_extra(arch))
    sample = _batch(task, args)
    assert sample["net_input"]["src_tokens"].eq(task.source_dictionary.pad()).any(), \
        "the sweep batch must contain padding"
    model.train()
    loss, sample_size, logging_output = criterion(model, sample)
    assert torch.isfinite(loss), f"{arch}: non-finite loss {loss}"
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{arch}: parameters without gradient: {missing}"
    bad = [n for n, p in model.named_parameters()
           if p.grad is not None and not torch.isfinite(
               p.grad.coalesce().values() if p.grad.is_sparse else p.grad).all()]
    assert not bad, f"{arch}: non-finite gradients in {bad}"


@pytest.mark.parametrize("arch", one_per_wiring(ARCHS))
def test_incremental_matches_full(arch, data_for):
    args, task, model, _ = build(arch, data_for(arch), _lm_extra(arch))
    model.eval()
    sample = _batch(task, args, split="valid")
    net = sample["net_input"]
    with torch.no_grad():
        # 1) the padded training batch, token by token
        tokens, enc = decoder_inputs(model, arch, net)
        diff = incremental_vs_full(model, tokens, enc, task.target_dictionary.pad())
        assert diff <= 1e-5, f"{arch}: incremental vs full max abs diff {diff:.2e}"

        # 2) beam search: beam 2 per sentence, hypotheses swapped / duplicated within each beam
        beam, bsz = 2, tokens.size(0)
        gen = torch.Generator().manual_seed(0)
        hyps = torch.randint(task.target_dictionary.nspecial, len(task.target_dictionary),
                             (bsz * beam, 8), generator=gen)
        hyps[:, 0] = task.target_dictionary.eos()
        new_order = torch.arange(bsz * beam).view(bsz, beam)
        new_order[0::2] = new_order[0::2].flip(1)  # swap
        new_order[1::2, 0] = new_order[1::2, 1]  # duplicate
        new_order = new_order.reshape(-1)
        enc_b = None
        if not is_lm(arch):
            expand = torch.arange(bsz).repeat_interleave(beam)
            enc_b = model.encoder(net["src_tokens"].index_select(0, expand),
                                  src_lengths=net["src_lengths"].index_select(0, expand))
        step_r, hyps_r = _decode_steps(model, hyps, enc_b, new_order, reorder_at=4)
        full_r = model.decoder(hyps_r, encoder_out=enc_b)[0]
        diff_r = (full_r - step_r).abs().max().item()
        assert diff_r <= 1e-5, f"{arch}: after reorder_incremental_state max abs diff {diff_r:.2e}"


@pytest.mark.parametrize("arch", one_per_wiring(ARCHS, all_fast=False))
def test_cli_train_generate_resume(arch, trained, tmp_path):
    run = trained(arch)  # fairseq-train, 3 updates (the run other tests read too)
    data = run.data
    inner = json_logs(run.logs, "train_inner")
    assert [int(r["num_updates"]) for r in inner] == [1, 2, 3], run.logs[-20:]
    assert all(math.isfinite(float(r["loss"])) for r in inner)
    ckpt = run.ckpt
    assert os.path.exists(ckpt)

    cls = model_class(arch)
    if is_lm(arch):
        out = run_cli("eval_lm", [data, "--user-dir", USER_DIR, "--path", ckpt, "--cpu",
                                  "--gen-subset", "valid", "--max-tokens", "400",
                                  "--task", cls.zoo_task]
                      + eval_flags(arch))
        ppl = [line for line in out if "Perplexity" in line or "perplexity" in line.lower()]
        assert ppl, out[-10:]
    else:
        out = run_cli("generate", [data, "--user-dir", USER_DIR, "--path", ckpt, "--cpu",
                                   "--beam", "2", "--max-len-b", "8", "--batch-size", "8",
                                   "--gen-subset", "valid", "--scoring", "sacrebleu"])
        hyps = [line for line in out if line.startswith("H-")]
        assert len(hyps) == 16, out[-10:]
        assert any("BLEU" in line for line in out)

    save = run.copy_to(tmp_path / "ckpt")  # resume a copy: the shared run stays as it is
    logs = run_cli("train", sweep_train_flags(arch, data, save, 5) + ["--restore-file",
                                                                        "checkpoint_last.pt"])
    resumed = [int(r["num_updates"]) for r in json_logs(logs, "train_inner")]
    assert resumed == [4, 5], f"{arch}: resume did not continue from update 3: {resumed}"
