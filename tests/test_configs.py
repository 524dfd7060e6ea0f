"""fairseq-hydra-train configs (examples/*/config/, generated from the shell recipes) and
fairseq's --tensorboard-logdir with our custom metrics."""

import glob
import json
import math
import os
import struct
import sys

import pytest
from omegaconf import OmegaConf

from console_server import SERVERS
from fairseq_attnzoo.cli.archs import zoo_archs
from scripts import make_hydra_configs as make_configs
from zoo_testlib import REPO, USER_DIR, quiet, run_cli, tiny_flags, train_flags


def test_configs_agree_with_recipes(monkeypatch, python_through_servers):
    """Every config is what scripts/make_hydra_configs.py derives from its recipe's command."""
    # (run as it is run, from the repository root: the recipes' --user-dir fairseq_attnzoo is
    # relative; generate() writes nothing, and tests/conftest.py checks that)
    monkeypatch.chdir(REPO)
    # the recipes' `python` (generate() puts this interpreter's folder first on their PATH): a
    # shim whose `python -m fairseq_attnzoo.cli.archs --list` -- each recipe asks for the arch
    # list -- forks from a process that did its imports (tests/console_server.py)
    monkeypatch.setattr(sys, "executable", python_through_servers("fairseq_attnzoo.cli.archs"))
    configs = make_configs.generate()
    families = {name: [p for p in configs if f"/{name}/" in p]
                for name in ("wmt14_en_de", "enwik8", "pkm_lm")}
    assert len(families["wmt14_en_de"]) == 1 + len(zoo_archs(task="translation"))
    assert len(families["pkm_lm"]) == len(zoo_archs(task="language_modeling"))
    assert len(families["enwik8"]) >= len(make_configs.ENWIK8_CONFIGS)
    stale = []
    for path, text in configs.items():
        with open(os.path.join(REPO, path)) as f:
            if f.read() != text:
                stale.append(path)
    assert not stale, f"rerun python -m scripts.make_hydra_configs: {stale}"
    on_disk = {os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/examples/*/config/*.yaml")}
    assert on_disk == set(configs), "a config without a recipe"


def test_config_holds_the_recipe_values():
    cfg = OmegaConf.load(f"{REPO}/examples/wmt14_en_de/config/transformer_pkm.yaml")
    assert cfg.model._name == "transformer_pkm" and cfg.optimizer._name == "pkm_adam"
    assert cfg.optimizer.pkm_values_lr == 1e-3 and cfg.optimization.lr == [7e-4]
    assert cfg.optimization.update_freq == [8] and cfg.common.fp16 is True
    assert cfg.common.user_dir == "fairseq_attnzoo"
    cfg = OmegaConf.load(f"{REPO}/examples/enwik8/config/adaptive_span_large_finetune.yaml")
    assert cfg.optimization.lr == [0.007] and cfg.optimization.max_update == 170000
    assert cfg.checkpoint.reset_lr_scheduler is True and cfg.lr_scheduler.warmup_updates == 0
    assert cfg.dataset.batch_size_valid == 8  # an int, not fairseq's parsed string


def test_hydra_model_config_keeps_sublayer_flags(lm_data):
    """fairseq-hydra-train builds the model from a DictConfig: the sublayer choice and method
    options must survive (TransformerConfig.from_namespace used to drop them: a stock model)."""
    from fairseq import models, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_attnzoo.modules.pkm import ProductKeyMemory

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, tiny_flags("transformer_lm_pkm", lm_data))
    model_cfg = OmegaConf.create({"_name": "transformer_lm_pkm", "decoder_layers": 2,
                                  "decoder_embed_dim": 32, "decoder_ffn_embed_dim": 64,
                                  "decoder_attention_heads": 4, "pkm_n_keys": 8, "pkm_knn": 4,
                                  "pkm_k_dim": 16, "pkm_heads": 2})
    with quiet():
        task = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
        model = models.build_model(model_cfg, task)
    mems = [m for m in model.modules() if isinstance(m, ProductKeyMemory)]
    assert len(mems) == 1 and mems[0].n_keys == 8


HYDRA_CASES = {
    "pkm_lm/config/transformer_lm_pkm": [
        "task.tokens_per_sample=24", "dataset.max_tokens=400", "model.pkm_decoder_layers=0",
        "model.pkm_n_keys=8", "model.pkm_knn=4", "model.pkm_k_dim=16", "model.pkm_heads=2"],
    "wmt14_en_de/config/transformer_synth_dense": [
        "task.source_lang=src", "task.target_lang=tgt", "common.fp16=false", "common.bf16=true",
        "dataset.max_tokens=400", "model.encoder_layers=1", "model.encoder_embed_dim=32",
        "model.encoder_ffn_embed_dim=64", "model.encoder_attention_heads=2",
        "+model.synth_max_len=64", "+model.max_source_positions=64",
        "+model.max_target_positions=64"],
    "enwik8/config/adaptive_span_small": [
        "task.tokens_per_sample=24", "dataset.batch_size=4", "dataset.batch_size_valid=4",
        "+model.attn_span=16"],
}


@pytest.mark.slow
def test_fairseq_hydra_train_runs_configs(mt_data, lm_data, tmp_path):
    """The real ``fairseq-hydra-train`` (tests/hydra_runner.py: a fresh process that imports our
    plugin only through common.user_dir) on tiny data with size overrides, one config of each
    family. Each run's valid line must carry the method's own metric (proof that the method was
    built, not a stock model), and relative paths stay relative to the starting directory."""
    sizes = ["model.decoder_layers=1", "model.decoder_embed_dim=32",
             "model.decoder_ffn_embed_dim=64", "model.decoder_attention_heads=2"]
    runs = []
    for name, extra in HYDRA_CASES.items():
        config_dir, config = os.path.split(name)
        data = mt_data if name.startswith("wmt") else lm_data
        runs.append(["--config-dir", f"{REPO}/examples/{config_dir}", "--config-name", config,
                     f"common.user_dir={USER_DIR}", "common.cpu=true", "common.log_format=json",
                     "common.log_interval=1", "optimization.max_update=2",
                     "optimization.update_freq=[1]", f"checkpoint.save_dir=ckpt_{config}",
                     "checkpoint.no_epoch_checkpoints=true", "dataset.num_workers=0",
                     f"task.data={data}"] + sizes + extra)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    code, out, err = SERVERS.run(f"{REPO}/tests/hydra_runner.py", [json.dumps(runs)], env=env,
                                 cwd=tmp_path, timeout=300)
    out += err
    assert code == 0, out[-3000:]
    valid = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@@ run "):
            current = line.split()[-1]
        elif "[valid]" in line and current:
            valid[current] = line
    for config, metric in (("transformer_lm_pkm", "valid_pkm_dec0_usage"),
                           ("transformer_synth_dense", "valid_loss"),
                           ("adaptive_span_small", "valid_span_avg")):
        assert metric in valid.get(config, ""), (config, out[-3000:])
        assert (tmp_path / f"ckpt_{config}" / "checkpoint_last.pt").exists()
        assert (tmp_path / f"ckpt_{config}" / "hydra").is_dir()  # hydra.run.dir of the configs
    assert not (tmp_path / "outputs").exists()
    assert "(plain Adam)" not in out  # pkm_adam found the memory values
    # common.bf16=true trains with fairseq's bf16 path: a bfloat16 model stepped by FP16Optimizer
    # on fp32 masters (fairseq saves the weights as float32 either way)
    import torch

    state = torch.load(tmp_path / "ckpt_transformer_synth_dense" / "checkpoint_last.pt",
                       map_location="cpu", weights_only=False)
    assert state["cfg"]["common"]["bf16"] is True
    assert state["optimizer_history"][-1]["optimizer_name"] == "FP16Optimizer"
    # the checkpoint (its model config a DictConfig) loads back with its memory
    from fairseq import checkpoint_utils

    from fairseq_attnzoo.modules.pkm import ProductKeyMemory

    with quiet():
        models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
            [str(tmp_path / "ckpt_transformer_lm_pkm" / "checkpoint_last.pt")],
            arg_overrides={"data": lm_data})
    assert sum(isinstance(m, ProductKeyMemory) for m in models[0].modules()) == 1


# ---- tensorboard ------------------------------------------------------------------------------

def read_events(logdir):
    """{tag: [(step, value)]} from the tfevents files under ``logdir`` (TFRecord framing:
    length u64, crc u32, payload, crc u32), parsed with tensorboardX's protobuf."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def _fresh_tensorboard_writers():
    # fairseq caches one writer per tag for the whole process (not per logdir): start clean so
    # this run writes into its own --tensorboard-logdir
    from fairseq.logging import progress_bar

    for w in progress_bar._tensorboard_writers.values():
        w.close()
    progress_bar._tensorboard_writers.clear()


@pytest.mark.parametrize("arch,tags", [
    ("adaptive_span_lm", {"train_inner": ["span_avg", "span_max", "span_avg_0", "span_max_1"],
                          "valid": ["span_avg", "span_max", "bpc"]}),
    ("transformer_synth_random_dense", {"train_inner": ["mix_enc0_random", "mix_dec1_random"]}),
    ("transformer_pkm", {"valid": ["pkm_enc1_usage", "pkm_enc1_kl", "pkm_dec1_usage",
                                   "pkm_dec1_kl"]}),
])
def test_tensorboard_gets_custom_metrics(arch, tags, data_for, tmp_path):
    logdir = str(tmp_path / "tb")
    flags = tiny_flags(arch, data_for(arch)) + [
        "--optimizer", "adam", "--lr", "0.001", "--max-tokens", "400", "--max-update", "2",
        "--no-save", "--save-dir", str(tmp_path / "ckpt"), "--log-format", "json",
        "--log-interval", "1", "--seed", "1", "--num-workers", "0",
        "--skip-invalid-size-inputs-valid-test", "--tensorboard-logdir", logdir] + train_flags(arch)
    _fresh_tensorboard_writers()
    try:
        run_cli("train", flags)
    finally:
        _fresh_tensorboard_writers()  # flush and close this run's files
    for subdir, want in tags.items():
        events = read_events(os.path.join(logdir, subdir))
        for tag in want:
            assert tag in events, f"{arch}: {subdir}/{tag} missing; tags: {sorted(events)}"
            assert all(math.isfinite(v) for _, v in events[tag]), (tag, events[tag])
            assert events[tag][-1][0] == 2, (tag, events[tag])  # logged at update 2
