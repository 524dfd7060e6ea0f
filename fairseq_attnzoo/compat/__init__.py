"""Every change this plugin makes to another library (fairseq, torch, numpy), in one table.

Each entry is a named :class:`Patch`: what it changes, why, and a check that the target is the
version it was written for. :func:`apply_all` applies each entry whose check passes; each is then
``applied``, ``unchanged`` (nothing needed changing in this process), ``skipped`` (the target is
not the version we know, so we leave it alone and say so in a warning) or ``disabled``.

Where the entries live: the machinery (:class:`Patch`, :func:`fix`, :func:`apply_all`,
:func:`undo_all`, ...) is :mod:`.machinery`, re-exported here; the rows are :mod:`.fixes`, the
table, one row per change: its target named once, the library version it fixes, why; the code a
row installs lives with what it serves (:mod:`.mixed_precision` for fairseq's optimizers,
:mod:`.data` for its data and checkpoints, :mod:`.trainer` for its trainer's shared-parameter
catalogue and ``--no-save`` folder, :mod:`.console` for how its commands answer a mistake,
:mod:`.known_warnings` for the warnings that say nothing to act on, :mod:`.run_end` for the end of
a training run; what the lines say is :mod:`fairseq_attnzoo.messages`). The hooks
of our own features are registered by their owners (``fairseq_meters_slot_usage`` in
``models/pkm.py``, the ``fairseq_sharded_value_*`` entries in ``models/pkm_shard.py``,
``fairseq_resume_host_flags`` in ``models/transformer.py``, ``fairseq_model_from_checkpoint`` in
``models/registry.py``). Every row returns its undo, or :data:`NOTHING_CHANGED` where it found
nothing to change in this process (status ``unchanged``); :func:`undo_all` undoes them all, the
process environment included.

Nothing is applied when the package or its plain PyTorch modules are imported. The table is
applied where fairseq uses the plugin: when fairseq imports it as a user dir (``--user-dir``,
hydra's ``common.user_dir``), when one of its models, tasks, criterions or optimizers is built,
when one of its console commands runs, and when a program calls :func:`fairseq_attnzoo.enable`
(needed before loading a checkpoint in a script: fairseq's ``torch.load`` needs the weights-only
allow-list before any model is built).

Opt out with the environment variable ``ATTNZOO_COMPAT_DISABLE``: a comma-separated list of entry
names, or ``all``. A model that cannot be right without an entry (adaptive spans under
``--fp16``/``--bf16`` need ``fairseq_fp16_master_projection``) refuses to build, in one line naming
the entry, when that entry was skipped or disabled (:func:`require`). :func:`status` says what
happened to each entry; :func:`describe` prints the table (``attnzoo-archs --compat``).

For fairseq functions, "the version we know" is the SHA-256 of the function's source (first 16 hex
digits) as shipped by ``fairseq-fixed==0.12.3.1``: a fairseq that changed the function gets no
patch and a warning, rather than a fix written for other code.
"""

# the machinery, then the table (registers its rows, in order), and what its rows compute, for
# scripts and tests
from .machinery import (APPLIED, DISABLED, ENV, ENV_DISABLE, NOTHING_CHANGED,  # noqa: F401
                        PATCHES, SKIPPED, UNCHANGED, Patch, always, apply_all, built_by_fairseq,
                        describe, disabled_names, fix, known_source, lookup, register, replace,
                        require, restore, source_digest, status, together, undo_all)
from . import fixes  # noqa: F401,E402  (registers the rows)
from .data import (bpe_name, check_block_length, padding_batches_first,  # noqa: F401,E402
                   remove_bpe_mismatch, segmentation_counts, sentencepiece_without_bpe)
from .mixed_precision import bf16_without_tpu, xla_available  # noqa: F401,E402
