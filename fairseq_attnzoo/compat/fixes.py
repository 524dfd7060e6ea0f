"""The table: every change to torch, NumPy, hydra and fairseq, one row each, in the order they are
applied and listed. A row names its target once, the library version it fixes and why; the code it
installs lives with what it serves (:mod:`.mixed_precision`, :mod:`.data`, :mod:`.trainer`,
:mod:`.console`, :mod:`.known_warnings`, :mod:`.run_end`).
:func:`~.machinery.fix` replaces a ``"module:Class.attribute"`` when its source has a known digest
(a method, classmethod, property or environment variable ``"env:NAME"``) and restores it on
:func:`~.machinery.undo_all`; :class:`~.machinery.Patch` rows change other state. Every row's apply
returns its undo or ``NOTHING_CHANGED``. The hooks of our own features are rows of their owners
(``models/pkm.py``, ``models/pkm_shard.py``, ``models/transformer.py``, ``models/registry.py``)."""

from typing import Optional

from . import console, data
from . import known_warnings as known
from . import mixed_precision as mp
from . import run_end, trainer
from .machinery import Patch, always, fix, register

FP16 = "fairseq.optim.fp16_optimizer:"
GRADS_SYNC, PARAMS_SYNC = (FP16 + "_FP16OptimizerMixin._sync_fp16_grads_to_fp32",
                           FP16 + "_FP16OptimizerMixin._sync_fp32_params_to_fp16")
CONSOLE = "(fairseq-* console scripts only)"
OURS_TOO = "(fairseq-* and attnzoo-* console scripts)"


def _foreach_copy() -> Optional[str]:
    import torch

    return None if hasattr(torch, "_foreach_copy_") else "torch has no _foreach_copy_ (torch < 2.1)"


# ---- torch and NumPy (code: data.py) ------------------------------------------------------------
register(Patch(
    "torch_safe_globals_namespace", "torch.serialization (weights-only allow-list)",
    "fairseq checkpoints pickle an argparse.Namespace; torch>=2.6 loads with weights_only=True. "
    "Allow-list just that class instead of disabling the safe loader globally",
    data.torch_has_safe_globals, data.allow_namespace, "torch >= 2.6"))
register(Patch(
    "numpy_compat_long", "numpy.compat.long",
    "fairseq's TokenBlockDataset and bucketed translation data use np.compat.long, removed in "
    "NumPy 2; restore just that alias (int64)",
    data.numpy_lacks_compat_long, data.numpy_compat_long, "NumPy >= 2"))

# ---- fairseq's optimizers and --bf16 (code: mixed_precision.py) ----------------------------------
fix("fairseq_amp_single_unscale", "fairseq.optim.amp_optimizer:AMPOptimizer.step",
    "fairseq unscales --amp gradients twice (clip_grad_norm unscales the torch optimizer, step "
    "hands the scaler its wrapper): every update divided by the loss scale once more. This "
    "changes --amp training of every arch, stock ones included, while the plugin is loaded",
    lambda step: mp.amp_step, "2b8a6f80fa6ca14b", version="fairseq 0.12.3")
# (before fairseq_fp16_master_projection, which wraps the copy installed here)
fix("fairseq_fp16_flat_sync", {GRADS_SYNC: mp.flat_grads_sync, PARAMS_SYNC: mp.flat_params_sync},
    "with flat fp32 masters fairseq copies every gradient into the buffer and every master "
    "back in Python loops (five ops per parameter and direction); one multi-tensor copy per "
    "device does the same copies", None, "9a06568699ab4d06", "a53fdba609963e2d",
    version="fairseq 0.12.3, torch >= 2.1", check=_foreach_copy)
fix("fairseq_fp16_master_projection", PARAMS_SYNC,
    "under --fp16/--bf16 the optimizer steps fp32 master copies: bounded parameters are "
    "projected on the masters before fairseq copies them into the half model",
    mp.projecting_sync, "a53fdba609963e2d", "a319261284577fb6",  # fairseq's, or the flat sync's
    version="fairseq 0.12.3")
fix("fairseq_bf16_flat_masters", FP16 + "FP16Optimizer.build_optimizer",
    "under --bf16 fairseq keeps one fp32 master per parameter (for TPUs), so every update loops "
    "over the parameters in Python; off TPUs flatten them as --fp16 does (unless "
    "--fp16-no-flatten-grads or the optimizer takes no flat parameters)",
    mp.bf16_flat_build, "c7ff6d890b7d4239", version="fairseq 0.12.3")
fix("fairseq_bf16_without_tpu", "fairseq.distributed.utils:call_main",
    "fairseq 0.12's --bf16 implies --tpu, so fairseq-train --bf16 dies without torch_xla; "
    "unless --tpu is given or torch_xla is installed, train with fairseq's own bf16 path "
    "(bfloat16 model, fp32 masters) on the GPU/CPU, as the hydra path already does",
    mp.without_tpu, "c2a32fa44fa277a6", version="fairseq 0.12.3")
fix("fairseq_bf16_scoring", "fairseq.checkpoint_utils:load_model_ensemble_and_task",
    "fairseq-generate, -eval-lm, -interactive and -validate run the model in float16 under "
    "--fp16 (model.half()) and ignored --bf16: the model scored in float32 without a word. "
    "Inside those commands, --bf16 (without --fp16) loads the models in bfloat16; a GPU without "
    "bfloat16 arithmetic refuses in one line",
    mp.bf16_scoring, "13d16e9ecb8407a3", version="fairseq 0.12.3")

# ---- what fairseq's commands print (code: console.py, known_warnings.py, run_end.py) ------------
register(Patch(
    "fairseq_cli_hints", f"sys.excepthook {CONSOLE}, HYDRA_FULL_ERROR (fairseq-hydra-train)",
    "errors a user can cause end in one line naming the problem and the fix, without the "
    "traceback (ATTNZOO_TRACEBACK=1 shows it); fairseq-hydra-train gets HYDRA_FULL_ERROR=1 so "
    "that its job's errors reach the hook", always, console.console_hints, "fairseq 0.12.3"))
register(Patch(
    "fairseq_mmap_dataset_del", f"sys.unraisablehook {CONSOLE}",
    "fairseq's MMapIndexedDataset whose np.memmap failed (an empty split) raises again in "
    "__del__: that one error is not printed after the hint's line; every other one is",
    always, console.ignore_half_built_mmap_dataset, "fairseq 0.12.3"))
register(Patch(
    "python_interrupt_in_callback", f"sys.unraisablehook {CONSOLE}",
    "a Ctrl-C that Python raises inside a weakref callback, a __del__ or the garbage collector "
    "cannot propagate: Python printed 'Exception ignored in ...' and the command went on "
    "training. It is raised again in the main thread, so the command stops as on any Ctrl-C",
    always, console.interrupt_again_after_callback, "CPython 3"))
register(Patch(
    "fairseq_root_log_level", f"the root logger's level {OURS_TOO}",
    "importing fairseq's models runs logging.basicConfig(level=DEBUG) (wav2vec2_classification), "
    "and fairseq-generate / fairseq-eval-lm configure logging only after that import, so hydra's "
    "DEBUG lines reach stderr: in a console script a root logger left at DEBUG goes back to "
    "$LOGLEVEL (INFO), the level the command asks for",
    console.debug_root_logger, console.root_log_level, "fairseq 0.12.3"))

register(Patch(
    "torch_pin_memory_without_accelerator", f"warnings filter {OURS_TOO}",
    "fairseq's iterators create every DataLoader with pin_memory=True, and torch >= 2.7 warns "
    "once per command that no accelerator is found, so nothing is pinned: pinned memory only "
    "serves copies to an accelerator, none exists, nothing is lost. That message from "
    "torch.utils.data.dataloader is ignored",
    known.torch_warns_pin_memory,
    known.ignoring(known.PIN_MEMORY, UserWarning, r"torch\.utils\.data\.dataloader$"),
    "torch >= 2.7"))
register(Patch(
    "fairseq_cuda_amp_autocast", f"warnings filter {OURS_TOO}",
    "fairseq's FairseqTask.train_step enters torch.cuda.amp.autocast(enabled=--amp), which torch "
    ">= 2.4 calls deprecated in a FutureWarning at the first update; it is the same context as "
    "torch.amp.autocast('cuda'). That message, attributed to fairseq.tasks.fairseq_task, is "
    "ignored (the same call in any other module still warns)",
    known.fairseq_calls_cuda_autocast,
    known.ignoring(known.CUDA_AUTOCAST, FutureWarning, r"fairseq\.tasks\.fairseq_task$"),
    "fairseq 0.12.3, torch >= 2.4"))

fix("fairseq_train_summary", {"fairseq.distributed.utils:call_main": run_end.summarizing,
                              "fairseq_cli.train:validate": run_end.recording_validation},
    "fairseq-train ended on its last epoch line: no best validation result and its update, no "
    "best checkpoint, no command to score it. A finished run ends with two lines saying them, "
    "the fairseq-generate / fairseq-eval-lm command with this run's data, task and device flags",
    None, "c2a32fa44fa277a6", "ff91d67bb873a1cc",  # call_main: fairseq's, or the bf16 row's
    "7a721818350f1d06", version="fairseq 0.12.3")
fix("fairseq_train_progress_in_log", "fairseq.logging.progress_bar:progress_bar",
    "fairseq-train draws a tqdm bar whenever stderr is a terminal, even when its log (stdout) "
    "goes to a file or a pipe (> train.log, | tee): the log then had nothing between epoch "
    "lines. Where the log is not a terminal, fairseq's simple format writes a line every "
    "--log-interval updates into it (an explicit --log-format is kept)",
    run_end.progress_in_log, "ccff0ad64057ea6b", version="fairseq 0.12.3")

# ---- fairseq's data (code: data.py) --------------------------------------------------------------
fix("fairseq_batch_keep_tail", "fairseq.data.data_utils:batch_by_size",
    "fairseq 0.12 drops the last batch when its size is not a multiple of "
    "--required-batch-size-multiple (default 8): fairseq-generate and validation silently "
    "skipped up to 7 sentences, training the same examples every epoch. Keep it as a smaller "
    "batch (--skip-remainder-batch still drops a training epoch's last batch when asked)",
    data.keep_tail, "10c0b48b47357f22", version="fairseq 0.12.3 (upstream #5036)")
fix("fairseq_ddp_partial_update", "fairseq.trainer:Trainer.train_step",
    "under DDP with --update-freq > 1, a rank whose last update of an epoch ends in a padding "
    "(dummy) batch dropped its real batches from the sample size and the logs but kept their "
    "gradients: that update was normalised by the wrong token count. Count the real batches",
    data.padding_batches_first, "8cbf0406b1fe5093", version="fairseq 0.12.3")
fix("fairseq_eval_lm_block_length",
    "fairseq.tasks.language_modeling:LanguageModelingTask.eval_lm_dataloader",
    "fairseq-eval-lm skips every block longer than the model accepts: when that is every "
    "block it reports 0 tokens, perplexity 1.00, exit 0 (e.g. a Synthesizer LM without "
    "--tokens-per-sample): refuse that case in one line; when some blocks fit, evaluate them "
    "as fairseq does, plus one warning line with the counts and the flag that fixes it",
    data.checking_block_length, "6ae1cc56dea42151", version="fairseq 0.12.3")

# ---- fairseq's parsers (code: console.py) --------------------------------------------------------
fix("fairseq_train_parser_one_line",
    "fairseq.options:add_model_args (the training parser's --arch type)",
    "a misspelled --arch printed argparse's ~200 choices (over 10 KB) and no suggestion: name "
    "the closest arch names instead (the one-line error itself: fairseq_parser_one_line)",
    console.arch_checked, "1c18c8c34cb60493", version="fairseq 0.12.3")
fix("fairseq_parser_one_line", "fairseq.options:add_dataset_args (every command's parser)",
    "a bad flag value of fairseq-train, -generate, -interactive, -validate or -eval-lm printed "
    "the whole usage (thousands of flags in fairseq-train) before argparse's message: answer "
    "in one line (fairseq-* console scripts only; a parser built in a program keeps "
    "argparse's behaviour)",
    console.parsing_in_one_line, "d28d7bdb8e29e2c3", version="fairseq 0.12.3")

# ---- hydra's deprecation warnings in fairseq's config loading (code: known_warnings.py) ---------
fix("hydra_deprecation_warnings", {
        "fairseq.dataclass.utils:initialize":
            lambda initialize: known.quiet_hydra_deprecations(initialize, finds_caller=True),
        "fairseq.dataclass.utils:compose": known.quiet_hydra_deprecations},
    "fairseq 0.12 loads every config through hydra.experimental's initialize/compose, and "
    "hydra 1.3 answers with about 20 lines of deprecation warnings on every command: silence "
    "exactly those messages, only inside these two calls (fairseq-hydra-train's own @hydra.main "
    "runs before the plugin is loaded and keeps its warnings)",
    version="fairseq 0.12.3, hydra 1.3", check=known.hydra_in_fairseq)

# ---- examples left out, and --remove-bpe (code: data.py) -----------------------------------------
fix("fairseq_skipped_examples", "fairseq.tasks.fairseq_task:FairseqTask.filter_indices_by_size",
    "fairseq skips examples longer than the model accepts (always in training, with "
    "--skip-invalid-size-inputs-valid-test in validation and generation) with a warning that "
    "names no flag; a length-bounded arch (--synth-max-len) can drop a third of the data. Say "
    "how many, of which split, and which flag keeps them, and remember it for the score line",
    data.reporting_skipped, "064d9e381d9a3db6", version="fairseq 0.12.3")
fix("fairseq_subset_score", "fairseq.scoring:build_scorer",
    "fairseq-generate prints BLEU over the sentences it kept, and says nothing when "
    "--skip-invalid-size-inputs-valid-test left some out: the score line says it is a subset",
    data.noting_subset, "bfcb5472301b0cfd", version="fairseq 0.12.3")
fix("fairseq_remove_bpe_check", "fairseq.utils:post_process_prediction",
    "fairseq-generate/-interactive apply --remove-bpe's rule whatever the data's segmentation: "
    "subword-nmt's '@@ ' rule on SentencePiece data leaves the pieces in and BLEU scores them, "
    "silently and higher. Refuse, in one line naming the right value, when the target "
    "dictionary shows the other segmentation (checked once per dictionary and value)",
    data.checking_remove_bpe, "005b84430b598a22", version="fairseq 0.12.3")
fix("fairseq_interactive_bpe_check", "fairseq_cli.interactive:make_batches",
    "fairseq-interactive without --bpe looks each typed word up whole: on SentencePiece data "
    "almost every word became <unk>, silently (S-0 <unk> ... <unk>). Refuse in one line naming "
    "--bpe sentencepiece --sentencepiece-model when the dictionary holds SentencePiece pieces",
    data.checking_bpe, "53e9b96853c3f008", version="fairseq 0.12.3")
fix("fairseq_interactive_lines", {
        "fairseq_cli.interactive:buffered_read": data.blank_lines_apart,
        "fairseq_cli.interactive:make_batches": data.interactive_lines},
    "fairseq-interactive translated a blank line (into 'day', 'Image': what the model says "
    "after nothing) and ended the session at a line longer than the model accepts, with a "
    "message written for scoring a split: a blank line gets an empty hypothesis, a too long "
    "line one warning naming the limit, and the session goes on",
    None, "3b4339322a2631ad", "53e9b96853c3f008",  # fairseq's make_batches, or the bpe check's:
    "9834f38afb571119", version="fairseq 0.12.3")
fix("sacrebleu_tokenized_by_fairseq", "fairseq.scoring.bleu:SacrebleuScorer._score",
    "fairseq-generate --scoring sacrebleu tokenizes hypotheses and references itself (13a) "
    "before sacrebleu scores them untokenized: sacrebleu warned 'It looks like you forgot to "
    "detokenize your test data' on every run of 100+ sentences ending in '.'; the score is "
    "unchanged, the false warning goes", data.forcing_tokenized, "d735bbceb5d66b44",
    version="fairseq 0.12.3, sacrebleu 2")

# ---- fairseq's trainer (code: trainer.py) --------------------------------------------------------
fix("fairseq_shared_params_absent", "fairseq.trainer:_catalog_shared_params",
    "fairseq-train logged 'detected shared parameter: ...q_proj.bias <- ...k_proj.bias' for "
    "each bias that does not exist (--no-proj-bias: 14-36 lines): absent parameters (None) are "
    "not shared ones", trainer.skipping_absent, "de2da18cb6df2c02", version="fairseq 0.12.3")
fix("fairseq_no_save_no_folder", {trainer.SAVE: trainer.saving,
                                  trainer.VERIFY_SAVE_DIR: trainer.verifying,
                                  trainer.TRAINER_SAVE: trainer.saving_crash},
    "fairseq-train --no-save created an empty ./checkpoints/ (the default --save-dir): both "
    "functions make the folder before they look at --no-save; a run that saves nothing leaves "
    "no folder it made. A step that raises still writes fairseq's crash.pt there, as stock: "
    "its folder is made then, and a crash save that fails never hides the step's error", None,
    "61513534b9b33e6a", "413f93d9a158f8d4", "46b39d54a4f75cc8", version="fairseq 0.12.3")
fix("fairseq_resume_broadcast", trainer.BROADCAST,
    "a run resumed on several processes died on every rank but 0 (UnpicklingError: "
    "omegaconf DictConfig not allowed): fairseq broadcasts rank 0's loaded checkpoint and the "
    "others unpickle it with torch>=2.6's weights-only loader; they load this job's own object "
    "in full (before, only --load-checkpoint-on-all-dp-ranks resumed)",
    trainer.trusting_broadcast, "9fc3ef1939a94874", version="fairseq 0.12.3, torch >= 2.6")
fix("fairseq_resume_other_world_size",
    {f"{trainer.ITERATOR}.state_dict": trainer.recording_shards,
     f"{trainer.ITERATOR}.load_state_dict": trainer.rescaling_position},
    "a mid-epoch checkpoint resumed on another number of processes skipped the wrong number of "
    "batches (fairseq's position counts one rank's batches: resumed on W' processes from W it "
    "skipped W'/W times the batches read); the position is kept in batches of all processes",
    None, "9ca3004ba26d6279", "a0f27922a05bd774", version="fairseq 0.12.3")
