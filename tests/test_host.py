"""Host options of the extension point (--norm rmsnorm, swiglu, --rope, --no-proj-bias) and the
Llama-host archs: each piece against its formula written out by hand, parameter counts computed by
hand, incremental decoding == the full pass (and not without RoPE's cache offset), one-line
refusals, and nothing changed for the archs that do not ask."""

import math
import os
from argparse import Namespace

import pytest
import torch

from zoo_testlib import build, decoder_inputs, incremental_vs_full, lm_extra, sweep_batch

from fairseq_attnzoo.modules.rmsnorm import RMSNorm
from fairseq_attnzoo.modules.rotary import RotaryEmbedding, apply_rotary, rotary_angles
from fairseq_attnzoo.modules.sdpa import ZooMultiheadAttention
from fairseq_attnzoo.modules.swiglu import SwiGLU, swiglu_hidden_dim


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


# ---- the plain-PyTorch pieces against their formulas -------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rmsnorm_is_the_formula(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(3, 5, 8) * 4).to(dtype)
    xf = x.float()
    ref = norm.weight * xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + 1e-5)
    out = norm.to(dtype)(x)
    assert out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.to(dtype).float()).abs().max().item() <= tol
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-5
    assert [n for n, _ in norm.named_parameters()] == ["weight"]


def test_swiglu_hidden_size_is_rounded_as_the_reference():
    # int(2/3 * 4d) rounded up to a multiple of 256: d = 1024 -> 2730 -> 2816; d = 4096 -> 11008
    assert swiglu_hidden_dim(4 * 1024) == 2816
    assert swiglu_hidden_dim(4 * 4096) == 11008
    assert swiglu_hidden_dim(64, 8) == 48  # 42 -> 48
    assert swiglu_hidden_dim(48, 16) == 32  # exactly a multiple: unchanged


def test_swiglu_is_the_formula():
    torch.manual_seed(0)
    ffn = SwiGLU(8, 24, multiple_of=4)  # hidden int(16) = 16
    assert ffn.hidden_dim == 16
    assert _n_params(ffn) == 3 * 8 * 16  # no biases
    x = torch.randn(5, 2, 8)
    w1, w2, w3 = ffn.w1.weight, ffn.w2.weight, ffn.w3.weight
    a = x @ w1.t()
    ref = ((a * torch.sigmoid(a)) * (x @ w3.t())) @ w2.t()  # W2 (SiLU(W1 x) * W3 x)
    assert torch.allclose(ffn(x), ref, atol=1e-6)
    assert _n_params(SwiGLU(8, 24, multiple_of=4, bias=True)) == 3 * 8 * 16 + 2 * 16 + 8


def test_rotary_is_the_formula():
    torch.manual_seed(0)
    d, theta = 8, 500.0
    x = torch.randn(2, 3, 6, d)  # [B, H, T, d]
    out = RotaryEmbedding(d, theta)(x, offset=4)
    ref = torch.empty_like(x)
    for t in range(6):
        m = 4 + t
        for i in range(d // 2):
            a = m * theta ** (-2 * i / d)
            x0, x1 = x[..., t, 2 * i], x[..., t, 2 * i + 1]
            ref[..., t, 2 * i] = x0 * math.cos(a) - x1 * math.sin(a)
            ref[..., t, 2 * i + 1] = x0 * math.sin(a) + x1 * math.cos(a)
    assert torch.allclose(out, ref, atol=1e-5)
    # the [B, T, H, d] layout (keys before the head split) gives the same rotation
    out_t = RotaryEmbedding(d, theta)(x.transpose(1, 2), offset=4, seq_dim=-3).transpose(1, 2)
    assert torch.allclose(out_t, out, atol=1e-6)


def test_rotary_scores_depend_on_the_distance_only():
    torch.manual_seed(0)
    q, k = torch.randn(16), torch.randn(16)

    def score(m, n):
        qm = apply_rotary(q, rotary_angles(torch.tensor(m), 16))
        kn = apply_rotary(k, rotary_angles(torch.tensor(n), 16))
        return (qm * kn).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)


def test_rotary_importable_without_fairseq():
    from console_server import SERVERS

    code = ("import sys; sys.modules['fairseq'] = None\n"
            "import fairseq_attnzoo.modules.rotary, fairseq_attnzoo.modules.rmsnorm, "
            "fairseq_attnzoo.modules.swiglu")
    from preptest_util import REPO  # (this checkout, whatever the working directory)

    # (as python -c, forked from a process that imported torch only: tests/console_server.py)
    assert SERVERS.run("-c", [code], env={**os.environ, "PYTHONPATH": REPO},
                       cwd=os.getcwd())[0] == 0


# ---- RoPE under incremental decoding -----------------------------------------------------------

def _steps(attn, x):
    state, outs = {}, []
    for t in range(x.size(0)):
        outs.append(attn(x[t: t + 1], x[t: t + 1], x[t: t + 1], incremental_state=state)[0])
    return torch.cat(outs)


def test_rope_incremental_needs_the_cache_offset(monkeypatch):
    torch.manual_seed(0)
    attn = ZooMultiheadAttention(16, 2, bias=False, rope_theta=10000.0).eval()
    x = torch.randn(6, 2, 16)
    future = torch.triu(torch.full((6, 6), float("-inf")), 1)
    full = attn(x, x, x, attn_mask=future)[0]
    assert (full - _steps(attn, x)).abs().max().item() < 1e-5
    # every step rotated from position 0 (the bug the offset prevents): decoding drifts
    forward = RotaryEmbedding.forward
    monkeypatch.setattr(RotaryEmbedding, "forward",
                        lambda self, x, offset=0, seq_dim=-2: forward(self, x, 0, seq_dim))
    assert (full - _steps(attn, x)).abs().max().item() > 1e-2


# ---- the archs ---------------------------------------------------------------------------------

def _vocab(model):
    return model.decoder.embed_tokens.num_embeddings


def test_llama_tiny_parameter_count_by_hand(lm_data):
    _, _, model, _ = build("attnzoo_lm_llama", lm_data)
    d, h, layers, v = 32, 48, 2, _vocab(model)  # ffn 64 -> SwiGLU int(128/3)=42 -> 48
    per_layer = 4 * d * d + 3 * d * h + 2 * d  # q,k,v,out + w1,w2,w3 + two RMSNorm gains
    assert _n_params(model) == layers * per_layer + d + 2 * v * d  # final norm, in/out embeddings
    assert model.decoder.embed_positions is None
    assert not [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert not norms and isinstance(model.decoder.layer_norm, RMSNorm)
    layer = model.decoder.layers[0]
    assert layer.normalize_before and layer.self_attn.rotary.theta == 500000.0
    assert layer.dropout_module.p == 0 and layer.self_attn.dropout == 0


def test_memplus_llama_is_pkplus_373m_1024k():
    from fairseq.models import ARCH_CONFIG_REGISTRY

    args = Namespace()
    ARCH_CONFIG_REGISTRY["transformer_lm_memplus_llama"](args)
    names = args.decoder_ffn.split(",")
    assert [i for i, n in enumerate(names) if n == "pkm"] == [4, 12, 20]
    assert set(names) == {"pkm", "swiglu"} and len(names) == 24
    assert (args.decoder_embed_dim, args.decoder_attention_heads, args.rope_theta) == \
        (1024, 16, 500000.0)
    assert (args.pkm_n_keys, args.pkm_k_dim, args.pkm_heads, args.pkm_knn) == (1024, 512, 4, 32)
    assert args.pkm_shared_values and args.pkm_swilu_output and args.pkm_value_dim == 0
    assert (args.norm, args.rope, args.proj_bias, args.dropout) == ("rmsnorm", True, False, 0.0)
    assert args.decoder_normalize_before and args.no_token_positional_embeddings
    # transformer_lm_memplus keeps its meaning: the fairseq host
    old = Namespace()
    ARCH_CONFIG_REGISTRY["transformer_lm_memplus"](old)
    assert (old.norm, old.rope, old.proj_bias) == ("layernorm", False, True)
    assert set(old.decoder_ffn.split(",")) == {"ffn", "pkm"}


@pytest.mark.parametrize("arch", ["attnzoo_lm_llama", "transformer_lm_memplus_llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_llama_incremental_equals_full_and_needs_the_offset(arch, dtype, lm_data, monkeypatch):
    args, task, model, _ = build(arch, lm_data, lm_extra(arch))
    model = model.eval().to(dtype)
    tokens, _ = decoder_inputs(model, arch, sweep_batch(task, args)["net_input"])
    pad = task.source_dictionary.pad()
    logp = lambda x: torch.log_softmax(x.float(), -1)  # noqa: E731
    # measured on CPU: ~1e-6 in fp32, 0 in fp16/bf16; the bug (steps rotated from position 0)
    # moves the log-probabilities by 0.4 and more in every dtype
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}[dtype]
    with torch.no_grad():
        assert incremental_vs_full(model, tokens, None, pad, logp) <= tol
        forward = RotaryEmbedding.forward
        monkeypatch.setattr(RotaryEmbedding, "forward",
                            lambda self, x, offset=0, seq_dim=-2: forward(self, x, 0, seq_dim))
        assert incremental_vs_full(model, tokens, None, pad, logp) > 0.1


def test_translation_takes_the_host_options(mt_data):
    flags = ["--norm", "rmsnorm", "--encoder-ffn", "swiglu", "--decoder-ffn", "swiglu",
             "--rope", "--no-proj-bias", "--encoder-normalize-before",
             "--decoder-normalize-before", "--swiglu-multiple-of", "8"]
    args, task, model, _ = build("attnzoo_transformer", mt_data, flags)
    model.eval()
    d, h = 32, 48
    per_enc = 4 * d * d + 3 * d * h + 2 * d
    per_dec = 8 * d * d + 3 * d * h + 3 * d  # self + cross attention
    emb = model.encoder.embed_tokens.num_embeddings * d * (1 + int(
        model.decoder.embed_tokens is not model.encoder.embed_tokens))
    out = 0 if model.decoder.output_projection.weight is model.decoder.embed_tokens.weight \
        else model.decoder.output_projection.weight.numel()
    assert _n_params(model) == 2 * per_enc + 2 * per_dec + 2 * d + emb + out
    enc_layer, dec_layer = model.encoder.layers[0], model.decoder.layers[0]
    assert enc_layer.self_attn.rotary is not None and dec_layer.self_attn.rotary is not None
    assert dec_layer.encoder_attn.rotary is None  # cross-attention: different sequences
    net = sweep_batch(task, args)["net_input"]
    with torch.no_grad():
        tokens, enc = decoder_inputs(model, "attnzoo_transformer", net)
        assert incremental_vs_full(model, tokens, enc, task.target_dictionary.pad()) <= 1e-5


def test_collab_rope_incremental_and_relative(monkeypatch):
    """Collaborative heads rotate each head's mixed query q diag(m_i) and the shared keys: the
    scores depend on distances only (a sequence shifted by 5 positions scores the same), the
    content-bias columns are not rotated, and decoding needs the cache offset."""
    from fairseq_attnzoo.modules.collab import CollaborativeAttention

    torch.manual_seed(0)
    for qk_bias in (False, True):  # with and without the content-bias columns
        attn = CollaborativeAttention(16, 2, key_dim=8, qk_bias=qk_bias,
                                      rope_theta=100.0).eval()
        x = torch.randn(6, 2, 16)
        future = torch.triu(torch.full((6, 6), float("-inf")), 1)
        full = attn(x, x, x, attn_mask=future)[0]
        assert (full - _steps(attn, x)).abs().max().item() < 1e-5
        state = {}  # five tokens decoded first: the next six see themselves at positions 5..10
        attn(torch.zeros(5, 2, 16), None, None, incremental_state=state)
        buf = attn._get_buffer(state)
        buf["_padding"] = torch.ones(2, 5, dtype=torch.bool)  # masked: only the offset remains
        shifted = torch.cat([attn(x[t: t + 1], None, None, incremental_state=state)[0]
                             for t in range(6)])
        assert (full - shifted).abs().max().item() < 1e-5
    forward = RotaryEmbedding.forward
    monkeypatch.setattr(RotaryEmbedding, "forward",
                        lambda self, x, offset=0, seq_dim=-2: forward(self, x, 0, seq_dim))
    assert (full - _steps(attn, x)).abs().max().item() > 1e-2


@pytest.mark.parametrize("arch,flags", [
    ("attnzoo_lm", ["--decoder-self-attn", "collab"]),
    ("attnzoo_lm", ["--decoder-self-attn", "synth_dense_vanilla", "--synth-max-len", "128"]),
    ("transformer_collab", []),
])
def test_methods_with_a_qk_product_rotate_it(arch, flags, data_for, monkeypatch):
    """collab and the Synthesizer's vanilla part under --rope: incremental == full, and not
    without the cache offset (the rotation is really applied)."""
    from zoo_testlib import is_lm

    args, task, model, _ = build(arch, data_for(arch), flags + ["--rope"] + lm_extra(arch))
    model.eval()
    net = sweep_batch(task, args)["net_input"]
    with torch.no_grad():
        tokens, enc = decoder_inputs(model, arch, net)
        pad = task.target_dictionary.pad()
        assert incremental_vs_full(model, tokens, enc, pad) <= 1e-5
        forward = RotaryEmbedding.forward
        monkeypatch.setattr(RotaryEmbedding, "forward",
                            lambda self, x, offset=0, seq_dim=-2: forward(self, x, 0, seq_dim))
        assert incremental_vs_full(model, tokens, enc, pad) > 1e-3
    assert is_lm(arch) or model.decoder.layers[0].encoder_attn.rotary is None


@pytest.mark.parametrize("arch,flags,fix", [
    ("attnzoo_lm", ["--decoder-self-attn", "synth_random", "--rope"], "drop --rope"),
    # the methods that rotate come from their registrations
    ("attnzoo_lm", ["--decoder-self-attn", "synth_dense", "--rope"],
     "drop --rope or use --decoder-self-attn mha, collab, sdpa, synth_dense_vanilla, "
     "synth_random_vanilla or synth"),
    ("attnzoo_lm", ["--decoder-self-attn", "synth", "--synth-mix", "dense,random", "--rope"],
     "add vanilla to --synth-mix dense,random, drop --rope"),
    ("attnzoo_lm", ["--rope", "--rope-theta", "0"], "--rope-theta must be positive"),
    ("attnzoo_lm", ["--rope-theta", "500"], "add --rope or drop --rope-theta"),
    # the rotary module says dim / embed_dim / num_heads; the host names the flags
    ("attnzoo_lm", ["--rope", "--decoder-embed-dim", "12", "--decoder-attention-heads", "4"],
     "choose --decoder-embed-dim / --decoder-attention-heads = 12 / 4 with an even quotient"),
    ("attnzoo_lm", ["--rope", "--decoder-self-attn", "collab", "--collab-key-dim", "7"],
     "width is 7 (odd): choose an even --collab-key-dim"),
])
def test_host_refusals_are_one_line(arch, flags, fix, lm_data):
    with pytest.raises(ValueError) as err:
        build(arch, lm_data, flags)
    msg = str(err.value)
    assert fix in msg and "\n" not in msg


def test_llama_without_rope_builds_without_rotation(lm_data):
    args, _, model, _ = build("attnzoo_lm_llama", lm_data, ["--no-rope"])
    assert not args.rope and args.rope_theta == 10000.0
    assert model.decoder.layers[0].self_attn.rotary is None


def test_defaults_and_old_checkpoint_configs_build_the_same_model(lm_data):
    """attnzoo_lm without host flags and a stored config that predates them (no keys) build the
    same parameters with the same outputs: every host option is off."""
    args, task, model, _ = build("attnzoo_lm", lm_data)
    old = Namespace(**{k: v for k, v in vars(args).items()
                       if k not in ("norm", "rope", "rope_theta", "proj_bias")})
    torch.manual_seed(1)
    again = task.build_model(old)
    assert type(again.decoder.layers[0].self_attn).__name__ == "MultiheadAttention"
    assert [n for n, _ in again.named_parameters()] == [n for n, _ in model.named_parameters()]
    again.load_state_dict(model.state_dict(), strict=True)
    tokens = sweep_batch(task, args)["net_input"]["src_tokens"]
    model.eval(), again.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens)[0], again(tokens)[0])


@pytest.mark.parametrize("arch", ["attnzoo_lm_llama", "transformer_lm_memplus_llama"])
def test_llama_lm_trains_and_fairseq_generate_decodes_it(arch, lm_data, tmp_path):
    """fairseq-train, then fairseq-generate (greedy, and sampling) continues prefixes of the
    valid set; the greedy continuations are the argmax of full passes over the growing text, so
    the generator's incremental decoding (RoPE offset by the cached length) is the full pass."""
    from fairseq import checkpoint_utils

    from zoo_testlib import run_cli, tiny_flags

    save = str(tmp_path / "ckpt")
    run_cli("train", tiny_flags(arch, lm_data) + lm_extra(arch) + [
        "--optimizer", "adam", "--lr", "0.003", "--max-tokens", "400", "--max-update", "3",
        "--save-dir", save, "--no-epoch-checkpoints", "--seed", "1", "--num-workers", "0"])
    ckpt = f"{save}/checkpoint_last.pt"
    common = [lm_data, "--user-dir", tiny_flags(arch, lm_data)[2], "--path", ckpt, "--cpu",
              "--task", "language_modeling", "--gen-subset", "valid", "--batch-size", "4",
              "--prefix-size", "2", "--max-len-b", "6", "--sample-break-mode", "eos"]
    greedy = [line for line in run_cli("generate", common + ["--beam", "1"])
              if line.startswith("H-")]
    sampled = [line for line in run_cli("generate", common + ["--beam", "1", "--sampling",
                                                               "--seed", "3"])
               if line.startswith("H-")]
    assert greedy and len(sampled) == len(greedy)

    models, _, task = checkpoint_utils.load_model_ensemble_and_task([ckpt], arg_overrides={
        "data": lm_data})
    model, d = models[0].eval(), task.target_dictionary
    checked = 0
    for line in greedy[:4]:
        words = line.split("\t")[2].split()
        ids = [d.eos()] + [d.index(w) for w in words]
        with torch.no_grad():  # each generated token is the full pass's argmax after its prefix
            for t in range(2, len(ids) - 1):
                logits = model(torch.tensor([ids[: t + 1]]))[0][0, -1]
                logits[d.pad()] = -math.inf  # the generator never picks pad / unk
                logits[d.unk()] = -math.inf
                assert int(logits.argmax()) == ids[t + 1], (line, t)
                checked += 1
    assert checked >= 4  # generated tokens checked (continuations end at eos)


def test_hydra_model_config_builds_the_llama_host(lm_data):
    """fairseq-hydra-train's path: a model config (DictConfig) naming only the arch and sizes,
    as examples/pkm_lm/config/transformer_lm_memplus_llama.yaml does, builds the Llama host."""
    from fairseq import models, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from omegaconf import OmegaConf

    from zoo_testlib import tiny_flags

    args = options.parse_args_and_arch(options.get_training_parser(),
                                       tiny_flags("transformer_lm_memplus_llama", lm_data))
    cfg = OmegaConf.create({"_name": "transformer_lm_memplus_llama", "decoder_layers": 2,
                            "decoder_embed_dim": 32, "decoder_ffn_embed_dim": 64,
                            "decoder_attention_heads": 4, "pkm_n_keys": 8, "pkm_knn": 4,
                            "pkm_heads": 2, "swiglu_multiple_of": 8})
    task = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
    model = models.build_model(cfg, task)
    layers = model.decoder.layers
    assert [type(layer.ffn).__name__ for layer in layers] == ["FairseqProductKeyMemory"] * 2
    assert all(layer.normalize_before and isinstance(layer.final_layer_norm, RMSNorm)
               for layer in layers)
    assert layers[0].self_attn.rotary.theta == 500000.0 and model.decoder.embed_positions is None
    assert layers[0].ffn.values is layers[1].ffn.values  # one shared value pool


def test_attention_sublayer_heads_must_divide_the_width(mt_data):
    """The module says embed_dim / num_heads; the host names the side's flags."""
    with pytest.raises(ValueError) as err:
        build("transformer_collab", mt_data, ["--encoder-embed-dim", "12",
                                              "--encoder-attention-heads", "5"])
    assert str(err.value) == ("--encoder-embed-dim 12 is not divisible by "
                              "--encoder-attention-heads 5: choose heads that divide it")


@pytest.mark.parametrize("arch", ["attnzoo_transformer", "attnzoo_lm"])
def test_decoder_hands_fairseq_attention_masks_of_one_type(arch, mt_data, lm_data):
    """The decoder's self-attention got fairseq's float future mask beside its boolean padding
    mask: torch's "Support for mismatched key_padding_mask and attn_mask is deprecated" on every
    training run. The boolean future mask gives the same output as the float one."""
    import warnings

    from zoo_testlib import is_lm

    args, task, model, _ = build(arch, lm_data if is_lm(arch) else mt_data, lm_extra(arch))
    sample = sweep_batch(task, args)
    tokens, enc = decoder_inputs(model, arch, sample["net_input"])
    assert tokens.eq(task.target_dictionary.pad()).any()  # a padded batch
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.decoder(tokens, encoder_out=enc)[0]
    assert not [w for w in caught if "mismatched" in str(w.message)], [str(w.message)
                                                                       for w in caught]
    # (the float mask, as fairseq's own decoder layer passes it: the same output)
    from fairseq_attnzoo.models import transformer as host

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "_future_mask_like", lambda attn_mask, *rest: attn_mask)
        ref = model.decoder(tokens, encoder_out=enc)[0]
    keep = tokens.ne(task.target_dictionary.pad()).unsqueeze(-1)
    assert torch.equal(out * keep, ref * keep)
