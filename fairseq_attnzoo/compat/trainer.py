"""The wrappers of the table's rows (:mod:`.fixes`) that change what fairseq's trainer does around
the model: the parameters it catalogues as shared (none of them absent), the checkpoint folder
of a run that saves nothing, and the checkpoint rank 0 broadcasts when a run resumes on several
processes. Nothing here is applied on import; the rows install them."""

import inspect
import logging
import os

logger = logging.getLogger("fairseq_attnzoo.compat")


# ---- shared parameters: none of them absent ------------------------------------------------------

def skipping_absent(catalog_shared_params):
    """``fairseq.trainer._catalog_shared_params`` without the absent ones (a bias-free Linear holds
    ``bias = None``): fairseq grouped every None as one parameter shared by all of them."""

    def catalog_present_shared_params(module, memo=None, prefix=""):
        groups = catalog_shared_params(module, memo, prefix)
        if groups is None:  # a recursive call: fairseq's memo is filled in place
            return None
        return [paths for paths in groups if _get_by_path(module, paths[0]) is not None]

    return catalog_present_shared_params


def _get_by_path(module, path: str):
    for name in path.split("."):
        module = getattr(module, name, None)
    return module


# ---- --no-save: no checkpoint folder ----------------------------------------------------------

SAVE = "fairseq.checkpoint_utils:save_checkpoint"
VERIFY_SAVE_DIR = "fairseq.checkpoint_utils:verify_checkpoint_directory"


def _caller_cfg():
    """The ``cfg`` of the function that called the caller of this function, or None."""
    frame = inspect.currentframe()
    frame = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    return frame.f_locals.get("cfg") if frame is not None else None


def _no_folder_made(fn, save_dir: str, no_save: bool, *args):
    """``fn(*args)``, then the folder ``save_dir`` removed again when it made it empty for a run
    that saves nothing."""
    existed = os.path.exists(save_dir)
    out = fn(*args)
    if no_save and not existed and os.path.isdir(save_dir) and not os.listdir(save_dir):
        os.rmdir(save_dir)
    return out


def verifying(verify):
    """``checkpoint_utils.verify_checkpoint_directory`` that leaves no folder it made for a run
    that saves nothing (--no-save)."""

    def verify_checkpoint_directory(save_dir):  # called by fairseq_cli.train.main(cfg)
        checkpoint = getattr(_caller_cfg(), "checkpoint", None)
        return _no_folder_made(verify, save_dir, bool(getattr(checkpoint, "no_save", False)),
                               save_dir)

    return verify_checkpoint_directory


def saving(save):
    """``checkpoint_utils.save_checkpoint`` that leaves no folder it made under --no-save."""

    def save_checkpoint(cfg, trainer, epoch_itr, val_loss):
        return _no_folder_made(save, cfg.save_dir, cfg.no_save, cfg, trainer, epoch_itr, val_loss)

    return save_checkpoint


TRAINER_SAVE = "fairseq.trainer:Trainer.save_checkpoint"
CRASH = "crash.pt"


def saving_crash(save_checkpoint):
    """``Trainer.save_checkpoint`` that writes fairseq's crash checkpoint (``SAVE_DIR/crash.pt``,
    saved by ``train_step`` when a step raises) into a folder made for it: under --no-save no
    folder was made at the start, and the save's ``FileNotFoundError`` replaced the step's own
    error. The folder is made then, as stock fairseq has it (a crashed run writes crash.pt, its
    state before the failed step, --no-save or not); a crash save that fails all the same logs one
    warning and the step's own error goes on. Every other save is fairseq's."""

    def trainer_save_checkpoint(self, filename, extra_state):
        if os.path.basename(str(filename)) != CRASH:
            return save_checkpoint(self, filename, extra_state)
        try:
            os.makedirs(os.path.dirname(str(filename)) or ".", exist_ok=True)
            return save_checkpoint(self, filename, extra_state)
        except Exception as e:  # the step's error, which fairseq re-raises next, is the one
            logger.warning(f"the crash checkpoint {filename} could not be written ({e}); the "
                           "error of the training step follows")
            return None

    return trainer_save_checkpoint


# ---- a resume on several processes: rank 0's checkpoint, received -------------------------------

BROADCAST = "fairseq.distributed.utils:_broadcast_object_slow"


def trusting_broadcast(broadcast_object_slow):
    """``fairseq.distributed.utils._broadcast_object_slow`` whose receiving ranks unpickle the
    object without torch's weights-only loader. fairseq resumes a multi-process run by loading the
    checkpoint on rank 0 and broadcasting it (unless --load-checkpoint-on-all-dp-ranks): the
    object is this job's own, sent by its rank 0 over its own process group, and it holds the
    omegaconf config fairseq made from the file, which the weights-only loader refuses. The
    sending rank runs fairseq's code unchanged."""
    import io

    import torch
    from fairseq.distributed import utils

    def _broadcast_object_slow(obj, src_rank, group, dist_device):
        if utils.get_rank(group) == src_rank:
            return broadcast_object_slow(obj, src_rank, group, dist_device)
        length = torch.zeros(1, dtype=torch.long, device=dist_device)
        utils.broadcast(length, src=src_rank, group=group)
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=dist_device)
        utils.broadcast(data, src=src_rank, group=group)
        return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu",
                          weights_only=False)

    return _broadcast_object_slow


# ---- a mid-epoch resume on another number of processes ------------------------------------------

ITERATOR = "fairseq.data.iterators:EpochBatchIterator"


def recording_shards(state_dict):
    """``EpochBatchIterator.state_dict`` that also records the number of processes (shards) the
    position ``iterations_in_epoch`` counts batches of (fairseq's loader ignores the key)."""

    def state_dict_with_shards(self):
        out = state_dict(self)
        out["num_shards"] = self.num_shards
        return out

    return state_dict_with_shards


def rescaling_position(load_state_dict):
    """``EpochBatchIterator.load_state_dict`` that continues the epoch where a run on another
    number of processes saved it: fairseq's position counts the batches ONE rank consumed, so a
    run resumed on W' processes from W skipped W'/W times the batches the saved run had read
    (replaying or skipping data). The position becomes the same number of batches in all."""
    def load_state_dict_at_any_world_size(self, state_dict):
        saved, position = state_dict.get("num_shards"), state_dict.get("iterations_in_epoch", 0)
        if saved and position and saved != self.num_shards:
            consumed = position * saved
            if consumed % self.num_shards:
                logger.warning(
                    f"resumed on {self.num_shards} processes from a run on {saved} that had read "
                    f"{consumed} batches of epoch {state_dict['epoch']}, not a multiple of "
                    f"{self.num_shards}: the epoch goes on from batch "
                    f"{consumed // self.num_shards * self.num_shards} (the last "
                    f"{consumed % self.num_shards} read are read again)")
            state_dict = dict(state_dict, iterations_in_epoch=consumed // self.num_shards)
        return load_state_dict(self, state_dict)

    return load_state_dict_at_any_world_size
