"""Reduced precision: every distinct wiring of the registered archs (``zoo_testlib.wiring``; the
other presets: test_sweep's build check) in bfloat16, in float16 and under bfloat16 autocast.

For each arch (tiny sizes, the sweep's padded batch) and precision, with the SAME weights as the
float32 model:

* eval forward + backward are finite, and the loss per token is within ``LOSS_TOL`` of the float32
  loss (the difference is the dtype's rounding of weights and activations);
* train-mode forward + backward (dropout, batch statistics) are finite;
* incremental decoding matches the full forward in that precision within ``STEP_TOL`` (log-probs);
* a beam search (fairseq's SequenceGenerator through the task) runs and returns finite scores.

Then the method-specific checks the sweep cannot see at tiny sizes (adaptive-span masks at S 8192
with spans above 4096), and the optimizer side: spans stay in range on the parameters the optimizer
really updates under fairseq's FP16Optimizer (flat and per-parameter masters), with any task, and
``fairseq-train --amp --cpu`` (AMPOptimizer) for one arch of each model family.
"""

import argparse
import copy
import math
import os

import pytest
import torch

from zoo_testlib import (USER_DIR, DispatchedOps, build, decode_steps, decoder_inputs, eval_flags,
                         incremental_vs_full, is_lm,
                         json_logs, lm_extra, model_class, one_per_wiring, run_cli, sweep_batch,
                         tiny_flags, tolerance, train_flags, zoo_archs)

from fairseq_attnzoo import compat

ARCHS = zoo_archs()
#: the sweep runs on CPU in `make test`; ATTNZOO_TEST_DEVICE=cuda runs it on a GPU's kernels
DEVICE = torch.device(os.environ.get("ATTNZOO_TEST_DEVICE", "cpu"))

#: precision -> (model dtype, autocast dtype)
PRECISIONS = {
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "autocast_bf16": (torch.float32, torch.bfloat16),
}
#: max |loss per token - fp32 loss per token| (nats); bf16 keeps 8 mantissa bits, fp16 11
#: (measured maxima over all archs: bf16 0.0042, fp16 0.0005, autocast 0.0036)
LOSS_TOL = {"bf16": 0.02, "fp16": 0.003, "autocast_bf16": 0.02}
#: max |log p incremental - log p full| in the same precision (measured: bf16 0.033, fp16 0.0043,
#: autocast 0.020 without a top-k memory). A sublayer may loosen it with a reason, through
#: ``register_sublayer(tolerances={"reduced_precision_step": ...})`` (PKM's top-k: 0.5); in
#: float32 the sweep checks 1e-5 for every arch
STEP_TOL = {"bf16": 0.1, "fp16": 0.02, "autocast_bf16": 0.1}


def _record(line):
    """ZOO_PRECISION_LOG=FILE appends the measured differences (how the tolerances were set)."""
    if os.environ.get("ZOO_PRECISION_LOG"):
        with open(os.environ["ZOO_PRECISION_LOG"], "a") as f:
            f.write(line + "\n")


def _autocast(precision):
    dtype = PRECISIONS[precision][1]
    return torch.autocast(DEVICE.type, dtype=dtype) if dtype is not None else torch.autocast(
        DEVICE.type, enabled=False)


def _cast(model, precision):
    m = copy.deepcopy(model)
    return m.to(device=DEVICE, dtype=PRECISIONS[precision][0])


def _on_device(sample):
    from fairseq import utils

    return utils.apply_to_sample(lambda t: t.to(DEVICE), sample)


def _loss_per_token(model, criterion, sample):
    loss, _, log = criterion(model, sample)
    return loss.float() / log["ntokens"], loss


def _finite_grads(model):
    return [n for n, p in model.named_parameters()
            if p.grad is not None and not torch.isfinite(
                (p.grad.coalesce().values() if p.grad.is_sparse else p.grad).float()).all()]


def _log_probs(out):
    return torch.log_softmax(out.float(), dim=-1)


def _generate(task, model, sample, arch):
    gen_args = argparse.Namespace(beam=2, max_len_a=0, max_len_b=6, min_len=1, nbest=1,
                                  unnormalized=False, lenpen=1.0, unkpen=0.0, temperature=1.0,
                                  match_source_len=False, no_repeat_ngram_size=0, sampling=False)
    generator = task.build_generator([model], gen_args)
    net = sample["net_input"]
    if is_lm(arch):  # a prompt of the first 3 ordinary tokens of every row (no eos/pad)
        special = task.target_dictionary.nspecial
        prompt = torch.stack([row[row >= special][:3] for row in net["src_tokens"]])
        sample = {"id": sample["id"], "net_input": {
            "src_tokens": prompt, "src_lengths": torch.full((prompt.size(0),), 3,
                                                            device=prompt.device)}}
    return task.inference_step(generator, [model], sample)


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("arch", one_per_wiring(ARCHS))
def test_reduced_precision(arch, precision, data_for):
    check_reduced_precision(arch, precision, data_for(arch))


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_reduced_precision_adaptive_span_fused(precision, data_for):
    """The sweep again with the fused band attention forced (on CUDA ``auto`` picks it, so this is
    what GPU users run; on the CPU ``auto`` keeps the explicit path the sweep above checks)."""
    check_reduced_precision("adaptive_span_lm_small", precision,
                            data_for("adaptive_span_lm_small"), ["--adaptive-span-kernel", "sdpa"])


def check_reduced_precision(arch, precision, data, extra=()):
    """``arch`` in ``precision``: loss near fp32, finite gradients in eval and train mode,
    incremental decoding == full forward, finite beam scores."""
    torch.manual_seed(0)
    args, task, model, criterion = build(arch, data, lm_extra(arch) + list(extra))
    sample = _on_device(sweep_batch(task, args))
    model.to(DEVICE).eval()
    with torch.no_grad():
        ref, _ = _loss_per_token(model, criterion, sample)
    m = _cast(model, precision)

    # eval: same function up to rounding; backward finite
    m.eval()
    with _autocast(precision):
        per_token, loss = _loss_per_token(m, criterion, sample)
    assert torch.isfinite(loss), f"{arch} {precision}: non-finite loss"
    diff = abs(float(per_token.detach()) - float(ref))
    _record(f"{arch} {precision} loss {diff:.5f}")
    assert diff <= LOSS_TOL[precision], \
        f"{arch} {precision}: loss/token {float(per_token):.4f} vs fp32 {float(ref):.4f}"
    loss.backward()
    assert not _finite_grads(m), f"{arch} {precision}: non-finite grads {_finite_grads(m)}"

    # train mode (dropout, batch statistics)
    m.train()
    m.zero_grad(set_to_none=True)
    with _autocast(precision):
        _, loss = _loss_per_token(m, criterion, sample)
    assert torch.isfinite(loss), f"{arch} {precision}: non-finite train loss"
    loss.backward()
    assert not _finite_grads(m), f"{arch} {precision}: non-finite train grads {_finite_grads(m)}"

    # incremental decoding == full forward, in this precision
    m.eval()
    valid = _on_device(sweep_batch(task, args, split="valid"))
    with torch.no_grad(), _autocast(precision):
        tokens, enc = decoder_inputs(m, arch, valid["net_input"])
        d = incremental_vs_full(m, tokens, enc, task.target_dictionary.pad(), _log_probs)
        _record(f"{arch} {precision} step {d:.5f}")
        tol = tolerance(args, "reduced_precision_step", STEP_TOL[precision])
        assert d <= tol, f"{arch} {precision}: incremental vs full {d:.3g} > {tol}"

        # beam search
        hyps = _generate(task, m, valid, arch)
    assert len(hyps) == tokens.size(0)
    scores = torch.stack([h[0]["score"].float() for h in hyps])
    assert torch.isfinite(scores).all(), f"{arch} {precision}: beam scores {scores}"


def test_step_tolerance_comes_from_the_registry(data_for):
    """Looser bounds are declared by the sublayer that needs them (PKM's top-k), not by class name
    in this file: a model mixing PKM into any arch gets it, every other arch keeps STEP_TOL."""
    from fairseq_attnzoo.models.sublayers import SUBLAYER_REGISTRY

    from zoo_testlib import parse

    assert SUBLAYER_REGISTRY["pkm"].tolerances == {"reduced_precision_step": 0.5}
    for arch, expected in [("transformer_lm_pkm", 0.5), ("transformer_pkm", 0.5),
                           ("transformer_lm_synth_dense", STEP_TOL["fp16"])]:
        args = parse(arch, data_for(arch), lm_extra(arch))
        assert tolerance(args, "reduced_precision_step", STEP_TOL["fp16"]) == expected, arch


# ---- adaptive span: the mask at long range -------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dynamic", [False, True])
def test_adaptive_mask_equals_fp32_mask_at_long_spans(dtype, dynamic):
    from fairseq_attnzoo.modules.adaptive_span import AdaptiveMask

    S, R = 8192, 32
    z = torch.tensor([5000.0, 4100.0, 8000.0, 6143.5])  # spans above 4096 (fp16: ulp 4 there)
    mask = AdaptiveMask(4, S, R, dynamic=dynamic, embed_dim=8)
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        if dynamic:  # z_t = S sigmoid(v.x + b): v = 0, b = logit(z / S)
            p = (z / S).double()
            mask.span_proj.bias.copy_(torch.log(p / (1 - p)).float())
        else:
            mask.span.copy_(z / S)
    low = copy.deepcopy(mask).to(dtype)
    ref = mask.log_mask(mask.spans(x), S).exp()
    got = low.log_mask(low.spans(x.to(dtype)), S).exp()
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 1e-3
    if not dynamic:
        assert low.span.dtype == torch.float32  # the span keeps float32 resolution
        assert torch.equal(low.spans(), ref.new_tensor(z))


@pytest.mark.parametrize("kernel", ["explicit", "sdpa"])
def test_span_penalty_and_attention_under_autocast(kernel):
    """Under autocast the span, mask and normaliser stay float32; output matches fp32 closely."""
    from fairseq_attnzoo.modules.adaptive_span import AdaptiveSpanAttention

    torch.manual_seed(0)
    att = AdaptiveSpanAttention(16, 2, 64, ramp=8, span_init=0.5, span_loss=1e-3, own_key_pe=True,
                                trim_chunk=8, kernel=kernel)
    x = torch.randn(2, 12, 16)
    ref, _ = att(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = att(x)
        pen = att.mask.loss()
    assert pen.dtype == torch.float32
    assert (out.float() - ref).abs().max().item() < 0.05


# ---- the optimizer side: constraints on the tensors the optimizer updates -----------------------

def _span_lm(lm_data, extra=()):
    """A tiny adaptive-span LM trained with fairseq's plain language_modeling task (no hooks of
    ours) and the span criterion."""
    from fairseq import options, tasks

    argv = [lm_data, "--user-dir", USER_DIR, "--arch", "adaptive_span_lm_small", "--task",
            "language_modeling", "--criterion", "attnzoo_span_loss", "--cpu", "--tokens-per-sample",
            "24", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-layers",
            "2", "--decoder-attention-heads", "2", "--attn-span", "16", "--adaptive-span-ramp", "4",
            "--adaptive-span-loss", "50", "--adaptive-span-init", "0.05", "--optimizer", "adam",
            "--lr", "0.5", "--sample-break-mode", "eos"] + list(extra)
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    torch.manual_seed(0)
    task = tasks.setup_task(args)
    model = task.build_model(args)
    criterion = task.build_criterion(args)
    task.load_dataset("train")
    itr = task.get_batch_iterator(dataset=task.dataset("train"), max_sentences=4, max_tokens=400,
                                  ignore_invalid_inputs=True).next_epoch_itr(shuffle=False)
    return args, task, model, criterion, next(iter(itr))


def _spans(model):
    return [m.span for m in model.modules() if type(m).__name__ == "AdaptiveMask"]


@pytest.mark.parametrize("dtype,flatten", [(torch.float16, True), (torch.float16, False),
                                           (torch.bfloat16, True), (torch.bfloat16, False)])
def test_fp16_optimizer_masters_stay_clamped(lm_data, monkeypatch, dtype, flatten):
    """fairseq's FP16Optimizer (--fp16 / --bf16) with the plain language_modeling task: the span
    penalty (lambda 50) pushes z below 0 every step; the fp32 masters -- what the optimizer updates
    and copies into the model -- must be projected, not only the model copy."""
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    flags = ["--bf16"] if dtype == torch.bfloat16 else ["--fp16"]
    if not flatten:
        flags.append("--fp16-no-flatten-grads")
    args, task, model, criterion, sample = _span_lm(lm_data, flags)
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    cfg = convert_namespace_to_omegaconf(args)
    compat.bf16_without_tpu(cfg, flags)  # as fairseq-train does (--bf16 implied --tpu)
    model = model.to(dtype)
    # fairseq flattens onto torch.cuda.current_device(); on CPU tensors have device.index None
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = FP16Optimizer.build_optimizer(cfg, params)
    assert optimizer.has_flat_params == flatten
    for update in range(3):
        task.train_step(sample, model, criterion, optimizer, update)
        optimizer.multiply_grads(1.0 / float(sample["ntokens"]))
        task.optimizer_step(optimizer, model, update)
        masters = optimizer.fp32_params
        for p in _spans(model):
            assert p.dtype == torch.float32 and float(p.min()) >= 0.0
        if flatten:
            flat = next(iter(masters.values()))
            offset = 0
            for p in params:
                if any(p is s for s in _spans(model)):
                    chunk = flat[offset: offset + p.numel()]
                    assert float(chunk.min()) >= 0.0, f"update {update}: master span {chunk}"
                offset += p.numel()
        else:
            for p, p32 in zip(params, masters):
                if any(p is s for s in _spans(model)):
                    assert float(p32.min()) >= 0.0, f"update {update}: master span {p32}"
    # the penalty drove every span to the bound: exactly 0, not a drifting negative master
    assert all(float(s.abs().max()) == 0.0 for s in _spans(model))


def test_bf16_flat_masters_train_like_per_parameter_masters(lm_data):
    """--bf16: fairseq keeps one fp32 master per parameter (for TPUs) and Adam loops over them;
    compat's fairseq_bf16_flat_masters gives bf16 the flat buffer of --fp16. Three updates with
    flat masters reach the per-parameter run's weights (the same elementwise Adam; only the
    gradient norm sums in another order), and Adam updates one buffer, not every parameter."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    runs = {}
    for flags in ([], ["--fp16-no-flatten-grads"]):
        torch.manual_seed(0)
        args, task, model, criterion, sample = _span_lm(lm_data, ["--bf16"] + flags)
        model = model.to(torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        cfg = convert_namespace_to_omegaconf(args)
        assert compat.bf16_without_tpu(cfg, ["--bf16"] + flags)  # --bf16 implied --tpu
        optimizer = FP16Optimizer.build_optimizer(cfg, params)
        assert optimizer.has_flat_params == (not flags)
        for update in range(3):
            counter = DispatchedOps()
            with counter:
                task.train_step(sample, model, criterion, optimizer, update)
                optimizer.multiply_grads(1.0 / float(sample["ntokens"]))
                optimizer.clip_grad_norm(0.1)
                task.optimizer_step(optimizer, model, update)
            optimizer.zero_grad()
        runs[bool(flags)] = ([p.detach().float().clone() for p in params], counter.n)
    (flat, flat_ops), (per_param, per_param_ops) = runs[False], runs[True]
    assert max((a - b).abs().max().item() for a, b in zip(flat, per_param)) <= 1e-2
    # Adam's update: one addcdiv_ on the flat buffer instead of one per parameter
    assert (flat_ops["addcdiv_"], per_param_ops["addcdiv_"]) == (1, len(flat))
    assert sum(flat_ops.values()) < sum(per_param_ops.values()) - 5 * len(flat)


def test_flat_master_copies_are_one_multi_tensor_copy_each_way(lm_data):
    """compat's fairseq_fp16_flat_sync: with flat masters, the gradient -> master copy and the
    master -> model copy are one ``_foreach_copy_`` each (fairseq: a slice, a view and a copy_ per
    parameter), with exactly fairseq's values: each gradient in its slice (zeros for a parameter
    without one) and each master slice rounded into its parameter."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    args, task, model, criterion, sample = _span_lm(lm_data, ["--bf16"])
    cfg = convert_namespace_to_omegaconf(args)
    compat.bf16_without_tpu(cfg, ["--bf16"])
    model = model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = FP16Optimizer.build_optimizer(cfg, params)
    assert optimizer.has_flat_params and len(params) > 10
    g = torch.Generator().manual_seed(0)
    for i, p in enumerate(params):
        p.grad = None if i == 3 else torch.randn(p.shape, generator=g).to(p.dtype)
    optimizer._needs_sync = True
    with DispatchedOps() as grads_ops:
        optimizer._sync_fp16_grads_to_fp32()
    flat = next(iter(optimizer.fp32_params.values()))
    expected = torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.float().reshape(-1)
                          for p in params])
    assert torch.equal(flat.grad, expected)
    with torch.no_grad():
        flat.copy_(torch.randn(flat.shape, generator=g))
    with DispatchedOps() as params_ops:
        optimizer._sync_fp32_params_to_fp16()
    offset = 0
    for p in params:
        assert torch.equal(p.detach(), flat.detach()[offset: offset + p.numel()].view_as(p).to(p.dtype))
        offset += p.numel()
    assert grads_ops.n["copy_"] == 0 and grads_ops.n["_foreach_copy_"] == 1, grads_ops.n
    assert grads_ops.n["_foreach_zero_"] == 1
    assert params_ops.n["copy_"] == 0 and params_ops.n["_foreach_copy_"] == 1, params_ops.n


def test_spans_projected_by_their_model_after_each_trainer_update(lm_data):
    """fp32 / --amp / --memory-efficient-fp16: the optimizer steps the model's own parameters and
    fairseq's trainer calls the model after every update, which projects its spans (the penalty
    drives them to 0, not below). Nothing else is hooked: a plain torch optimizer stepping the
    same spans leaves them out of range (no global optimizer hook)."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer
    from torch.optim import optimizer as torch_optimizer

    args, task, model, criterion, sample = _span_lm(lm_data)
    trainer = Trainer(convert_namespace_to_omegaconf(args), task, model, criterion)
    for _ in range(3):
        trainer.train_step([sample])
    assert all(float(s.min()) == 0.0 and float(s.max()) <= 1.0 for s in _spans(model))
    assert not torch_optimizer._global_optimizer_post_hooks
    opt = torch.optim.SGD(model.parameters(), lr=10.0)
    loss, _, _ = criterion(model, sample)
    loss.backward()
    opt.step()
    assert min(float(s.min()) for s in _spans(model)) < 0.0


AMP_ARCHS = ["transformer_aop", "transformer_synth_random_vanilla", "transformer_collab",
             "transformer_pkm", "transformer_lm_synth_dense", "adaptive_span_lm_small",
             "all_attention_lm"]


def _train_three_updates(arch, data, tmp_path, precision_flag):
    """fairseq-train --cpu for 3 updates in one precision; returns (log lines, train_inner
    records), after checking that all 3 updates ran with finite losses."""
    logs = run_cli("train", tiny_flags(arch, data) + [
        precision_flag, "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "400",
        "--max-update", "3", "--save-dir", str(tmp_path), "--no-save", "--log-format", "json",
        "--log-interval", "1", "--seed", "1", "--num-workers", "0",
        "--skip-invalid-size-inputs-valid-test", "--disable-validation"] + train_flags(arch))
    inner = json_logs(logs, "train_inner")
    assert [int(r["num_updates"]) for r in inner] == [1, 2, 3], logs[-20:]
    assert all(math.isfinite(float(r["loss"])) for r in inner)
    return logs, inner


@pytest.mark.parametrize("arch", AMP_ARCHS)
def test_cli_amp_train(arch, data_for, tmp_path):
    """fairseq-train --amp --cpu (fairseq's AMPOptimizer wrapper around our models)."""
    _train_three_updates(arch, data_for(arch), tmp_path, "--amp")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad_clip"])
def test_amp_optimizer_unscales_once(optimizer):
    """fairseq's AMPOptimizer unscales through the torch optimizer in clip_grad_norm and then
    hands its wrapper to GradScaler.step, which unscaled a second time (the step was 1/scale of
    the gradient). Run with a CPU GradScaler (fairseq builds a CUDA one, disabled without a GPU)."""
    from omegaconf import OmegaConf

    from fairseq.optim.amp_optimizer import AMPOptimizer

    w = torch.nn.Parameter(torch.zeros(3))
    opt_cfg = {"_name": optimizer, "lr": [1.0], "weight_decay": 0.0}
    if optimizer == "sgd":
        opt_cfg["momentum"] = 0.0
    else:
        opt_cfg.update(grad_clip_per_tensor=0.03, adagrad_eps=1e-10)
    cfg = OmegaConf.create({"optimizer": opt_cfg, "common": {
        "fp16_init_scale": 128, "min_loss_scale": 1e-4, "amp_scale_window": None}})
    opt = AMPOptimizer.build_optimizer(cfg, [w])
    opt._grad_scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    x = torch.tensor([1.0, 2.0, 3.0])
    opt.backward((w * x).sum())
    opt.multiply_grads(1.0)
    opt.clip_grad_norm(0.0)  # the trainer always calls it (it unscales)
    opt.step()
    # SGD: w - lr g = -x; Adagrad (first step, per-tensor clip c): -lr min(1, c/||g||) g / |g|
    expected = -x if optimizer == "sgd" else -torch.full((3,), 0.03 / float(x.norm()))
    assert torch.allclose(w.detach(), expected), w


def test_bf16_on_gpu_hint():
    """fairseq 0.12's --bf16 implies --tpu: where the compat fix did not apply it dies in
    torch_xla; say so in one line, naming the compat entry."""
    from fairseq_attnzoo.messages.hints import hint_for

    xla = AttributeError("'NoneType' object has no attribute 'xla_device'")
    for cuda in (True, False):
        hint = hint_for(xla, cuda=cuda)
        assert hint and "--bf16" in hint and "fairseq_bf16_without_tpu" in hint
        assert ("--amp" in hint) == cuda and ("--cpu" in hint) != cuda


@pytest.mark.parametrize("arch", ["transformer_synth_random", "transformer_lm_aop",
                                  "transformer_collab", "transformer_lm_pkm",
                                  "adaptive_span_lm_small"])
def test_cli_bf16_train_without_tpu(arch, data_for, tmp_path):
    """fairseq-train --bf16 (fairseq 0.12 turns on --tpu and dies without torch_xla): the compat
    entry fairseq_bf16_without_tpu trains with fairseq's own bf16 path (bfloat16 model, fp32
    masters in FP16Optimizer, no loss scale), here on the CPU."""
    logs, inner = _train_three_updates(arch, data_for(arch), tmp_path, "--bf16")
    assert any("--bf16 without --tpu" in line for line in logs), logs[-20:]
    assert "loss_scale" not in inner[-1]  # bf16: no loss scaling (fp16 logs one)


def test_bf16_keeps_tpu_when_asked():
    """--tpu on the command line, or torch_xla installed: fairseq's TPU path is left alone."""
    from omegaconf import OmegaConf

    from fairseq_attnzoo import compat

    def cfg():
        return OmegaConf.create({"common": {"bf16": True, "tpu": True, "cpu": False},
                                 "optimizer": {"tpu": True}, "task": {"tpu": True}})

    c = cfg()
    assert compat.bf16_without_tpu(c, ["data", "--bf16", "--tpu"]) is False and c.common.tpu
    c = cfg()
    assert compat.bf16_without_tpu(c, ["data", "--bf16"]) is (not compat.xla_available())
    if not compat.xla_available():
        assert not c.common.tpu and not c.optimizer.tpu and not c.task.tpu


def _scores(lines, prefix):
    """The first numbers of fairseq's ``H-``/``P-`` lines, or eval-lm's loss line."""
    return [line.split("\t")[1] for line in lines if line.startswith(prefix)]


@pytest.mark.parametrize("command", ["eval_lm", "generate", "validate"])
def test_bf16_scoring_runs_the_model_in_bfloat16(command, trained, monkeypatch):
    """--bf16 in fairseq-eval-lm / -generate / -validate scored in float32 without a word (stock
    fairseq applies only --fp16 there): the compat entry fairseq_bf16_scoring runs the model in
    bfloat16, as --fp16 runs it in float16. The scores move by bf16's rounding, not more."""
    from fairseq import checkpoint_utils

    arch = "attnzoo_lm" if command == "eval_lm" else "attnzoo_transformer"
    run = trained(arch)
    dtypes = []
    load = checkpoint_utils.load_model_ensemble_and_task

    def recording(*args, **kwargs):
        out = load(*args, **kwargs)
        dtypes.extend(next(m.parameters()).dtype for m in out[0])
        return out

    monkeypatch.setattr(checkpoint_utils, "load_model_ensemble_and_task", recording)
    flags = {"eval_lm": ["--task", model_class(arch).zoo_task, *eval_flags(arch),
                         "--max-tokens", "400", "--gen-subset", "valid"],
             "generate": ["--beam", "2", "--max-len-b", "8", "--batch-size", "8",
                          "--gen-subset", "valid"],
             "validate": ["--task", "translation", "--max-tokens", "400",
                          "--valid-subset", "valid"]}[command]
    argv = [run.data, "--user-dir", USER_DIR, "--path", run.ckpt, "--cpu", *flags]
    fp32, bf16 = run_cli(command, argv), run_cli(command, argv + ["--bf16"])
    assert dtypes == [torch.float32, torch.bfloat16], dtypes
    assert any("--bf16: 1 model(s) in bfloat16" in line for line in bf16), bf16[-10:]
    if command == "generate":
        a, b = (_scores(out, "H-") for out in (fp32, bf16))
        assert len(a) == len(b) == 16 and a != b
        # a hypothesis' mean log-prob (measured: at most 0.107 apart over the 16)
        assert max(abs(float(x) - float(y)) for x, y in zip(a, b)) < 0.25
    else:
        def loss(out):
            line = next(x for x in reversed(out) if "loss" in x and "valid" in x
                        or "Loss (base 2)" in x)
            return float(line.split("Loss (base 2): ")[1].split(",")[0]) if "Loss (base 2)" \
                in line else float(line.split("| loss ")[1].split(" |")[0])

        assert loss(fp32) != loss(bf16) and abs(loss(fp32) - loss(bf16)) < 0.05, (
            fp32[-3:], bf16[-3:])


def test_bf16_scoring_on_a_gpu_without_bfloat16_is_one_line(monkeypatch):
    """A GPU without bfloat16 arithmetic (before Ampere) refuses --bf16 scoring in one line."""
    from types import SimpleNamespace

    from fairseq_attnzoo.compat import mixed_precision as mp
    from fairseq_attnzoo.messages.errors import ZooConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    with pytest.raises(ZooConfigError, match="Tesla V100-SXM2-16GB has no bfloat16 arithmetic"):
        mp.check_bf16_device(SimpleNamespace(cpu=False, bf16=True, fp16=False))
    mp.check_bf16_device(SimpleNamespace(cpu=True, bf16=True, fp16=False))  # the CPU runs it
